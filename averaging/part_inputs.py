"""A check's answer on the wire (``avg.check``, ``verification.py``), sans I/O: the inputs a
reducer aggregated for one part, each as its sender sent it with its sender's commitment.

The answer leaves out what the asking sender already holds (``AskerHolds``): its own input, which
it sent, and the commitments of the round it met itself as a reducer, named in its request by
their fingerprints (``Commitment.fingerprint``). Over a slow link the checks run after the round,
before its averages are used, and the reducer's uplink carries every checker's answer at once: at
4 senders in 64 parts per shard (16 MiB over 100 Mbit/s) the asker's own row was a quarter of each
answer and the senders' commitments another ninth, all of it bytes the asker had. Leaving them
out changes nothing a check proves: the asker recomputes from its own input exactly as sent, and a
commitment is left out only when the reducer's copy is the very one the asker holds, byte for byte
(a sender that hands two reducers two different commitments, each validly signed, still has the
reducer's copy sent in full). A request without ``held`` (a peer that predates it) gets the whole
answer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from peer import PeerID
from peer.packing import packb, unpackb
from peer.tensors import all_finite, tensor_bytes

from .commitments import DIGEST_BYTES, MAX_COMMITMENT_BYTES, Commitment, SignedPart
from .compression import codec_of
from .robust import Aggregation

__all__ = ["AskerHolds", "PartInputs", "MAX_ENCODED_BYTES_PER_VALUE", "MAX_HELD", "held_fingerprints"]

# An encoded input is at most float32 (and a few bytes of header) per value.
MAX_ENCODED_BYTES_PER_VALUE = 5
# A check's request names at most this many commitments it holds (a group's senders, with room).
MAX_HELD = 1024


@dataclass(frozen=True)
class AskerHolds:
    """What a checker holds of its check's answer, which the reducer leaves out: its own input to
    the part (as the reducer decoded it) and this round's commitments it holds, by sender (its own
    among them)."""

    me: PeerID
    own: torch.Tensor
    commitments: dict[PeerID, Commitment] = field(default_factory=dict)

    def request(self) -> list[bytes]:
        """The fingerprints of the commitments we hold, as the check's request names them."""
        return [commitment.fingerprint for commitment in self.commitments.values()]


def held_fingerprints(raw: Any) -> frozenset[bytes] | None:
    """A check request's ``held`` field: the fingerprints of the commitments the asker holds;
    None where the request has none or names them in any other form (an asker that predates it,
    or one of another version): it gets the whole answer, which every asker can judge."""
    if not (isinstance(raw, list) and len(raw) <= MAX_HELD):
        return None
    if not all(isinstance(f, bytes) and len(f) == DIGEST_BYTES for f in raw):
        return None
    return frozenset(raw)


@dataclass
class PartInputs:
    """What a reducer aggregated for one part: who (in order), their claimed weights, their
    values (one row each), the clip radius, and each input as its sender sent it, with its
    commitment (``commitments.py``): on the wire the values travel only as those parts, and the
    checker decodes them itself."""

    senders: list[PeerID]
    weights: list[float]
    values: torch.Tensor  # len(senders) x part size, float32
    tau: float
    aggregation: Aggregation
    start: int | None = None  # the row CenteredClip started from (None: the coordinate-wise median)
    signed: list[SignedPart] = field(default_factory=list)  # one per sender (the answer's only values)
    neighbours: list[list[int]] | None = None  # the rows each row was mixed with (``mixing.py``)

    def row_payload(self, row: int) -> Any:
        """Input ``row`` as its sender sent it (a float32 one is its kept values)."""
        payload = self.signed[row].payload
        return tensor_bytes(self.values[row]) if payload is None else payload

    def to_message(
        self, asker: PeerID | None = None, held: frozenset[bytes] | None = None
    ) -> tuple[dict[str, Any], Any]:
        """The answer to ``asker``: the fields in the body; the inputs as sent, then their senders'
        commitments (msgpack, each its sender's whole round: group size x shards' parts x 32 bytes
        in all, more than a body's one record holds for a large model in a large group), in the
        payload. Given ``held`` (the fingerprints the asker's request named), the asker's own
        input goes as nothing (size 0, meta nil, commitment size 0), and so does each commitment
        whose fingerprint ``held`` names (commitment size 0); without it, everything goes."""
        if len(self.signed) != len(self.senders):
            raise ValueError("every input needs its signed part")
        mine = self.senders.index(asker) if held is not None and asker in self.senders else None
        held = held or frozenset()
        payloads = [b"" if row == mine else self.row_payload(row) for row in range(len(self.senders))]
        commits = [
            b"" if row == mine or s.commitment.fingerprint in held else packb(s.commitment.to_wire())
            for row, s in enumerate(self.signed)
        ]
        body = {
            "senders": [p.to_bytes() for p in self.senders],
            "weights": list(self.weights),
            "tau": self.tau,
            "aggregation": self.aggregation.value,
            "start": self.start,
            "neighbours": self.neighbours,
            "metas": [None if row == mine else s.meta for row, s in enumerate(self.signed)],
            "sizes": [len(p) for p in payloads],
            "commit_sizes": [len(c) for c in commits],
        }
        if all(s.payload is None for s in self.signed):  # all float32: the kept values as they are
            rows = [self.values] if mine is None else [self.values[:mine], self.values[mine + 1 :]]
            payloads = [tensor_bytes(r.contiguous()) for r in rows if r.shape[0]]
        return body, b"".join([*payloads, *commits])

    @classmethod
    def parse(
        cls, body: Any, payload: Any, part_size: int, max_senders: int, holds: AskerHolds | None = None
    ) -> PartInputs:
        """A check's answer, checked field by field and its inputs decoded (raises ValueError);
        the commitments are checked by ``PartCheck.verdict``. ``holds``: what the answer may
        leave out, as we hold it."""
        if not isinstance(body, dict):
            raise ValueError("a check answer is a map")
        raw, weights, tau = body.get("senders"), body.get("weights"), body.get("tau")
        if not (isinstance(raw, list) and isinstance(weights, list) and 0 < len(raw) == len(weights) <= max_senders):
            raise ValueError("a check answer names its senders and their weights")
        if not all(isinstance(p, bytes) for p in raw):
            raise ValueError("malformed sender")
        senders = [PeerID(p) for p in raw]
        if len(set(senders)) != len(senders):
            raise ValueError("a sender named twice")
        if not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in weights):
            raise ValueError("malformed weight")
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
            raise ValueError("malformed clip radius")
        aggregation = Aggregation(body.get("aggregation"))
        start = body.get("start")
        if not (start is None or (type(start) is int and 0 <= start < len(senders))):
            raise ValueError("malformed start")
        neighbours = body.get("neighbours")  # (whether they are nearest sets: ``PartCheck.verdict``)
        if not (
            neighbours is None
            or (
                isinstance(neighbours, list)
                and len(neighbours) == len(senders)
                and all(isinstance(s, list) and len(s) <= len(senders) for s in neighbours)
            )
        ):
            raise ValueError("malformed neighbour sets")
        metas, sizes, commit_sizes = (body.get(name) for name in ("metas", "sizes", "commit_sizes"))
        if not all(isinstance(f, list) and len(f) == len(senders) for f in (metas, sizes, commit_sizes)):
            raise ValueError("a check answer gives every input's meta, size and commitment size")
        if not all(type(n) is int and 0 <= n <= MAX_ENCODED_BYTES_PER_VALUE * part_size for n in sizes):
            raise ValueError("malformed input size")
        if not all(type(n) is int and 0 <= n <= MAX_COMMITMENT_BYTES for n in commit_sizes):
            raise ValueError("malformed commitment size")
        expected = sum(sizes) + sum(commit_sizes)
        if payload is None or len(payload) != expected:
            raise ValueError(f"expected {expected} bytes of inputs and commitments")
        view = memoryview(payload).cast("B")
        values = torch.empty(len(senders), part_size, dtype=torch.float32)
        signed, offset, commit_offset = [], 0, sum(sizes)
        for row, (sender, meta, size, commit_size) in enumerate(zip(senders, metas, sizes, commit_sizes, strict=True)):
            commitment = _commitment(view[commit_offset : commit_offset + commit_size], sender, holds)
            commit_offset += commit_size
            if meta is None:  # our own input, which we sent
                if holds is None or sender != holds.me or size:
                    raise ValueError("an input left out that is not ours")
                values[row].copy_(holds.own)
                signed.append(SignedPart(commitment, {"codec": "none"}, None))
                continue
            encoded = view[offset : offset + size]
            offset += size
            decoded = codec_of(meta).decode_into(meta, encoded, values[row])
            if decoded.dtype != torch.float32 or decoded.numel() != part_size:
                raise ValueError(f"an input decoded to {decoded.numel()} values, expected {part_size}")
            if decoded is not values[row]:
                values[row].copy_(decoded)
            signed.append(SignedPart(commitment, meta, encoded))
        if not all_finite(values):
            raise ValueError("non-finite inputs (a reducer refuses those)")
        return cls(senders, [float(w) for w in weights], values, float(tau), aggregation, start, signed, neighbours)


def _commitment(raw: memoryview, sender: PeerID, holds: AskerHolds | None) -> Commitment:
    """A sender's commitment as the answer gives it, or (given as nothing) the one we hold."""
    if len(raw):
        return Commitment.from_wire(unpackb(raw, max_size=MAX_COMMITMENT_BYTES))
    held = None if holds is None else holds.commitments.get(sender)
    if held is None:
        raise ValueError(f"the commitment of {sender} left out, which we do not hold")
    return held
