"""DHT node IDs that cost work to make: a price on Sybil placement.

A peer's ID is a hash of its public key, and keys are free: one core grinds tens of thousands of
them per second, enough to place twenty identities next to any chosen DHT key in a second and
swallow the records stored there. So the DHT does not place a peer by its peer ID but by a node ID
that only a solved puzzle yields (S/Kademlia's idea, adapted so that existing keys keep working):

    valid(peer_id, nonce)  iff  SHA-256("peerd-node-id-puzzle" | peer_id | nonce) has at least
                                ``difficulty`` leading zero bits
    node_id(peer_id, nonce) =   SHA-256("peerd-node-id" | peer_id | nonce)[:20]

Every valid nonce gives an unrelated, uniformly placed node ID, so landing one among the k nodes
nearest a key in a swarm of N peers takes about N/k solved puzzles of 2**difficulty hashes each;
checking one takes one hash (about half a microsecond). The peer ID still names the peer on
connections, and the Noise handshake proves it; the nonce travels beside it in hellos and contacts.

The difficulty is a setting of the swarm: every peer of a run checks every contact and every hello
against its own, so a run is started with one value (low for tests and local swarms, high for
public runs). A solution is stored beside the identity key and reused; a stored solution of a
higher difficulty satisfies a lower one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .identity import PEER_ID_BYTES, PeerID

__all__ = [
    "DEFAULT_DIFFICULTY",
    "LOCAL_DIFFICULTY",
    "NONCE_BYTES",
    "NodeIDProof",
    "check_difficulty",
    "load_or_solve",
    "proof_path",
    "search_range",
]

# Public runs: 2**24 hashes, about 10 s of one core in this Python solver (measured ~1.6 M hashes/s;
# OpenSSL's native SHA-256 does ~6 M/s per core, so a native attacker is ~4x faster). Placing 20
# identities next to one key in a swarm of 1,000 peers then costs ~1,000 solutions: ~45 min of a
# native core, ~3 h of this solver, instead of a second.
DEFAULT_DIFFICULTY = 24
# Tests and local swarms: a few hundred hashes, so start-up stays instant.
LOCAL_DIFFICULTY = 8
# Beyond this a solve takes days in Python: a value past it is a typo, not a policy.
MAX_DIFFICULTY = 40
NONCE_BYTES = 8

_PUZZLE_PREFIX = b"peerd-node-id-puzzle\0"
_NODE_ID_PREFIX = b"peerd-node-id\0"


def check_difficulty(difficulty: int) -> int:
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"node-ID difficulty must be an integer in 0..{MAX_DIFFICULTY}, got {difficulty!r}")
    return difficulty


def _leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


class NodeIDProof:
    """A peer ID with the nonce that places it in the DHT."""

    __slots__ = ("peer_id", "nonce", "node_id", "work_bits")

    def __init__(self, peer_id: PeerID, nonce: bytes):
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise ValueError(f"a node-ID nonce has {NONCE_BYTES} bytes")
        self.peer_id = peer_id
        self.nonce = nonce
        raw = peer_id.to_bytes()
        self.work_bits = _leading_zero_bits(hashlib.sha256(_PUZZLE_PREFIX + raw + nonce).digest())
        self.node_id: bytes = hashlib.sha256(_NODE_ID_PREFIX + raw + nonce).digest()[:PEER_ID_BYTES]

    def satisfies(self, difficulty: int) -> bool:
        return self.work_bits >= difficulty

    @classmethod
    def claimed(cls, peer_id: PeerID, nonce: Any, difficulty: int) -> NodeIDProof:
        """The proof a peer's record claims with ``nonce``; ValueError unless it solves the puzzle
        at ``difficulty`` (a record that places its writer by node ID must show the work)."""
        proof = cls(peer_id, nonce)
        if not proof.satisfies(difficulty):
            raise ValueError("the writer's node-ID nonce does not solve the puzzle")
        return proof

    @classmethod
    def solve(cls, peer_id: PeerID, difficulty: int, *, start: int = 0) -> NodeIDProof:
        """Search nonces from ``start`` until one meets ``difficulty`` (2**difficulty tries on average),
        in this process (``peer/node_id_solver.py`` searches on every core)."""
        check_difficulty(difficulty)
        raw = peer_id.to_bytes()
        while (nonce := search_range(raw, difficulty, start, 1 << 16)) is None:
            start += 1 << 16
        return cls(peer_id, nonce)

    def __repr__(self) -> str:
        return f"NodeIDProof({self.peer_id}, {self.nonce.hex()}, {self.work_bits} bits)"


def search_range(peer_bytes: bytes, difficulty: int, start: int, count: int) -> bytes | None:
    """The first nonce in ``start .. start + count`` that solves the puzzle for ``peer_bytes``, or None."""
    base = hashlib.sha256(_PUZZLE_PREFIX + peer_bytes)
    bound = 1 << (256 - difficulty)  # a digest below this has `difficulty` leading zero bits
    for counter in range(start, start + count):
        nonce = counter.to_bytes(NONCE_BYTES, "little")
        attempt = base.copy()
        attempt.update(nonce)
        if int.from_bytes(attempt.digest(), "big") < bound:
            return nonce
    return None


def proof_path(identity_path: str | os.PathLike[str]) -> Path:
    """Where the solution for the key at ``identity_path`` is kept: beside it."""
    path = Path(identity_path)
    return path.with_name(path.name + ".node-id")


def load_or_solve(
    identity_path: str | os.PathLike[str] | None,
    peer_id: PeerID,
    difficulty: int,
    *,
    on_solve: Callable[[Path | None], None] | None = None,
    solver: Callable[[PeerID, int], NodeIDProof] = NodeIDProof.solve,
) -> NodeIDProof:
    """The stored solution for this key if it meets ``difficulty``, else a new one from ``solver``
    (stored when there is a key file to store it beside). A damaged or foreign file is replaced, not
    trusted. ``on_solve(path)`` runs just before a solve starts (to tell a user why start-up pauses)."""
    check_difficulty(difficulty)
    path = proof_path(identity_path) if identity_path is not None else None
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text())
            proof = NodeIDProof(PeerID.from_string(stored["peer_id"]), bytes.fromhex(stored["nonce"]))
            if proof.peer_id == peer_id and proof.satisfies(difficulty):
                return proof
        except (ValueError, KeyError, TypeError):
            pass
    if on_solve is not None:
        on_solve(path)
    proof = solver(peer_id, difficulty)
    if path is not None:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps({"peer_id": str(peer_id), "nonce": proof.nonce.hex(), "bits": proof.work_bits}))
        os.replace(temporary, path)
    return proof
