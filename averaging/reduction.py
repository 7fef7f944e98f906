"""A reducer's bookkeeping for its shard, sans I/O.

Each sender's parts are staged until the sender has delivered its whole shard; only then is its
weighted contribution added to the sum. A sender that dies or stalls half-way is therefore
dropped cleanly: the result is exactly the weighted average of the contributions that arrived
whole, never a mix of some parts with and some parts without it. Staging costs one shard-sized
buffer per sender in flight, which bounds memory at group size x shard size.

The methods do tensor work and are meant to be called from a worker thread, one call at a time
per ``ShardReduction`` (the trio driver serialises them).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

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
    def __init__(self, part_sizes: list[int], senders: list[Hashable]):
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        self.shard_size = sum(self.part_sizes)
        self.expected = list(senders)
        self._sum = torch.zeros(self.shard_size, dtype=torch.float32)
        self._total_weight = 0.0
        self._staged: dict[Hashable, torch.Tensor] = {}
        self._received: dict[Hashable, set[int]] = {}
        self._weights: dict[Hashable, float] = {}
        self.contributors: list[Hashable] = []
        self.dropped: dict[Hashable, str] = {}

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
        """Stage one part; raises ContributionRejected (the caller then drops the sender)."""
        self._check_sender(sender)
        if sender not in self._weights:
            raise ContributionRejected("a part arrived before the sender's weight")
        if not (isinstance(part_index, int) and 0 <= part_index < len(self.part_sizes)):
            raise ContributionRejected(f"part index {part_index!r} out of range")
        received = self._received.setdefault(sender, set())
        if part_index in received:
            raise ContributionRejected(f"part {part_index} sent twice")
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != self.part_sizes[part_index]:
            raise ContributionRejected(
                f"part {part_index} must be {self.part_sizes[part_index]} float32 values, "
                f"got {values.numel()} {values.dtype}"
            )
        if not bool(torch.isfinite(values).all()):
            raise ContributionRejected(f"part {part_index} contains NaN or infinite values")
        staged = self._staged.get(sender)
        if staged is None:
            staged = self._staged[sender] = torch.empty(self.shard_size, dtype=torch.float32)
        offset = self.part_offsets[part_index]
        staged[offset : offset + values.numel()].copy_(values)
        received.add(part_index)

    def add_local(self, sender: Hashable, values: torch.Tensor, weight: float) -> None:
        """A reducer's own contribution: the whole shard at once, no staging."""
        self.set_weight(sender, weight)
        if values.numel() != self.shard_size or not bool(torch.isfinite(values).all()):
            raise ContributionRejected("local shard has the wrong size or non-finite values")
        self._commit(sender, values.reshape(-1).to(torch.float32))

    def finish_sender(self, sender: Hashable) -> None:
        """The sender says it sent everything; commit it if that is true, else drop it."""
        self._check_sender(sender)
        missing = len(self.part_sizes) - len(self._received.get(sender, ()))
        if sender not in self._weights:
            self.drop(sender, "finished without sending a weight")
        elif missing:
            self.drop(sender, f"finished with {missing} parts missing")
        else:
            staged = self._staged.pop(sender, torch.empty(0, dtype=torch.float32))
            self._commit(sender, staged)

    def drop(self, sender: Hashable, reason: str) -> None:
        if sender in self.contributors or sender in self.dropped:
            return
        self.dropped[sender] = reason
        self._staged.pop(sender, None)
        self._received.pop(sender, None)

    def drop_pending(self, reason: str) -> None:
        for sender in self.pending:
            self.drop(sender, reason)

    def outcome(self) -> ReductionOutcome:
        averaged = self._sum / self._total_weight if self._total_weight > 0 else None
        return ReductionOutcome(averaged, list(self.contributors), dict(self.dropped), self._total_weight)

    def _commit(self, sender: Hashable, values: torch.Tensor) -> None:
        weight = self._weights[sender]
        if weight > 0 and values.numel():
            self._sum.add_(values, alpha=weight)
        self._total_weight += weight
        self.contributors.append(sender)

    def _check_sender(self, sender: Hashable) -> None:
        if sender not in self.expected:
            raise ContributionRejected(f"{sender} is not a sender of this group")
        if sender in self.dropped or sender in self.contributors:
            raise ContributionRejected(f"{sender} already {'dropped' if sender in self.dropped else 'finished'}")
