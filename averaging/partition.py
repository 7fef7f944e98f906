"""How a group splits the work of one all-reduce, sans I/O.

Every peer of a group flattens its tensors into one vector of ``total`` elements. The vector is
cut into one contiguous shard per reducer, sized in proportion to the bandwidth each reducer
declared (a fast peer reduces more, a slow one little, so the round goes at the fast peers' pace),
and each shard is streamed in parts of at most ``part_size`` elements (fewer where that leaves a
shard fewer than ``MIN_PARTS_PER_SHARD`` parts) so that compression, transfer, reduction and the
answers overlap and no single message holds the event loop for long. All peers compute the same
plan from the same group description, so no coordination beyond the group announcement is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .link_speed import UNMEASURED_BANDWIDTH

__all__ = [
    "AllReducePlan",
    "DEFAULT_PART_SIZE",
    "MAX_SHARE_RATIO",
    "MIN_PART_BYTES",
    "MIN_PARTS_PER_SHARD",
    "MIN_SLOW_PART_BYTES",
    "PART_SECONDS",
    "SLOW_PARTS_PER_SHARD",
    "lower_median_claim",
    "part_for_links",
    "bytes_per_value",
    "slow_parts_per_shard",
    "bounded_claims",
    "split_by_bandwidth",
]

# 2^19 float32 values = 2 MiB per part: large enough that per-message costs vanish, small enough
# that several parts are in flight per shard so sending overlaps reducing.
DEFAULT_PART_SIZE = 1 << 19
# A reducer answers a part once every sender delivered it, so the all-gather can only overlap the
# reduce-scatter part by part: with 2 parts per shard (16 MiB among 4 peers at the default size)
# half of every shard's answers wait for the slowest sender's last bytes. Parts are made smaller,
# down to MIN_PART_BYTES (256 KiB, where per-message costs still vanish), until the largest shard
# has this many (the 100 Mbit/s lab, 16 MiB, 4 peers, 8 interleaved runs each: 0.81 of the
# line-rate bound against 0.78 with 2 parts per shard; 16 parts measured no better; the loopback
# benchmark's 64 MiB shards keep their 8 parts of the full size).
MIN_PARTS_PER_SHARD = 8
MIN_PART_BYTES = 1 << 18
# Over slow links parts are made smaller still, down to MIN_SLOW_PART_BYTES (64 KiB), until the
# largest shard has SLOW_PARTS_PER_SHARD of them (fewer in groups of more than four reducers:
# ``slow_parts_per_shard``), as long as a part takes at least PART_SECONDS at
# the group's (lower median) claimed bandwidth: there a message's own costs (~0.1 ms of CPU) are
# small beside its transfer, while on a fast link (loopback: 1.8x the time with 64 parts per shard)
# they are not. A part is the unit the end of a round waits for (the last part's aggregation, with
# CenteredClip several passes over every sender's contribution, and its answer) and the unit a
# reducer check fetches again (its inputs, senders x part, ``reducer_checks.py``): with more parts
# each sender checks every reducer (with the probability CHECK_SHARE x parts / senders, up to 1)
# and each check moves fewer bytes. The 100 Mbit/s lab, 16 MiB, 4 peers, the public swarm's
# defaults (centered-clip with reducer checks), interleaved runs of ``benchmarks/wan.py --quick``:
# 8 parts per shard 0.68-0.71 of the line-rate bound, 32 parts 0.78-0.82, 64 parts 0.84-0.87,
# 128 parts 0.86-0.87; the exact mean 0.93-0.94 in all of them. Claims no higher than the floor
# rate a newcomer declares say nothing of the link (unmeasured): such a group keeps the parts above.
SLOW_PARTS_PER_SHARD = 64
MIN_SLOW_PART_BYTES = 1 << 16
PART_SECONDS = 0.005
# The byte floors above are what a part weighs on the wire, in the round's codec: a message's own
# costs are per part whatever it holds, and a part of sparse or 8-bit values is 136x or 4x lighter
# than float32. Counted in float32 values, a 10 Mbit/s lab round of textlm small's int8 deltas went
# in 29 parts per shard, its sparse deltas too, and cost each peer 0.23 and 0.50 CPU-s a round
# against 0.11 and 0.15 in parts of 64K values (in process, checked rounds of 4 peers), a few
# percent of the training it runs beside.
# A declared bandwidth is a claim, and a reducer decides what its shard's average is: no member's
# claim counts for more than this many times the group's (lower) median claim. With 2, a liar
# claiming 1e12 in a group of n equal peers reduces 2/(n+1) of the vector instead of 1/n (40% in
# a group of 4), never all of it. An honest fast peer loses little by the bound: every sender
# must upload its whole vector once anyway, so letting one fast peer reduce more than twice the
# median's share shortens the others' rounds by less than a third (with 4 peers, one 10x faster).
MAX_SHARE_RATIO = 2.0


def bounded_claims(bandwidths: list[float], ratio: float = MAX_SHARE_RATIO) -> list[float]:
    """``bandwidths`` with each positive claim clipped to ``ratio`` times the lower median of the
    positive claims. The lower median is an honest claim (or between two) whenever fewer than half
    of the claims are lies, so a minority can neither raise the bound nor, by claiming little,
    push it below the smallest honest claim."""
    median = lower_median_claim(bandwidths)
    if median is None:
        return list(bandwidths)
    return [min(b, ratio * median) for b in bandwidths]


def lower_median_claim(bandwidths: list[float]) -> float | None:
    """The lower median of the positive claims (None if there are none)."""
    positive = sorted(b for b in bandwidths if b > 0)
    return positive[(len(positive) - 1) // 2] if positive else None


def part_for_links(bandwidths: list[float], value_bytes: float = 4.0) -> float:
    """The fewest values (of ``value_bytes`` each on the wire) a part may hold so that it takes
    PART_SECONDS at the lower median of the positive claims in ``bandwidths`` (bytes/s), which a
    minority of liars cannot move far; no bound (infinity) where that median is no measurement
    (the floor rate newcomers declare)."""
    median = lower_median_claim(bandwidths)
    if median is None or median <= UNMEASURED_BANDWIDTH:
        return math.inf
    return math.ceil(median * PART_SECONDS / value_bytes)


def slow_parts_per_shard(reducers: int) -> int:
    """How many parts a shard is cut into over slow links: SLOW_PARTS_PER_SHARD in groups of up to
    four reducers, fewer in larger ones (not below MIN_PARTS_PER_SHARD), since every sender's
    commitment names every part of every shard, and a reducer check carries each sender's: in a
    group of R reducers with k parts per shard that is R x k digests per sender, which should stay
    small beside the part itself."""
    return max(MIN_PARTS_PER_SHARD, SLOW_PARTS_PER_SHARD * 4 // max(1, reducers))


def split_by_bandwidth(total: int, bandwidths: list[float]) -> list[int]:
    """Shard sizes summing to ``total``, proportional to ``bandwidths`` (largest remainder rule).

    A reducer with bandwidth 0 gets nothing (client-mode peers declare 0)."""
    if total < 0:
        raise ValueError("total must be non-negative")
    if not bandwidths or any(b < 0 for b in bandwidths) or sum(bandwidths) <= 0:
        raise ValueError(f"need at least one positive bandwidth, got {bandwidths}")
    weight = sum(bandwidths)
    exact = [b / weight * total for b in bandwidths]  # share first: total * b may overflow
    sizes = [int(x) for x in exact]
    leftover = total - sum(sizes)
    by_remainder = sorted(range(len(bandwidths)), key=lambda i: (exact[i] - sizes[i], bandwidths[i]), reverse=True)
    for i in by_remainder[:leftover]:
        sizes[i] += 1
    return sizes


@dataclass(frozen=True)
class AllReducePlan:
    """Shard boundaries and part boundaries for one group all-reduce."""

    total: int
    shard_sizes: tuple[int, ...]
    part_size: int = DEFAULT_PART_SIZE

    @classmethod
    def build(
        cls, total: int, bandwidths: list[float], part_size: int = DEFAULT_PART_SIZE, value_bytes: float = 4.0
    ) -> AllReducePlan:
        """Shards in proportion to the reducers' claimed ``bandwidths``, each claim bounded
        (``bounded_claims``); parts of ``part_size`` elements, or smaller (not below
        MIN_PART_BYTES) so that the largest shard has MIN_PARTS_PER_SHARD of them, and over slow
        links smaller still (``part_for_links``, not below MIN_SLOW_PART_BYTES); ``value_bytes``:
        what a value weighs in the round's codec (``bytes_per_value``)."""
        if part_size <= 0:
            raise ValueError("part_size must be positive")
        if not value_bytes > 0:
            raise ValueError("value_bytes must be positive")
        shards = tuple(split_by_bandwidth(total, bounded_claims(bandwidths)))
        largest = max(shards, default=0)
        enough = max(math.ceil(MIN_PART_BYTES / value_bytes), -(-largest // MIN_PARTS_PER_SHARD))
        reducers = sum(1 for size in shards if size)
        floor = math.ceil(MIN_SLOW_PART_BYTES / value_bytes)
        slow = max(floor, -(-largest // slow_parts_per_shard(reducers)), part_for_links(bandwidths, value_bytes))
        return cls(total, shards, min(part_size, enough, slow))

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    def shard_bounds(self, index: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:index])
        return start, start + self.shard_sizes[index]

    def parts(self, index: int) -> list[tuple[int, int]]:
        """Element ranges (absolute, half-open) of the parts of shard ``index``: as few as hold at
        most ``part_size`` each, of sizes that differ by one at most. Cutting full parts and leaving
        the rest would leave a last part of any size down to one value, and CenteredClip over a
        few values is no mean: iid contributions lie at distances that vary as much as the values
        (4 contributions of 30 values: up to 0.19 from their mean; of 1,000: exact to float32)."""
        start, end = self.shard_bounds(index)
        count = self.num_parts(index)
        if count == 0:
            return []
        size, longer = divmod(end - start, count)  # the first ``longer`` parts hold one more
        bounds = [start + part * size + min(part, longer) for part in range(count + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def num_parts(self, index: int) -> int:
        return -(-self.shard_sizes[index] // self.part_size)


def bytes_per_value(payload_size: Callable[[int], int]) -> float:
    """What a value weighs on the wire in a codec (its ``payload_size``), over a part of the
    smallest size a plan cuts: what ``AllReducePlan.build`` counts its parts' bytes with."""
    values = MIN_SLOW_PART_BYTES // 4
    return payload_size(values) / values
