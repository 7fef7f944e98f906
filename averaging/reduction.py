"""A reducer's bookkeeping for its shard, sans I/O.

Each sender's parts are staged until the sender has delivered its whole shard; only then is its
weighted contribution added to the sum. A sender that dies or stalls half-way is therefore
dropped cleanly: the result is exactly the weighted average of the contributions that arrived
whole, never a mix of some parts with and some parts without it. Staging keeps the part tensors
the caller hands over, not a copy of them: one shard's worth of memory per sender in flight, which
bounds memory at group size x shard size, and no extra pass over the data.

The methods do tensor work and are meant to be called from a worker thread, one call at a time
per ``ShardReduction`` (the trio driver serialises them).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from peer.tensors import all_finite

__all__ = ["ShardReduction", "ContributionRejected", "ReductionOutcome", "MAX_WEIGHT"]

# Weights are sample counts or similar; anything beyond 2^40 is a bug or an attack, and would
# swamp every honest contribution.
MAX_WEIGHT = float(1 << 40)


class ContributionRejected(ValueError):
    """A part that cannot be accepted (wrong size, duplicate, non-finite values, bad weight)."""


@dataclass
class ReductionOutcome:
    averaged: torch.Tensor | None  # None when no contribution arrived whole
    contributors: list[Hashable]
    dropped: dict[Hashable, str] = field(default_factory=dict)
    total_weight: float = 0.0


class ShardReduction:
    def __init__(self, part_sizes: list[int], senders: list[Hashable], sum_buffer: torch.Tensor | None = None):
        """``sum_buffer``: float32 storage for the running sum (and then the average) of the
        shard, e.g. reused from an earlier round; a fresh one is allocated if it is None."""
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        self.shard_size = sum(self.part_sizes)
        self.expected = list(senders)
        if sum_buffer is not None and (sum_buffer.dtype != torch.float32 or sum_buffer.numel() != self.shard_size):
            raise ValueError(f"the sum buffer must hold {self.shard_size} float32 values")
        self._sum_buffer = sum_buffer
        self._sum: torch.Tensor | None = None  # set by the first weighted contribution
        self._total_weight = 0.0
        self._staged: dict[Hashable, dict[int, torch.Tensor]] = {}  # sender -> part index -> values
        self._weights: dict[Hashable, float] = {}
        self.contributors: list[Hashable] = []
        self.dropped: dict[Hashable, str] = {}
        self._outcome: ReductionOutcome | None = None

    @property
    def pending(self) -> list[Hashable]:
        """Senders neither committed nor dropped yet."""
        return [s for s in self.expected if s not in self.dropped and s not in self.contributors]

    @property
    def done(self) -> bool:
        return not self.pending

    def set_weight(self, sender: Hashable, weight: float) -> None:
        self._check_sender(sender)
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
            raise ContributionRejected(f"weight must be finite and in [0, {MAX_WEIGHT:g}], got {weight!r}")
        self._weights[sender] = float(weight)

    def add_part(self, sender: Hashable, part_index: int, values: torch.Tensor) -> None:
        """Stage one part; raises ContributionRejected (the caller then drops the sender).

        ``values`` is kept, not copied, until the sender finishes: pass a tensor nobody modifies."""
        self._check_sender(sender)
        if sender not in self._weights:
            raise ContributionRejected("a part arrived before the sender's weight")
        if not (isinstance(part_index, int) and 0 <= part_index < len(self.part_sizes)):
            raise ContributionRejected(f"part index {part_index!r} out of range")
        staged = self._staged.setdefault(sender, {})
        if part_index in staged:
            raise ContributionRejected(f"part {part_index} sent twice")
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != self.part_sizes[part_index]:
            raise ContributionRejected(
                f"part {part_index} must be {self.part_sizes[part_index]} float32 values, "
                f"got {values.numel()} {values.dtype}"
            )
        if not all_finite(values):
            raise ContributionRejected(f"part {part_index} contains NaN or infinite values")
        staged[part_index] = values

    def add_local(self, sender: Hashable, values: torch.Tensor, weight: float) -> None:
        """A reducer's own contribution: the whole shard at once, no staging. The caller has
        checked ``values`` finite (the all-reduce checks its whole flattened tensor once)."""
        self.set_weight(sender, weight)
        if values.numel() != self.shard_size:
            raise ContributionRejected("local shard has the wrong size")
        self._commit(sender, [(0, values.reshape(-1).to(torch.float32))])

    def finish_sender(self, sender: Hashable) -> None:
        """The sender says it sent everything; commit it if that is true, else drop it."""
        self._check_sender(sender)
        missing = len(self.part_sizes) - len(self._staged.get(sender, ()))
        if sender not in self._weights:
            self.drop(sender, "finished without sending a weight")
        elif missing:
            self.drop(sender, f"finished with {missing} parts missing")
        else:
            staged = self._staged.pop(sender, {})
            self._commit(sender, [(self.part_offsets[index], values) for index, values in staged.items()])

    def drop(self, sender: Hashable, reason: str) -> None:
        if sender in self.contributors or sender in self.dropped:
            return
        self.dropped[sender] = reason
        self._staged.pop(sender, None)

    def drop_pending(self, reason: str) -> None:
        for sender in self.pending:
            self.drop(sender, reason)

    def outcome(self) -> ReductionOutcome:
        """The average of the contributions committed so far. Taking it closes the reduction: the
        sum is divided in place (no second shard-sized buffer), so nothing may be added afterwards."""
        if self._outcome is None:
            averaged = None
            if self._total_weight > 0:
                # (no sum only when the shard is empty)
                averaged = self._sum.div_(self._total_weight) if self._sum is not None else torch.zeros(0)
            self._outcome = ReductionOutcome(averaged, list(self.contributors), dict(self.dropped), self._total_weight)
        return self._outcome

    def _commit(self, sender: Hashable, pieces: list[tuple[int, torch.Tensor]]) -> None:
        """Add a whole contribution (``(offset, values)`` pieces tiling the shard) to the sum."""
        weight = self._weights[sender]
        if weight > 0 and self.shard_size:
            if self._sum is None:  # the first contribution writes every value: no zeroing pass
                self._sum = self._sum_buffer if self._sum_buffer is not None else torch.empty(self.shard_size)
                for offset, values in pieces:
                    torch.mul(values, weight, out=self._sum[offset : offset + values.numel()])
            else:
                for offset, values in pieces:
                    self._sum[offset : offset + values.numel()].add_(values, alpha=weight)
        self._total_weight += weight
        self.contributors.append(sender)

    def _check_sender(self, sender: Hashable) -> None:
        if self._outcome is not None:
            raise ContributionRejected("this shard is already averaged")
        if sender not in self.expected:
            raise ContributionRejected(f"{sender} is not a sender of this group")
        if sender in self.dropped or sender in self.contributors:
            raise ContributionRejected(f"{sender} already {'dropped' if sender in self.dropped else 'finished'}")
