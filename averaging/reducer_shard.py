"""A reducer's side of one round, sans I/O: its shard's reduction (``reduction.py``), fed by one
inbox per sender (``allreduce_protocol.py``), and its replies, part by part.

The trio role that drives it is ``round_roles.ReducerRole``; it reaches the reduction only through
this object.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from peer import PeerID

from .allreduce_protocol import CommittedSender, ContributionInbox, ReduceHeader
from .commitments import DIGEST_BYTES, Commitment, VerifiedSignatures
from .compression import Codec, codec_of
from .contribution_scores import ShardAlignment
from .part_buffers import PartSink
from .reduction import ContributionRejected, ReductionOutcome, ShardReduction
from .robust import Aggregation

__all__ = ["KeptPart", "ROBUST_WORK", "ReducerShard", "ShardPhase", "ShardSigning"]

# CenteredClip passes over a part's contributions about this many times what the mean's one pass
# costs (stacked in float64, their Gram matrix or a few iterations, the result; 4 x 16K values:
# 0.34 ms against 0.018): its parts count that much more work, so that the driver takes them off
# the event loop at that size (inline, they block each peer's loop 0.1-0.6 s per round in the
# lab's 4-peer rounds on 2 cores).
ROBUST_WORK = 16


@dataclass(frozen=True)
class KeptPart:
    """One aggregated part's inputs, kept for the senders' checks (``ShardReduction.kept_inputs``)."""

    senders: list[Hashable]
    weights: list[float]
    values: torch.Tensor
    start: int | None
    signed: list[Any]
    neighbours: list[list[int]] | None  # the rows each row was mixed with (``mixing.py``), if mixed
    tau: float
    aggregation: Aggregation


@dataclass(frozen=True)
class ShardSigning:
    """What a reducer needs in a checked round to take only parts their senders committed to:
    the round, itself (the commitments name each reducer's parts), and the signatures its peer
    verified lately (shared with its checks)."""

    group_id: bytes
    reducer: PeerID
    verified: VerifiedSignatures | None = None


class ShardPhase(enum.Enum):
    REPLYING = "replying"  # replies still to come
    REPLIED = "replied"  # every part has its reply
    FAILED = "failed"  # a part could not be averaged or encoded: no more replies (``error``)


class ReducerShard:
    """A reducer's side of one round: the shard's reduction, and its replies part by part, each
    encoded once for all senders (codecs are deterministic) as soon as the part is averaged.

    ``signing``: set in a checked round, whose senders commit to their parts (``commitments.py``):
    every part must match its sender's commitment, and the reduction keeps its inputs for the
    senders' checks."""

    def __init__(
        self,
        part_sizes: list[int],
        senders: list[PeerID],
        sum_buffer: torch.Tensor | None,
        aggregation: Aggregation = Aggregation.MEAN,
        workspace: torch.Tensor | None = None,
        signing: ShardSigning | None = None,
    ):
        keep = signing is not None
        self.reduction = ShardReduction(part_sizes, senders, sum_buffer, aggregation, workspace, keep_inputs=keep)
        self.replies: list[tuple[dict[str, Any], Any]] = []  # (body, payload) of parts 0, 1, ...
        self.error: ValueError | None = None  # why the replies stopped (``ShardPhase.FAILED``)
        self.signing = signing
        self.commitments: dict[PeerID, Commitment] = {}  # the senders' verified commitments (a checked round)

    # What the trio roles need of the reduction, so that nothing reaches under this object.
    @property
    def part_sizes(self) -> list[int]:
        return self.reduction.part_sizes

    @property
    def num_parts(self) -> int:
        return self.reduction.num_parts

    @property
    def work_per_part(self) -> int:
        """Values a part's reply passes over: each contribution once (``ROBUST_WORK`` times with
        CenteredClip), then once to encode it."""
        passes = ROBUST_WORK if self.reduction.aggregation.robust else 1
        return (len(self.reduction.expected) * passes + 1) * max(self.reduction.part_sizes, default=0)

    @property
    def pending(self) -> list[Hashable]:
        return self.reduction.pending

    def holds(self, sender: Hashable) -> bool:
        return self.reduction.holds(sender)

    def add_local(self, me: PeerID, values: torch.Tensor, weight: float) -> None:
        self.reduction.add_local(me, values, weight)

    def set_weight(self, sender: PeerID, weight: Any) -> None:
        self.reduction.set_weight(sender, weight)

    def drop(self, sender: PeerID, reason: str) -> None:
        self.reduction.drop(sender, reason)

    def outcome(self) -> ReductionOutcome:
        return self.reduction.outcome()

    def score_against(self, reference: torch.Tensor, me: PeerID) -> None:
        """Score the senders' contributions against ``reference`` (our shard's slice of the held-out
        loss's gradient) as their parts are aggregated (``contribution_scores.py``)."""
        self.reduction.scoring = ShardAlignment(reference, self.reduction.part_offsets, own=me)

    @property
    def scoring(self) -> ShardAlignment | None:
        """How the senders' contributions aligned with the reference (None: not scored)."""
        return self.reduction.scoring

    def inputs_of(self, index: int) -> KeptPart | None:
        """Part ``index``'s kept inputs once it is aggregated (a checked round), else None."""
        reduction = self.reduction
        kept = reduction.kept_inputs
        if kept is None or index >= min(len(kept), len(reduction.part_taus)):
            return None
        return KeptPart(*kept[index], reduction.part_taus[index], reduction.aggregation)

    @property
    def kept_values(self) -> int:
        """At most how many values the kept inputs hold: every sender's part of the shard."""
        return len(self.reduction.expected) * self.reduction.shard_size

    def inbox(self, sender: PeerID, sink: PartSink, header: ReduceHeader | None = None) -> ContributionInbox:
        """A sender's inbox; in a checked round its header must carry its commitment, signed with
        its peer ID's key, to exactly this shard's parts."""
        signing = None
        if self.signing is not None:
            try:
                commitment = Commitment.from_wire(header.commitment if header is not None else None)
            except ValueError as error:
                raise ContributionRejected(f"a checked round needs the sender's commitment: {error}") from None
            assert header is not None
            digests = commitment.parts_of(self.signing.reducer)
            if digests is None or len(digests) != DIGEST_BYTES * self.reduction.num_parts:
                raise ContributionRejected("the sender's commitment does not name this shard's parts")
            weight, verified = header.weight, self.signing.verified
            if not (
                isinstance(weight, (int, float)) and commitment.verify(self.signing.group_id, sender, weight, verified)
            ):
                raise ContributionRejected("the sender's commitment is not signed by it")
            signing = CommittedSender(commitment, digests)
            self.commitments[sender] = commitment
        return ContributionInbox(self.reduction, sender, sink, signing)

    @property
    def phase(self) -> ShardPhase:
        if self.error is not None:
            return ShardPhase.FAILED
        return ShardPhase.REPLIED if len(self.replies) == self.reduction.num_parts else ShardPhase.REPLYING

    @property
    def finished(self) -> bool:
        """Every part has its reply, or there will be no more."""
        return self.phase is not ShardPhase.REPLYING

    def ready(self) -> int:
        """How many replies could be made now (see ``ShardReduction.ready``)."""
        return 0 if self.finished else self.reduction.ready()

    def reply_next(self, codec: Codec) -> None:
        """Average the next ready part and encode its reply (tensor work)."""
        reduction = self.reduction
        index = reduction.average_next()
        averaged = reduction.part_average(index)
        if averaged is None:
            self.error = ValueError(f"part {index} of the shard got no contribution")
            return
        try:
            meta, payload = codec.encode(averaged)  # checks finiteness: weighted values can overflow to inf
        except ValueError as error:
            self.error = error
            return
        body: dict[str, Any] = {"part": index, "meta": meta, "all_in": reduction.done}
        contributors = reduction.part_contributors[index]
        if index == 0 or contributors != reduction.part_contributors[index - 1]:
            body["contributors"] = [p.to_bytes() for p in contributors]
        self.replies.append((body, payload))

    def close(self, reason: str, codec: Codec) -> ReductionOutcome:
        """Drop whoever has not delivered everything (for ``reason``), reply with every part left
        (tensor work), and take the outcome."""
        self.reduction.drop_pending(reason)
        while self.ready():
            self.reply_next(codec)
        return self.reduction.outcome()

    def own_average(self, codec: Codec) -> torch.Tensor:
        """Our shard as the senders decode it from the replies (tensor work for a lossy codec)."""
        averaged = self.reduction.outcome().averaged
        assert averaged is not None and self.error is None
        if codec.encodes_as_view:  # the payloads are our values: others decode exactly these
            return averaged
        # Keep what the other peers will decode, not the unrounded average: replicas that differ
        # by a rounding error each round would drift apart for good. (These are our own encodings
        # of finite values, so decode_into's missing finiteness check is no loss here.)
        own, offset = torch.empty(self.reduction.shard_size, dtype=torch.float32), 0
        for (body, payload), size in zip(self.replies, self.reduction.part_sizes, strict=True):
            piece = own[offset : offset + size]
            values = codec_of(body["meta"]).decode_into(body["meta"], payload, piece)
            if values is not piece:  # a codec that decodes into a tensor of its own
                piece.copy_(values)
            offset += size
        return own
