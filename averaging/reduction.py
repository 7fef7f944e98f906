"""A reducer's bookkeeping for its shard, part by part, sans I/O.

A shard is averaged one part at a time, in order: part ``p`` is averaged as soon as every sender
still in the round has delivered part ``p`` (or has been dropped), so its average can go back to
the senders while later parts are still arriving. Until then each sender's part is staged (the
tensor the caller handed over, not a copy). A sender that dies or stalls half-way is dropped: it
is a contributor of the parts averaged before that, and of no other, and its staged parts go. Each
part's average is therefore exactly the weighted average of the contributions that part names
(``part_contributors``), never a mix. Memory: staged parts wait only for the slowest sender's
same part, at most one shard per sender.

How a part's contributions become its average is the ``aggregation``: the weighted mean, or
CenteredClip with weights clipped to a ratio of their median (``robust.py``), which needs the
contributions kept apart until the part is aggregated — as they already are, staged. Its
workspace is one part per sender (the group size bounds it), reused from part to part.

The methods do tensor work and are meant to be called from a worker thread, one call at a time
per ``ShardReduction`` (the trio driver serialises them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.tensors import all_finite

from .contribution_scores import ShardAlignment
from .mixing import distances, mix, mixes, nearest_sets, start_of_mixed, tau_floor
from .robust import Aggregation, centered_clip, clip_weights

__all__ = ["ShardReduction", "ContributionRejected", "ReductionOutcome", "MAX_WEIGHT", "AggregatedInputs"]

# One aggregated part's kept inputs: senders, claimed weights, values (a row each), start row,
# parts as sent, neighbour sets (``ShardReduction.kept_inputs``)
AggregatedInputs = tuple[list[Hashable], list[float], torch.Tensor, "int | None", list[Any], "list[list[int]] | None"]

# Weights are sample counts or similar; anything beyond 2^40 is a bug or an attack, and would
# swamp every honest contribution.
MAX_WEIGHT = float(1 << 40)


class ContributionRejected(ValueError):
    """A part that cannot be accepted (wrong size, duplicate, non-finite values, bad weight)."""


# Below this, a part's weights are taken relative to the largest before the weighted sum: as
# float32 factors they would vanish. Sample counts never come near it; only odd claims do.
TINY_WEIGHT = 2.0**-64


@dataclass
class ReductionOutcome:
    averaged: torch.Tensor | None  # None when some part got no contribution of positive weight
    contributors: list[Hashable]  # in every part's average
    dropped: dict[Hashable, str] = field(default_factory=dict)
    part_contributors: list[list[Hashable]] = field(default_factory=list)  # per part, in its average


class ShardReduction:
    def __init__(
        self,
        part_sizes: list[int],
        senders: list[Hashable],
        sum_buffer: torch.Tensor | None = None,
        aggregation: Aggregation = Aggregation.MEAN,
        workspace: torch.Tensor | None = None,
        *,
        keep_inputs: bool = False,
    ):
        """``sum_buffer``: float32 storage for the averages of the shard's parts, e.g. reused from
        an earlier round; a fresh one is allocated if it is None. ``workspace``: float32 scratch for
        CenteredClip, ``len(senders) * max(part_sizes)`` values (else allocated per part).
        ``keep_inputs``: keep each part's inputs after it is aggregated (``kept_inputs``), for the
        senders' checks (``verification.py``)."""
        self.part_sizes = list(part_sizes)
        self.expected = list(senders)
        if sum_buffer is not None and (sum_buffer.dtype != torch.float32 or sum_buffer.numel() != self.shard_size):
            raise ValueError(f"the sum buffer must hold {self.shard_size} float32 values")
        self._sum = sum_buffer
        self._weights: dict[Hashable, float] = {}
        # parts not averaged yet: per part, sender -> (its values, its part as sent with its
        # commitment: ``signed`` of ``add_part``, kept only if the inputs are)
        self._staged: list[dict[Hashable, tuple[torch.Tensor, Any]]] = [{} for _ in self.part_sizes]
        self._delivered: dict[Hashable, set[int]] = {}
        self.dropped: dict[Hashable, str] = {}
        # per averaged part (in order): who is in its average, and their total weight
        self.part_contributors: list[list[Hashable]] = []
        self.part_weights: list[float] = []
        self._outcome: ReductionOutcome | None = None
        self.aggregation = Aggregation(aggregation)
        self.workspace = workspace
        # the reducer's own contribution: CenteredClip starts there, or at a closer-knit one
        self.own: Hashable | None = None
        self.part_taus: list[float] = []  # per averaged part, CenteredClip's radius (0 for the mean)
        # With ``keep_inputs``, per aggregated part: the senders with positive weight, their
        # claimed weights, a copy of their values (one row each), the row CenteredClip started
        # from (None: the coordinate-wise median), per sender its part as sent with its
        # commitment (None for our own contribution), and the rows each row was mixed with (None:
        # not mixed, ``mixing.py``). None: nothing is kept.
        self.kept_inputs: list[AggregatedInputs] | None = [] if keep_inputs else None
        # each part's contributions scored against our held-out loss's gradient, if we have one
        # (``contribution_scores.py``); set before the first part is aggregated
        self.scoring: ShardAlignment | None = None

    @functools.cached_property
    def part_offsets(self) -> list[int]:
        """Where each part starts in the shard."""
        return [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]

    @property
    def shard_size(self) -> int:
        return sum(self.part_sizes)

    @property
    def keep_inputs(self) -> bool:
        return self.kept_inputs is not None

    @property
    def num_parts(self) -> int:
        return len(self.part_sizes)

    @property
    def averaged_parts(self) -> int:
        """Parts ``0 .. averaged_parts - 1`` are averaged."""
        return len(self.part_contributors)

    @property
    def pending(self) -> list[Hashable]:
        """Senders still owing parts: neither dropped nor done delivering."""
        return [s for s in self.expected if s not in self.dropped and len(self._delivered.get(s, ())) < self.num_parts]

    @property
    def done(self) -> bool:
        return not self.pending

    def holds(self, sender: Hashable) -> bool:
        """Whether parts of ``sender``'s are staged (kept, not yet averaged)."""
        return any(sender in staged for staged in self._staged[self.averaged_parts :])

    def set_weight(self, sender: Hashable, weight: float) -> None:
        self._check_sender(sender)
        if sender in self._weights:
            raise ContributionRejected("the weight was sent twice")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
            raise ContributionRejected(f"weight must be finite and in [0, {MAX_WEIGHT:g}], got {weight!r}")
        self._weights[sender] = float(weight)
        self._delivered.setdefault(sender, set())

    def add_part(self, sender: Hashable, part_index: int, values: torch.Tensor, signed: Any = None) -> None:
        """Stage one part; raises ContributionRejected (the caller then drops the sender).

        ``values`` is kept, not copied, until its part is averaged: pass a tensor nobody modifies.
        ``signed``: the sender's part as sent, with its commitment, kept with the inputs (``keep_inputs``)."""
        self._check_sender(sender)
        if sender not in self._weights:
            raise ContributionRejected("a part arrived before the sender's weight")
        if not (isinstance(part_index, int) and 0 <= part_index < self.num_parts):
            raise ContributionRejected(f"part index {part_index!r} out of range")
        delivered = self._delivered[sender]
        if part_index in delivered:
            raise ContributionRejected(f"part {part_index} sent twice")
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != self.part_sizes[part_index]:
            raise ContributionRejected(
                f"part {part_index} must be {self.part_sizes[part_index]} float32 values, "
                f"got {values.numel()} {values.dtype}"
            )
        if not all_finite(values):
            raise ContributionRejected(f"part {part_index} contains NaN or infinite values")
        delivered.add(part_index)  # (a part is averaged only once every live sender delivered it)
        self._staged[part_index][sender] = (values, signed if self.keep_inputs else None)

    def add_local(self, sender: Hashable, values: torch.Tensor, weight: float) -> None:
        """A reducer's own contribution: the whole shard at once. The caller has checked ``values``
        finite (the all-reduce checks its whole flattened tensor once)."""
        self.set_weight(sender, weight)
        self.own = sender
        if values.numel() != self.shard_size:
            raise ContributionRejected("local shard has the wrong size")
        flat = values.reshape(-1).to(torch.float32)
        for index, (offset, size) in enumerate(zip(self.part_offsets, self.part_sizes, strict=True)):
            self._staged[index][sender] = (flat[offset : offset + size], None)
        self._delivered[sender] = set(range(self.num_parts))

    def finish_sender(self, sender: Hashable) -> None:
        """The sender says it sent everything; drop it if that is not true. A sender counts as
        done once its last part arrives, so the shard may be averaged before its stream's end
        comes: that end is no contribution, and is not refused."""
        if self._outcome is not None and len(self._delivered.get(sender, ())) == self.num_parts:
            return
        self._check_sender(sender)
        missing = self.num_parts - len(self._delivered.get(sender, ()))
        if sender not in self._weights:
            self.drop(sender, "finished without sending a weight")
        elif missing:
            self.drop(sender, f"finished with {missing} parts missing")

    def drop(self, sender: Hashable, reason: str) -> None:
        """Leave ``sender`` out of every part not averaged yet (it stays in those that are)."""
        if sender in self.dropped or self._outcome is not None:
            return
        self.dropped[sender] = reason
        for staged in self._staged[self.averaged_parts :]:
            staged.pop(sender, None)

    def drop_pending(self, reason: str) -> None:
        for sender in self.pending:
            self.drop(sender, reason)

    def ready(self) -> int:
        """How many parts, from the next one on, could be averaged now: every sender still in the
        round has delivered them."""
        live = [s for s in self.expected if s not in self.dropped]
        count = 0
        for index in range(self.averaged_parts, self.num_parts):
            if any(index not in self._delivered.get(s, ()) for s in live):
                break
            count += 1
        return count

    def average_next(self) -> int:
        """Average the next part (it must be ``ready``) into the sum buffer; returns its index."""
        index = self.averaged_parts
        if not self.ready():
            raise RuntimeError(f"part {index} is not ready")
        staged = self._staged[index]
        contributors = [s for s in self.expected if s in staged]
        positive = [s for s in contributors if self._weights[s] > 0]
        weights = [self._weights[s] for s in positive]
        if self.aggregation.robust:
            weights = clip_weights(weights)
        total = sum(weights)
        tau = 0.0
        if positive:
            if self._sum is None:
                self._sum = torch.empty(self.shard_size, dtype=torch.float32)
            offset = self.part_offsets[index]
            out = self._sum[offset : offset + self.part_sizes[index]]
            if self.aggregation.robust:
                own = positive.index(self.own) if self.own in positive else None
                parts = [staged[s][0] for s in positive]
                tau, start, kept, sets = self._aggregate_robustly(parts, weights, out, own)
                if self.kept_inputs is not None:
                    raw = [self._weights[s] for s in positive]
                    signed = [staged[s][1] for s in positive]
                    self.kept_inputs.append((positive, raw, kept, start, signed, sets))
            else:
                scaled, divisor = weights, total
                if max(weights) < TINY_WEIGHT:  # claims that float32 products would round to 0 (0 / 0)
                    largest = max(weights)
                    scaled = [w / largest for w in weights]
                    divisor = math.fsum(scaled)
                (first, *rest), (weight, *rest_weights) = [staged[s][0] for s in positive], scaled
                torch.mul(first, weight, out=out)  # the first contribution writes every value: no zeroing
                for values, w in zip(rest, rest_weights, strict=True):
                    out.add_(values, alpha=w)
                out.div_(divisor)
        if self.kept_inputs is not None and not positive:
            self.kept_inputs.append((positive, [], torch.empty(0), None, [], None))
        if self.scoring is not None:
            self.scoring.add_part(index, {s: staged[s][0] for s in positive})
        self.part_taus.append(tau)
        staged.clear()
        self.part_contributors.append(contributors)
        self.part_weights.append(total)
        return index

    def _aggregate_robustly(
        self, parts: list[torch.Tensor], weights: list[float], out: torch.Tensor, own: int | None
    ) -> tuple[float, int | None, torch.Tensor | None, list[list[int]] | None]:
        """CenteredClip of ``parts`` into ``out`` (over their nearest-neighbour mixes, if this
        reduction mixes and there are three or more: ``mixing.py``), from our own (row ``own``)
        or a closer-knit one; returns the radius, the row it started from, the parts stacked if
        they are kept for checks, and the neighbour sets mixed (None: not mixed)."""
        mixing = mixes(self.aggregation, len(parts))
        sets, rows, floor, start, choose = None, parts, 0.0, own, True
        stacked = torch.stack(parts) if mixing or self.kept_inputs is not None else None
        if mixing:
            assert stacked is not None
            between = distances(stacked)
            sets, floor = nearest_sets(between), tau_floor(between)
            mixed = mix(stacked, sets)
            rows = list(mixed.unbind(0))
            if own is not None:  # the start from exact radii, as checkers bound it
                start, choose = start_of_mixed(mixed, own), False
        center = rows[start] if start is not None else None
        tau, moved_to = centered_clip(
            rows, weights, out, center=center, workspace=self.workspace, choose_start=choose, min_tau=floor
        )
        return tau, moved_to if moved_to is not None else start, stacked, sets

    def part_average(self, index: int) -> torch.Tensor | None:
        """Part ``index``'s average (a view of the sum buffer), or None if no contribution of
        positive weight is in it."""
        if index >= self.averaged_parts or self.part_weights[index] <= 0:
            return None
        assert self._sum is not None
        offset = self.part_offsets[index]
        return self._sum[offset : offset + self.part_sizes[index]]

    def outcome(self) -> ReductionOutcome:
        """The whole shard's result, once every sender is done or dropped. Taking it averages any
        parts left and closes the reduction: nothing may be added afterwards."""
        if self._outcome is None:
            if self.pending:
                raise RuntimeError("senders are still pending")
            while self.averaged_parts < self.num_parts:
                self.average_next()
            averaged = None
            if all(weight > 0 for weight in self.part_weights):
                averaged = self._sum if self._sum is not None else torch.zeros(0)
            every_part = [s for s in self.expected if all(s in part for part in self.part_contributors)]
            if not self.num_parts:  # nothing to average: whoever was not dropped is in it
                every_part = [s for s in self.expected if s not in self.dropped]
            self._outcome = ReductionOutcome(
                averaged, every_part, dict(self.dropped), [list(part) for part in self.part_contributors]
            )
        return self._outcome

    def _check_sender(self, sender: Hashable) -> None:
        if self._outcome is not None:
            raise ContributionRejected("this shard is already averaged")
        if sender not in self.expected:
            raise ContributionRejected(f"{sender} is not a sender of this group")
        if sender in self.dropped:
            raise ContributionRejected(f"{sender} already dropped")
