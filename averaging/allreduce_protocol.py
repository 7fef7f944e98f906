"""The all-reduce's messages and what each side does with them, sans I/O.

One ``avg.reduce`` stream runs from every sender to every reducer (the sender opens it). The
sender's half::

    {"group_id": bytes, "weight": float, "total": int[, "commit": commitment]}
    {"part": i, "meta": codec meta} + payload, for i = 0, 1, ... (then end)

and, at the same time, the reducer's half::

    {"part": i, "meta": codec meta, "all_in": bool, "contributors": [peer ID bytes, ...]} + payload

for i = 0, 1, ... in order, each as soon as part ``i`` is averaged: every sender still in the round
has delivered its part ``i`` (``reduction.py``), so averages flow back while later parts are still
on their way. ``contributors`` names whose contributions part ``i``'s average holds; it is sent
with part 0 and wherever it differs from the part before (a sender dropped midway is in the parts
averaged before it was dropped and in no other). ``all_in``: every contribution the reducer will
use has arrived, so the rest of the replies are owed without waiting. A part that cannot be
averaged (no contribution of positive weight) or encoded (the average overflowed) ends the
reducer's half with an error instead; a sender keeps its own values for a shard it did not receive
whole.

In a round the reducers' checks cover (CenteredClip), the header carries the sender's signed
commitment to the digest of every part it sends (``commitments.py``): the reducer refuses a sender
whose commitment is not signed with its peer ID's key, or does not commit to exactly this shard's
parts, and a part whose digest is not the committed one.

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

from .commitments import DIGEST_BYTES, Commitment, SignedPart, part_digest
from .compression import Codec, codec_of
from .part_buffers import PartSink
from .reduction import ContributionRejected, ShardReduction

__all__ = [
    "REDUCE_METHOD",
    "AllReduceError",
    "ROUND_OVER",
    "RoundOver",
    "AverageInbox",
    "ContributionInbox",
    "IncomingPart",
    "ReduceHeader",
    "CommittedSender",
    "parse_contributors",
    "part_body",
    "MAX_PART_MESSAGE",
]

REDUCE_METHOD = "avg.reduce"
# The largest message either side of an ``avg.reduce`` stream accepts: a part as large as a part
# sink lends a buffer for before its size is known (16M float32 values, 32 times the default part).
MAX_PART_MESSAGE = PartSink.MAX_UNCHECKED_PART


class AllReduceError(RuntimeError):
    """This peer cannot take part in the round, or a reducer's reply broke the protocol."""


class RoundOver(ValueError):
    """A reducer's answer to a stream of a round that has ended on its peer: it takes no more parts
    and sends none, so the sender's own shard stops waiting for that peer's parts at once (a member
    that steps after the others have averaged without it learns so in a round trip)."""


ROUND_OVER = RoundOver.__name__  # its error code on the wire


@dataclass(frozen=True)
class ReduceHeader:
    """The first message of a stream: which round, the sender's weight, and the size of the
    flattened tensors (every member must average the same number of values)."""

    group_id: bytes
    weight: Any  # checked by ShardReduction.set_weight, which rejects only this sender for it
    total: int
    commitment: Any = None  # the sender's commitment (wire form), in a checked round (checked by the inbox)

    def to_body(self) -> dict[str, Any]:
        body = {"group_id": self.group_id, "weight": self.weight, "total": self.total}
        if self.commitment is not None:
            body["commit"] = self.commitment
        return body

    @classmethod
    def parse(cls, body: Any) -> ReduceHeader:
        if not (isinstance(body, dict) and isinstance(body.get("group_id"), bytes) and type(body.get("total")) is int):
            raise ValueError("avg.reduce expects {'group_id': bytes, 'weight': float, 'total': int}")
        return cls(body["group_id"], body.get("weight"), body["total"], body.get("commit"))


def part_body(index: int, meta: dict[str, Any]) -> dict[str, Any]:
    return {"part": index, "meta": meta}


@dataclass(frozen=True)
class CommittedSender:
    """A sender's verified commitment, and the digests it commits to for this reducer's parts."""

    commitment: Commitment
    digests: bytes  # this shard's parts' digests, concatenated


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
    signed: SignedPart | None = None  # set once the part matches its sender's commitment

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

    def __init__(
        self, reduction: ShardReduction, sender: Hashable, sink: PartSink, signing: CommittedSender | None = None
    ):
        self.reduction = reduction
        self.sender = sender
        self.sink = sink
        self.signing = signing  # None: parts are not committed to (a round nobody checks)
        self._buffers: dict[int, torch.Tensor] = {}  # part index -> the buffer its values went into

    def part(self, body: Any, payload: Any) -> IncomingPart:
        """Check an incoming part message; raises ContributionRejected with the reason."""
        try:
            part = _read_part(body, payload, self.reduction.part_sizes, self.sink)
        except ContributionRejected:
            raise
        except ValueError as error:
            raise ContributionRejected(str(error)) from None
        self._buffers.setdefault(part.index, part.out)
        return part

    def unaveraged_buffers(self) -> list[torch.Tensor]:
        """The buffers of this sender's parts that the reduction may still read (not averaged yet)."""
        return [buffer for index, buffer in self._buffers.items() if index >= self.reduction.averaged_parts]

    def decode(self, part: IncomingPart) -> torch.Tensor:
        """The part's values (tensor work unless the payload landed in place and is not committed
        to), once it matches its sender's commitment, in a checked round."""
        if self.signing is not None:
            self.verify(part)
        try:
            return part.decode()
        except ContributionRejected:
            raise
        except ValueError as error:
            raise ContributionRejected(str(error)) from None

    def verify(self, part: IncomingPart) -> None:
        """Check the part against its sender's commitment (raises ContributionRejected) and keep
        it with a copy of the part as sent, for the checks (``commitments.py``)."""
        signing = self.signing
        assert signing is not None
        payload = part.payload
        committed = signing.digests[part.index * DIGEST_BYTES : (part.index + 1) * DIGEST_BYTES]
        try:
            digest = part_digest(part.meta, payload)
        except (TypeError, ValueError):  # meta that msgpack cannot pack (it came from the wire: it can)
            raise ContributionRejected(f"part {part.index} has a malformed meta") from None
        if digest != committed:
            raise ContributionRejected(f"part {part.index} is not the one its sender committed to")
        # A float32 part's bytes are its values, which the reduction keeps (``kept_inputs``); any
        # other is copied (a received buffer is reused once its part is averaged).
        kept = None if part.codec.encodes_as_view else bytes(payload)
        part.signed = SignedPart(signing.commitment, part.meta, kept)

    def stage(self, index: int, values: torch.Tensor, signed: SignedPart | None = None) -> None:
        """Hand the values to the reduction, which checks them (finite, the right size, not a
        duplicate) and keeps them until their part is averaged (``signed``: the part as sent and
        its sender's commitment, in a checked round)."""
        if self.signing is not None and signed is None:
            raise ContributionRejected(f"part {index} was not verified")
        self.reduction.add_part(self.sender, index, values, signed)

    def finish(self) -> None:
        """The sender ended its stream: drop it if parts are missing."""
        self.reduction.finish_sender(self.sender)


def parse_contributors(raw: Any, senders: list[PeerID]) -> list[PeerID]:
    """A reply's contributor list, checked: peer IDs of the group's senders, each at most once,
    at least one (an average of nobody is no average)."""
    if not (isinstance(raw, list) and 0 < len(raw) <= len(senders)):
        raise AllReduceError("reducer sent a malformed contributor list")
    if not all(isinstance(item, bytes) for item in raw):
        raise AllReduceError("reducer sent a malformed contributor")
    try:
        contributors = [PeerID(item) for item in raw]
    except ValueError as error:
        raise AllReduceError(f"reducer sent a malformed contributor: {error}") from None
    if len(set(contributors)) != len(contributors):
        raise AllReduceError("reducer named a contributor twice")
    strangers = [p for p in contributors if p not in senders]
    if strangers:
        raise AllReduceError(f"reducer named {strangers[0]}, not a sender of this group, as a contributor")
    return contributors


class AverageInbox:
    """A sender's side of one reducer's replies: every part in order, each with the contributors
    its average holds (named on the first part and wherever they change), each checked finite.
    The values count only once the whole shard is in. The first broken rule is final: every later
    call raises the same error."""

    def __init__(
        self, parts: list[tuple[int, int]], sink: PartSink, senders: list[PeerID], sparse_reply: Codec | None = None
    ):
        self.ranges = parts  # absolute (start, end) of every part of the shard
        self.sink = sink
        self.senders = senders  # who may be named as a contributor
        # the sparse codec replies must come in: error feedback keeps what they leave out, and the
        # checks bound only that codec's rounding (a dense reply would be a silent 95x in bytes)
        self.sparse_reply = sparse_reply
        self.part_contributors: list[list[PeerID]] = []  # of every accepted part
        self.all_in = False  # the reducer says every contribution has arrived
        self.error: Exception | None = None
        self._values: list[torch.Tensor] = []
        self._named: list[PeerID] | None = None  # the contributors named last
        self._incoming: list[PeerID] | None = None  # of the part read but not yet accepted

    def part(self, body: Any, payload: Any) -> IncomingPart:
        """Check the next reply message; raises AllReduceError (or ValueError for its payload)."""
        self._check()
        try:
            expected = len(self._values)
            if self._incoming is not None:
                raise AllReduceError(f"part {expected} was read twice")
            if not (isinstance(body, dict) and type(body.get("part")) is int and body["part"] == expected):
                raise AllReduceError("reducer sent parts out of order")
            if "contributors" in body:
                named = parse_contributors(body["contributors"], self.senders)
                if self._named is not None and not set(named) <= set(self._named):
                    # a sender dropped from a part is in no later one: it cannot come back
                    raise AllReduceError("reducer named a contributor it had dropped from an earlier part")
                self._named = named
            elif self._named is None:
                raise AllReduceError("reducer sent a part before naming its contributors")
            sizes = [end - start for start, end in self.ranges]
            incoming = _read_part(body, payload, sizes, self.sink)
            if self.sparse_reply is not None and incoming.codec.name != self.sparse_reply.name:
                raise AllReduceError(f"reducer replied in {incoming.codec.name}, not {self.sparse_reply.name}")
        except (AllReduceError, ValueError) as error:
            self.error = error
            raise
        self._incoming = self._named
        self.all_in = self.all_in or body.get("all_in") is True
        return incoming

    def decode(self, part: IncomingPart) -> torch.Tensor:
        """The values of the part just read (tensor work unless its payload landed in place)."""
        self._check()
        try:
            return part.decode()
        except ValueError as error:
            self.error = error
            raise

    def accept(self, values: torch.Tensor) -> None:
        """Keep the part just read once its values are checked finite (one read-only pass)."""
        self._check()
        if self._incoming is None:
            self.error = AllReduceError("no part was read")
            raise self.error
        if not all_finite(values):
            self.error = AllReduceError("the reducer sent NaN or infinite values")
            raise self.error
        self._values.append(values)
        self.part_contributors.append(self._incoming)
        self._incoming = None

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.complete:
            self.error = AllReduceError("reducer sent more parts than the shard has")
            raise self.error

    @property
    def complete(self) -> bool:
        return len(self._values) == len(self.ranges)

    @property
    def contributors(self) -> list[PeerID]:
        """Whose contribution is in every part received."""
        if not self.part_contributors:
            return []
        return [p for p in self.part_contributors[0] if all(p in part for part in self.part_contributors[1:])]

    def averaged(self) -> list[tuple[int, torch.Tensor]]:
        """``(flat offset, values)`` of every part; only once the whole shard has arrived."""
        if not self.complete:
            raise AllReduceError(f"the reducer sent {len(self._values)} of {len(self.ranges)} parts")
        return [(start, values) for (start, _end), values in zip(self.ranges, self._values, strict=True)]
