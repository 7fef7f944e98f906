"""Ed25519 signatures this process verified lately, so that one met again is not verified again.

A DHT dictionary record (a matchmaking declaration, a progress record: one owner-signed subkey per
peer) is checked when a node stores it, again whenever the node answers a get with it, and again by
every reader that receives it: in a swarm of N peers, each read of such a key costs N Ed25519
verifications (about 50 us each) at the node that holds it and at the reader. The records
themselves change only when their owners re-sign them, so nearly all of those verifications repeat
one done before. ``VerifiedSignatureCache`` remembers the successes and answers a repeat from
memory.

What a hit proves: the cache is keyed by a SHA-256 digest of the exact (public key, signature,
signed message) triple, each part length-prefixed, so a hit means that this very triple verified
before; a record whose value, expiration, version, key or signature differs in one bit hashes to
another key and is verified afresh (and refused if forged). Failures are never kept, so the cache
cannot be taught to accept anything. Someone who floods a node with valid records of their own can
only push older entries out, which costs their verification again, not correctness; and memory is
bounded by the number of entries whatever the records' sizes, since an entry holds a 32-byte
digest, never the message.

One cache serves the whole process by default (``default_signature_cache``): the nodes of one
process (many of them in tests and simulations) meet the same records, and each triple then costs
one verification in all instead of one per node. A caller that needs its own (a test counting
verifications) passes one in.

All-reduce commitments keep a cache of their own (``averaging/commitments.py``): each averaging peer
remembers the claims it verified (round, sender, weight, part digests) for its own reducer checks.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable

from .identity import verify_signature

__all__ = ["SIGNATURES_KEPT", "VerifiedSignatureCache", "default_signature_cache"]

# How many verified triples a cache keeps. A peer of a 10,000-peer swarm reads whole dictionaries of
# up to one entry per peer (progress, its matchmaking group's declarations: ~2 x 10,000), and holds
# the replicas of its share of the swarm's records (about k = 20 times the few records each peer
# owns); one process simulating 1,000 peers meets each of their ~4 live records (progress,
# declaration, donor offer, expert announcements) plus the versions that replace them as they are
# re-signed. 2**15 covers both with room. An entry (a 32-byte digest in the ordered map) takes about
# 150 bytes in CPython 3.12, so a full cache holds about 5 MB.
SIGNATURES_KEPT = 1 << 15

Verifier = Callable[[bytes, bytes, bytes], bool]


class VerifiedSignatureCache:
    """``verify(public_key, signature, message)`` as ``peer.identity.verify_signature`` answers it,
    but each triple that verified is remembered (its digest) and answered from memory next time.

    At most ``capacity`` triples are kept; beyond that the least recently met goes first (0 keeps
    none: every call verifies). ``verifier`` does the real verification (a test passes a counting
    wrapper of ``verify_signature``). Thread-safe: nodes verify on their event loop, and one cache
    may serve several loops' threads of one process.
    """

    def __init__(self, capacity: int = SIGNATURES_KEPT, verifier: Verifier = verify_signature):
        if capacity < 0:
            raise ValueError("a cache keeps zero or more signatures")
        self.capacity = capacity
        self.verifier = verifier
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, public_key: bytes, signature: bytes, message: bytes) -> bool:
        """True if ``signature`` is ``public_key``'s Ed25519 signature of ``message``; never raises."""
        digest = _triple_digest(public_key, signature, message)
        with self._lock:
            if digest in self._verified:
                self._verified.move_to_end(digest)
                return True
        if not self.verifier(public_key, signature, message):
            return False  # never kept: a forgery stays one verification away from refusal
        with self._lock:
            self._verified[digest] = None
            while len(self._verified) > self.capacity:
                self._verified.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._verified)


def _triple_digest(public_key: bytes, signature: bytes, message: bytes) -> bytes:
    # Length prefixes: no two different triples run together into the same hashed bytes.
    digest = hashlib.sha256(struct.pack(">II", len(public_key), len(signature)))
    digest.update(public_key)
    digest.update(signature)
    digest.update(message)
    return digest.digest()


_PROCESS_CACHE = VerifiedSignatureCache()


def default_signature_cache() -> VerifiedSignatureCache:
    """The cache every component of this process uses unless given its own."""
    return _PROCESS_CACHE
