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

from dataclasses import dataclass

__all__ = [
    "AllReducePlan",
    "DEFAULT_PART_SIZE",
    "MAX_SHARE_RATIO",
    "MIN_PART_SIZE",
    "MIN_PARTS_PER_SHARD",
    "bounded_claims",
    "split_by_bandwidth",
]

# 2^19 float32 values = 2 MiB per part: large enough that per-message costs vanish, small enough
# that several parts are in flight per shard so sending overlaps reducing.
DEFAULT_PART_SIZE = 1 << 19
# A reducer answers a part once every sender delivered it, so the all-gather can only overlap the
# reduce-scatter part by part: with 2 parts per shard (16 MiB among 4 peers at the default size)
# half of every shard's answers wait for the slowest sender's last bytes. Parts are made smaller,
# down to MIN_PART_SIZE (256 KiB, where per-message costs still vanish), until the largest shard
# has this many (the 100 Mbit/s lab, 16 MiB, 4 peers, 8 interleaved runs each: 0.81 of the
# line-rate bound against 0.78 with 2 parts per shard; 16 parts measured no better; the loopback
# benchmark's 64 MiB shards keep their 8 parts of the full size).
MIN_PARTS_PER_SHARD = 8
MIN_PART_SIZE = 1 << 16
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
    positive = sorted(b for b in bandwidths if b > 0)
    if not positive:
        return list(bandwidths)
    bound = ratio * positive[(len(positive) - 1) // 2]
    return [min(b, bound) for b in bandwidths]


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
    def build(cls, total: int, bandwidths: list[float], part_size: int = DEFAULT_PART_SIZE) -> AllReducePlan:
        """Shards in proportion to the reducers' claimed ``bandwidths``, each claim bounded
        (``bounded_claims``); parts of ``part_size`` elements, or smaller (not below
        MIN_PART_SIZE) so that the largest shard has MIN_PARTS_PER_SHARD of them."""
        if part_size <= 0:
            raise ValueError("part_size must be positive")
        shards = tuple(split_by_bandwidth(total, bounded_claims(bandwidths)))
        enough = max(MIN_PART_SIZE, -(-max(shards, default=0) // MIN_PARTS_PER_SHARD))
        return cls(total, shards, min(part_size, enough))

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    def shard_bounds(self, index: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:index])
        return start, start + self.shard_sizes[index]

    def parts(self, index: int) -> list[tuple[int, int]]:
        """Element ranges (absolute, half-open) of the parts of shard ``index``."""
        start, end = self.shard_bounds(index)
        return [(offset, min(offset + self.part_size, end)) for offset in range(start, end, self.part_size)]

    def num_parts(self, index: int) -> int:
        return -(-self.shard_sizes[index] // self.part_size)
