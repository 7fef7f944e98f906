"""Signed parts: a sender's commitment to each part it sends a reducer, sans I/O.

In a round that the reducers' checks cover (CenteredClip, ``verification.py``), a reducer answers
each checker in private, so without more it could state the checker's own contribution truly and
fabricate the others' so that they fit a false aggregate. Every sender therefore signs, with its
identity key, each part it sends: the signature binds the round (group ID), the reducer, the part's
index in that reducer's shard, the sender, its weight, and a digest of the part exactly as sent on
the wire (its codec meta and encoded payload). The reducer verifies the signature against what it
received before it accepts the part (a part that does not match is refused, as any malformed one,
so a hostile sender cannot plant a contribution that would later make an honest reducer look like
a liar), keeps the encoded part and its signature with the inputs it keeps for the checks, and
hands both over with each check's answer. The checker decodes every stated input itself and
requires its sender's signature on it: a reducer can no longer state a contribution that its
sender did not send it.

A sender's public key travels with its stream's header and with each check answer; its peer ID is
the hash of that key (``peer/identity.py``), so the key proves itself. Rounds nobody checks (the
plain mean, or CenteredClip with the checks off) carry no signatures.

Cost: one BLAKE3 pass over each encoded part and one Ed25519 signature per part sent, one pass and
one verification per part received, and the checker's passes and verifications over the parts it
checks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from peer import PeerID
from peer.identity import Identity, verify_signature
from peer.packing import packb

__all__ = ["PUBLIC_KEY_BYTES", "SIGNATURE_BYTES", "SignedPart", "part_digest", "sign_part", "verify_part"]

_CONTEXT = b"peerd-signed-part\0"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def part_digest(meta: Any, payload: Any) -> bytes:
    """BLAKE3-256 of a part as sent: its codec meta (msgpack) and its encoded payload. (BLAKE3:
    every byte of a checked round is hashed twice, by its sender and by its reducer; BLAKE3 does
    ~6 GB/s on one core here, SHA-256 ~1.7 (with SHA-NI) and BLAKE2b ~0.8.)"""
    packed = packb(meta)
    digest = blake3(max_threads=1)
    digest.update(struct.pack(">I", len(packed)))
    digest.update(packed)
    digest.update(payload)
    return digest.digest()


def _statement(group_id: bytes, reducer: PeerID, part: int, sender: PeerID, weight: float, digest: bytes) -> bytes:
    return _CONTEXT + packb([group_id, reducer.to_bytes(), part, sender.to_bytes(), float(weight), digest])


def sign_part(
    identity: Identity, group_id: bytes, reducer: PeerID, part: int, weight: float, meta: Any, payload: Any
) -> bytes:
    """Our signature on part ``part`` of ``reducer``'s shard in round ``group_id``, as encoded."""
    digest = part_digest(meta, payload)
    return identity.sign(_statement(group_id, reducer, part, identity.peer_id, weight, digest))


def verify_part(
    public_key: Any,
    signature: Any,
    group_id: bytes,
    reducer: PeerID,
    part: int,
    sender: PeerID,
    weight: float,
    meta: Any,
    payload: Any,
) -> bool:
    """Whether ``sender`` (whose key ``public_key`` must be) signed this part as sent; never raises."""
    if not (isinstance(public_key, bytes) and len(public_key) == PUBLIC_KEY_BYTES):
        return False
    if not (isinstance(signature, bytes) and len(signature) == SIGNATURE_BYTES):
        return False
    if PeerID.from_public_key(public_key) != sender:
        return False
    try:
        digest = part_digest(meta, payload)
    except (TypeError, ValueError):  # meta that msgpack cannot pack (it came from the wire: it can)
        return False
    return verify_signature(public_key, signature, _statement(group_id, reducer, part, sender, weight, digest))


@dataclass(frozen=True)
class SignedPart:
    """One sender's part as it was sent and signed: what a reducer keeps for the checks.
    ``payload`` None: the part is float32 as is (codec "none"), and its bytes are the values the
    reducer keeps anyway (no second copy)."""

    public_key: bytes
    signature: bytes
    meta: Any
    payload: Any  # bytes-like, or None (see above)
