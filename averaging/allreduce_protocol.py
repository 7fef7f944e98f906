"""The all-reduce's messages and what each side does with them, sans I/O.

One ``avg.reduce`` stream runs from every sender to every reducer (the sender opens it) and
carries, in this order::

    sender  -> reducer   {"group_id": bytes, "weight": float, "total": int}
    sender  -> reducer   {"part": i, "meta": codec meta} + payload, for i = 0, 1, ... (then end)
    reducer -> sender    {"contributors": [peer ID bytes, ...], "averaged": bool}
    reducer -> sender    {"part": i, "meta": codec meta} + payload, for i = 0, 1, ... (if averaged)

Parts are the plan's parts of the reducer's shard (``AllReducePlan.parts``), encoded by a codec
that the meta names (``averaging/compression.py``). Everything a remote peer sends is checked
here: a reducer rejects a contribution with a reason (``ContributionRejected``) and a sender
refuses a reply (``AllReduceError``). Values are checked finite once per direction: a reducer's
in ``ShardReduction.add_part``, a sender's in ``AverageInbox.accept``, an averaged shard by its
codec's ``encode`` as it is encoded; local values are checked by the caller before they are cut
into parts, which is why outgoing parts use ``encode_finite``.

The objects here hold no sockets and take no locks; the trio driver (``averaging/allreduce.py``)
reads messages, feeds them in, sends what they return, and decides which tensor work is heavy
enough for a worker thread.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from peer import PeerID
from peer.tensors import all_finite

from .compression import Codec, codec_of
from .part_buffers import PartSink
from .reduction import ContributionRejected, ReductionOutcome, ShardReduction

__all__ = [
    "REDUCE_METHOD",
    "AllReduceError",
    "AverageInbox",
    "ContributionInbox",
    "IncomingPart",
    "ReduceHeader",
    "ReducerShard",
    "Reply",
    "ReplySummary",
    "part_body",
]

REDUCE_METHOD = "avg.reduce"


class AllReduceError(RuntimeError):
    """This peer cannot take part in the round, or a reducer's reply broke the protocol."""


@dataclass(frozen=True)
class ReduceHeader:
    """The first message of a stream: which round, the sender's weight, and the size of the
    flattened tensors (every member must average the same number of values)."""

    group_id: bytes
    weight: Any  # checked by ShardReduction.set_weight, which rejects only this sender for it
    total: int

    def to_body(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "weight": self.weight, "total": self.total}

    @classmethod
    def parse(cls, body: Any) -> ReduceHeader:
        if not (isinstance(body, dict) and isinstance(body.get("group_id"), bytes) and type(body.get("total")) is int):
            raise ValueError("avg.reduce expects {'group_id': bytes, 'weight': float, 'total': int}")
        return cls(body["group_id"], body.get("weight"), body["total"])


@dataclass(frozen=True)
class ReplySummary:
    """The reducer's first reply: whose contributions its average holds, and whether there is one."""

    contributors: list[PeerID]
    averaged: bool

    def to_body(self) -> dict[str, Any]:
        return {"contributors": [p.to_bytes() for p in self.contributors], "averaged": self.averaged}

    @classmethod
    def parse(cls, body: Any) -> ReplySummary:
        if not (isinstance(body, dict) and isinstance(body.get("contributors"), list)):
            raise AllReduceError("reducer sent a malformed summary")
        try:
            contributors = [PeerID(raw) for raw in body["contributors"] if isinstance(raw, bytes)]
        except ValueError as error:
            raise AllReduceError(f"reducer sent a malformed contributor: {error}") from None
        return cls(contributors, body.get("averaged") is True)


def part_body(index: int, meta: dict[str, Any]) -> dict[str, Any]:
    return {"part": index, "meta": meta}


@dataclass
class IncomingPart:
    """A received part, checked as far as its body goes: ``decode`` turns it into values."""

    index: int
    codec: Codec
    meta: Any
    payload: Any
    out: torch.Tensor  # where the values go
    # The payload was received straight into ``out``, and its codec says such bytes are the values
    # themselves (``Codec.in_place_numel``, checked when the buffer was lent): nothing to decode.
    landed: bool

    @property
    def numel(self) -> int:
        return self.out.numel()

    def decode(self) -> torch.Tensor:
        """The part's float32 values, not yet checked finite (raises ValueError)."""
        if self.landed:
            return self.out
        values = self.codec.decode_into(self.meta, self.payload, self.out)
        if values.dtype != torch.float32 or values.numel() != self.numel:
            raise ContributionRejected(f"part {self.index} decoded to {values.numel()} values, expected {self.numel}")
        return values


def _read_part(body: Any, payload: Any, part_sizes: list[int], sink: PartSink) -> IncomingPart:
    if not (isinstance(body, dict) and type(body.get("part")) is int):
        raise ValueError("each part needs {'part': int, 'meta': dict}")
    index = body["part"]
    if not 0 <= index < len(part_sizes):
        raise ValueError(f"part index {index} out of range")
    meta = body.get("meta")
    codec = codec_of(meta)  # raises ValueError for a codec we do not know
    if payload is None:
        raise ValueError(f"part {index} has no payload")
    return IncomingPart(index, codec, meta, payload, *sink.target(index, payload, part_sizes[index]))


class ContributionInbox:
    """A reducer's side of one sender's stream: accept each part (or reject the sender with a
    reason), and commit the contribution when the sender ends its stream."""

    def __init__(self, reduction: ShardReduction, sender: Hashable, sink: PartSink):
        self.reduction = reduction
        self.sender = sender
        self.sink = sink

    def part(self, body: Any, payload: Any) -> IncomingPart:
        """Check an incoming part message; raises ContributionRejected with the reason."""
        try:
            return _read_part(body, payload, self.reduction.part_sizes, self.sink)
        except ContributionRejected:
            raise
        except ValueError as error:
            raise ContributionRejected(str(error)) from None

    def decode(self, part: IncomingPart) -> torch.Tensor:
        """The part's values (tensor work unless the payload landed in place)."""
        try:
            return part.decode()
        except ContributionRejected:
            raise
        except ValueError as error:
            raise ContributionRejected(str(error)) from None

    def stage(self, index: int, values: torch.Tensor) -> None:
        """Hand the values to the reduction, which checks them (finite, the right size, not a
        duplicate) and keeps them until the sender finishes."""
        self.reduction.add_part(self.sender, index, values)

    def finish(self) -> None:
        """The sender ended its stream: commit its contribution, or drop it if parts are missing."""
        self.reduction.finish_sender(self.sender)


@dataclass
class Reply:
    """What a reducer sends every sender once its shard is averaged (encoded once for all of them:
    codecs are deterministic)."""

    summary: ReplySummary
    parts: list[tuple[dict[str, Any], Any]]
    error: ValueError | None = None  # the average could not be encoded: senders keep their values


class ReducerShard:
    """A reducer's side of one round: the reduction of its shard, then the reply."""

    def __init__(self, part_sizes: list[int], senders: list[PeerID], sum_buffer: torch.Tensor | None):
        self.reduction = ShardReduction(part_sizes, senders, sum_buffer)

    def inbox(self, sender: PeerID, sink: PartSink) -> ContributionInbox:
        return ContributionInbox(self.reduction, sender, sink)

    def close(self, reason: str) -> ReductionOutcome:
        """Drop whoever has not finished (for ``reason``) and average what arrived whole."""
        self.reduction.drop_pending(reason)
        return self.reduction.outcome()

    def reply(self, codec: Codec) -> Reply:
        """Encode the average for the senders (tensor work; call after ``close``)."""
        outcome = self.reduction.outcome()
        summary = ReplySummary(outcome.contributors, outcome.averaged is not None)
        if outcome.averaged is None:
            return Reply(summary, [])
        parts, offset = [], 0
        try:
            for index, size in enumerate(self.reduction.part_sizes):
                # encode checks finiteness: weighted values can overflow to inf
                meta, payload = codec.encode(outcome.averaged[offset : offset + size])
                parts.append((part_body(index, meta), payload))
                offset += size
        except ValueError as error:
            return Reply(summary, [], error)
        return Reply(summary, parts)

    def own_average(self, reply: Reply, codec: Codec) -> torch.Tensor:
        """Our shard as the senders decode it from ``reply`` (tensor work for a lossy codec)."""
        averaged = self.reduction.outcome().averaged
        assert averaged is not None and reply.error is None
        if codec.encodes_as_view:  # the payloads are our values: others decode exactly these
            return averaged
        # Keep what the other peers will decode, not the unrounded average: replicas that differ
        # by a rounding error each round would drift apart for good. (These are our own encodings
        # of finite values, so decode_into's missing finiteness check is no loss here.)
        own, offset = torch.empty(self.reduction.shard_size, dtype=torch.float32), 0
        for (body, payload), size in zip(reply.parts, self.reduction.part_sizes, strict=True):
            piece = own[offset : offset + size]
            values = codec_of(body["meta"]).decode_into(body["meta"], payload, piece)
            if values is not piece:  # a codec that decodes into a tensor of its own
                piece.copy_(values)
            offset += size
        return own


class AverageInbox:
    """A sender's side of one reducer's reply: the summary, then every part in order, each
    checked finite; the values count only once the whole shard is in."""

    def __init__(self, parts: list[tuple[int, int]], sink: PartSink):
        self.ranges = parts  # absolute (start, end) of every part of the shard
        self.sink = sink
        self.contributors: list[PeerID] = []
        self._values: list[torch.Tensor] = []

    def summary(self, body: Any) -> list[PeerID]:
        summary = ReplySummary.parse(body)
        if not summary.averaged:
            raise AllReduceError("the reducer received no contribution")
        self.contributors = summary.contributors
        return summary.contributors

    def part(self, body: Any, payload: Any) -> IncomingPart:
        expected = len(self._values)
        if not (isinstance(body, dict) and body.get("part") == expected):
            raise AllReduceError("reducer sent parts out of order")
        sizes = [end - start for start, end in self.ranges]
        return _read_part(body, payload, sizes, self.sink)

    def accept(self, values: torch.Tensor) -> None:
        """Keep the next part's decoded values once they are checked finite (one read-only pass)."""
        if not all_finite(values):
            raise AllReduceError("the reducer sent NaN or infinite values")
        self._values.append(values)

    @property
    def complete(self) -> bool:
        return len(self._values) == len(self.ranges)

    def averaged(self) -> list[tuple[int, torch.Tensor]]:
        """``(flat offset, values)`` of every part; only once the whole shard has arrived."""
        if not self.complete:
            raise AllReduceError(f"the reducer sent {len(self._values)} of {len(self.ranges)} parts")
        return [(start, values) for (start, _end), values in zip(self.ranges, self._values, strict=True)]
