"""Committed parts: a sender's signed commitment to every part it sends in a round, sans I/O.

In a round that the reducers' checks cover (``verification.py``), a reducer answers each checker
in private, so without more it could state the checker's own contribution truly and fabricate the
others' so that they fit a false aggregate. Every sender therefore commits, before it sends
anything, to every part it will send in the round: it encodes them all, and signs with its
identity key one statement that binds the round (group ID), itself, its weight, and per reducer
the digests of that reducer's parts exactly as they will go on the wire (codec meta and encoded
payload). The commitment travels in the header of each of its streams. A reducer verifies the
signature once per sender, then each part's digest against the commitment as it arrives; a part
that does not match is refused, as any malformed one, so a hostile sender cannot plant a
contribution that would later make an honest reducer look like a liar. The reducer keeps each
input as sent, with its sender's commitment, and hands both over with each check's answer. The
checker decodes every stated input itself and requires it to match its sender's signed digest for
that reducer and part: a reducer can no longer state a contribution that its sender did not send
it. (A sender that signs two different commitments for one round only commits itself: each
reducer holds a signed statement of what that sender sent it.)

One statement per sender and round, not one per part, is what keeps the checks cheap: a checker
meets the same commitments in every check of the round, and already verified most of them as a
reducer, so each is verified once (``VerifiedSignatures``) and a check costs digests, not
signature verifications.

A sender's public key travels with its commitment; its peer ID is the hash of that key
(``peer/identity.py``), so the key proves itself. Rounds nobody checks (the plain mean, or
CenteredClip with the checks off) carry no commitments.

Cost: one BLAKE3 pass over each encoded part by its sender and one by its reducer, one Ed25519
signature per sender and round, one verification per sender at each reducer and each checker
that meets a commitment it has not verified; every part is encoded before the first one is sent
(for a lossy codec, the encoded vector is held for the round).
"""

from __future__ import annotations

import functools
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from peer import PeerID
from peer.identity import Identity, verify_signature
from peer.packing import packb

__all__ = [
    "DIGEST_BYTES",
    "MAX_COMMITMENT_BYTES",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Commitment",
    "SignedPart",
    "VerifiedSignatures",
    "commit",
    "part_digest",
]

_CONTEXT = b"peerd-committed-round\0"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
DIGEST_BYTES = 32
# A commitment names at most this many reducers and parts: a group's, with room (a 2**31-value
# vector in parts of 2**15 values); anything larger is refused before it is hashed.
MAX_REDUCERS = 1024
MAX_PARTS = 1 << 16
# A commitment's wire form (msgpack) is at most this long: its digests, and per reducer a peer ID
# (a multihash: a few dozen bytes) and msgpack's framing, with room.
MAX_COMMITMENT_BYTES = MAX_PARTS * DIGEST_BYTES + MAX_REDUCERS * 128 + 1024


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


@dataclass(frozen=True)
class Commitment:
    """A sender's signed statement of every part it sends in one round: per reducer (peer ID
    bytes), the digests of its parts, concatenated. The round, the sender and its weight are
    not carried: whoever verifies supplies them, as it knows them."""

    public_key: bytes
    signature: bytes
    digests: tuple[tuple[bytes, bytes], ...]

    def digest(self, reducer: PeerID, part: int) -> bytes | None:
        """The committed digest of part ``part`` of ``reducer``'s shard, if there is one."""
        blob = self.parts_of(reducer)
        if blob is None or not 0 <= part < len(blob) // DIGEST_BYTES:
            return None
        return blob[part * DIGEST_BYTES : (part + 1) * DIGEST_BYTES]

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """BLAKE3-256 of the whole commitment (key, signature, digests; its msgpack as
        ``to_wire`` writes it): what names it when a check's answer leaves it out. By its whole
        content, not by its signature: two commitments with one signature and other digests must
        never pass for each other, whatever keys a verifier admits (a small-order key, which
        ``peer.identity.verify_signature`` refuses, signs many statements with one signature)."""
        return blake3(packb(self.to_wire()), max_threads=1).digest()

    def parts_of(self, reducer: PeerID) -> bytes | None:
        wanted = reducer.to_bytes()
        return next((blob for peer, blob in self.digests if peer == wanted), None)

    def verify(
        self, group_id: bytes, sender: PeerID, weight: float, verified: VerifiedSignatures | None = None
    ) -> bool:
        """Whether ``sender`` (whose key this must be) signed this commitment for round
        ``group_id`` with ``weight``; never raises."""
        claim = (self.public_key, self.signature, group_id, sender.to_bytes(), float(weight), self.digests)
        if verified is not None and claim in verified:
            return True
        if PeerID.from_public_key(self.public_key) != sender:
            return False
        statement = commitment_statement(group_id, sender, weight, self.digests)
        if not verify_signature(self.public_key, self.signature, statement):
            return False
        if verified is not None:
            verified.add(claim)
        return True

    def to_wire(self) -> list[Any]:
        return [self.public_key, self.signature, [list(entry) for entry in self.digests]]

    @classmethod
    def from_wire(cls, raw: Any) -> Commitment:
        """A commitment as received, checked for shape and bounds (raises ValueError)."""
        if not (isinstance(raw, list) and len(raw) == 3):
            raise ValueError("a commitment is [key, signature, digests]")
        key, signature, entries = raw
        if not (isinstance(key, bytes) and len(key) == PUBLIC_KEY_BYTES):
            raise ValueError("malformed commitment key")
        if not (isinstance(signature, bytes) and len(signature) == SIGNATURE_BYTES):
            raise ValueError("malformed commitment signature")
        if not (isinstance(entries, list) and len(entries) <= MAX_REDUCERS):
            raise ValueError("malformed commitment digests")
        digests, size = [], 0
        for entry in entries:
            if not (type(entry) is list and len(entry) == 2 and type(entry[0]) is bytes and type(entry[1]) is bytes):
                raise ValueError("malformed commitment entry")
            size += len(entry[1])
            digests.append((entry[0], entry[1]))
        if size > MAX_PARTS * DIGEST_BYTES or any(len(blob) % DIGEST_BYTES for _peer, blob in digests):
            raise ValueError("malformed commitment digests")
        return cls(key, signature, tuple(digests))


def commitment_statement(
    group_id: bytes, sender: PeerID, weight: float, digests: tuple[tuple[bytes, bytes], ...]
) -> bytes:
    """The bytes a sender signs: the round, itself, its weight and its parts' digests."""
    return _CONTEXT + packb([group_id, sender.to_bytes(), float(weight), [list(entry) for entry in digests]])


def commit(identity: Identity, group_id: bytes, weight: float, shards: list[tuple[PeerID, list[bytes]]]) -> Commitment:
    """Our commitment, for round ``group_id``, to the parts of each reducer's shard whose digests
    ``shards`` lists (reducer, its parts' digests in order)."""
    digests = tuple((reducer.to_bytes(), b"".join(parts)) for reducer, parts in shards)
    signature = identity.sign(commitment_statement(group_id, identity.peer_id, weight, digests))
    return Commitment(identity.public_key, signature, digests)


# Commitments a peer verified lately: a round's members, in its last few rounds, with room; and at
# most this many bytes of digests among them (each claim holds its commitment's digests, which a
# sender may pad with shards of reducers that do not exist up to its header's limit: 1 MiB).
VERIFIED_KEPT = 256
VERIFIED_BYTES = 32 << 20


class VerifiedSignatures:
    """Commitments this peer verified lately, so that the same one, met again in the same round
    (as a reducer, then in each check), is verified once. Only successes are kept, each as the
    whole claim it verified (key, signature, round, sender, weight, digests); the oldest go first
    beyond ``VERIFIED_KEPT`` claims or ``VERIFIED_BYTES`` of digests (one forgotten costs only
    its verification again). Thread-safe: a reducer adds on the event loop while checks of large
    parts verify in worker threads."""

    def __init__(self, kept: int = VERIFIED_KEPT, kept_bytes: int = VERIFIED_BYTES):
        self.kept = kept
        self.kept_bytes = kept_bytes
        self.bytes = 0  # of digests among the claims kept
        self._seen: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, claim: tuple[Any, ...]) -> bool:
        return claim in self._seen

    def add(self, claim: tuple[Any, ...]) -> None:
        size = sum(len(peer) + len(blob) for peer, blob in claim[-1])
        with self._lock:
            if size > self.kept_bytes or claim in self._seen:
                return
            self._seen[claim] = size
            self.bytes += size
            while len(self._seen) > self.kept or self.bytes > self.kept_bytes:
                self.bytes -= self._seen.popitem(last=False)[1]


@dataclass(frozen=True)
class SignedPart:
    """One sender's part as it was sent, and the sender's commitment to it: what a reducer keeps
    for the checks. ``payload`` None: the part is float32 as is (codec "none"), and its bytes are
    the values the reducer keeps anyway (no second copy)."""

    commitment: Commitment
    meta: Any
    payload: Any  # bytes-like, or None (see above)
