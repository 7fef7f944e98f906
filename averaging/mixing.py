"""Nearest-neighbour mixing of a part's contributions before CenteredClip, sans I/O.

Allouah et al., "Fixing by Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity"
(AISTATS 2023): each contribution is replaced by the mean of its ``k`` nearest contributions (itself
included), then the robust rule runs on the mixed rows. Where honest peers' data differ, their
contributions lie far apart, and a quiet attacker placed inside that spread (min-max, ALIE) is
clipped to the spread, which is wide; mixing shrinks the honest spread (each mixed row averages
``k`` contributions, at most ``f`` of them hostile), so the same attacker is clipped to a narrower
one. ``k = n - f`` with ``f = ceil(n / 2) - 1``, the most hostile members CenteredClip tolerates.

It is a rule a swarm asks for (``--aggregation centered-clip-mixed``), not the default: on
``benchmarks/byzantine.py``'s digits swarm (8 peers, 2 quiet attackers, label-skewed shards, local
updates, reducer checks) it helped some attacks from some initial models and not from others, and
held the worst case (sign flip) worse. Plain against mixed, means over initial models:

- one set of 3-6 models: clean 0.960 / 0.963, min-max 0.846 / 0.910, min-sum 0.829 / 0.837,
  IPM 0.921 / 0.930, ALIE 0.912 / 0.917, label flip 0.892 / 0.922, sign flip 0.865 / 0.843;
- the benchmark's ``--seeds 3``: clean 0.945 / 0.932, min-max 0.877 / 0.847, min-sum 0.885 /
  0.873, IPM 0.903 / 0.918, ALIE 0.916 / 0.900, label flip 0.912 / 0.896, sign flip 0.876 / 0.813
  (worst drop 0.070 plain, 0.119 mixed).

Sign flip is where mixing loses: an attacker inside the honest cloud is some honest rows' near
neighbour, and each of those mixes carries up to ``f / k`` of it unclipped. With iid shards
(checks off) it lifted min-max 0.890 -> 0.956; with gradients of 32-sample batches it cost the
clean run 0.04. CPU: 8 rows of 2**19 values take ~45 ms more than CenteredClip's ~13 ms (the
float64 distances and sums below).

The sets are a choice a checker must be able to repeat: distances computed on two machines can
order near-ties differently. So a reducer states the sets it mixed (``PartInputs.neighbours``) and a
checker accepts any sets that are nearest up to ``TIE_TOLERANCE`` (``sets_hold``), then recomputes
with them: a lying reducer can only pick among near-ties, each as near as the one it left out.

Both sides must get the same numbers from the same inputs, on any machine: the distances are
every pair's differences in float64 (``torch.pdist``: no cancellation, no overflow of hostile
float32 values), and each mixed row a float64 sum of its set's rows in the set's order, divided
and rounded to float32 once (elementwise IEEE operations in a fixed order, no BLAS: identical
sets give bit-identical rows on any machine). On mixed rows a clip radius from the start's
``floor(n / 2)``-th distance can be 0 (half the group sharing one set mixes to one row, which
would then drop every other contribution), so the radius is at least the raw rows' spread over
sqrt(k) (``tau_floor``), the spread of a mean of k of them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .robust import RADIUS_SHARE, START_SLACK, Aggregation, start_radii

__all__ = [
    "TIE_TOLERANCE",
    "distances",
    "mix",
    "mixed_count",
    "mixes",
    "nearest_sets",
    "sets_hold",
    "start_of_mixed",
    "tau_floor",
]

# Distances within this share of a row's k-th nearest count as tied with it: far above float64
# rounding, far below what separates contributions.
TIE_TOLERANCE = 1e-3


def mixed_count(n: int) -> int:
    """``k``: how many contributions each mixed row averages, itself included."""
    return n - (math.ceil(n / 2) - 1)


def mixes(aggregation: Aggregation, n: int) -> bool:
    """Whether a part of ``n`` contributions is mixed under ``aggregation``: with the mixed rule,
    from three on (two would mix into one row, ``k = n``)."""
    return aggregation is Aggregation.CENTERED_CLIP_MIXED and mixed_count(n) < n


def distances(values: torch.Tensor) -> np.ndarray:
    """Every distance between the rows of ``values`` (n x m), n x n, float64."""
    n = values.shape[0]
    square = np.zeros((n, n))
    square[np.triu_indices(n, 1)] = torch.pdist(values.double()).numpy()
    return square + square.T


def nearest_sets(between: np.ndarray) -> list[list[int]]:
    """For each row (``between``: ``distances`` of the rows), its ``mixed_count(n)`` nearest
    rows, itself first, the rest in order of distance (ties by index)."""
    n = between.shape[0]
    k = mixed_count(n)
    sets = []
    for row in range(n):
        others = sorted((float(between[row, j]), j) for j in range(n) if j != row)
        sets.append([row, *(j for _, j in others[: k - 1])])
    return sets


def mix(values: torch.Tensor, sets: list[list[int]]) -> torch.Tensor:
    """Each row replaced by the mean of the rows its set names (float32, n x m), summed in
    float64 in the set's order: the same bits on every machine."""
    mixed = torch.empty_like(values)
    total = torch.empty(values.shape[1], dtype=torch.float64)
    for row, chosen in enumerate(sets):
        total.copy_(values[chosen[0]])
        for j in chosen[1:]:
            total.add_(values[j])
        torch.div(total, len(chosen), out=total)
        mixed[row].copy_(total)
    return mixed


def tau_floor(between: np.ndarray) -> float:
    """The least clip radius for mixed rows: ``RADIUS_SHARE`` times the median over rows of each
    row's ``floor(n / 2)``-th distance (the radius CenteredClip would take on the raw rows from a
    typical start), over sqrt(k), the spread of a mean of k of them. Mixed rows share members, so
    they lie closer than that and the floor is most often the radius (1.7-2.2x their own at 4-16
    rows of iid values): it still clips an IPM attacker to about half of plain CenteredClip's
    pull. Over k (two mixes that differ by one member) it clipped tighter in groups of 8, and in
    groups of 4-5 the members outside a set that mixes to one row counted next to nothing."""
    n = between.shape[0]
    radii = np.sort(between, axis=1)[:, n // 2]
    return RADIUS_SHARE * float(np.median(radii)) / math.sqrt(mixed_count(n))


def start_of_mixed(mixed: torch.Tensor, own: int) -> int:
    """Where CenteredClip starts on mixed rows: our own (row ``own``) unless another's radius (its
    ``floor(n / 2)``-th distance) is smaller by more than ``START_SLACK``, then the smallest's.
    From exact radii: mixed rows often coincide (smallest radius 0), and a start chosen from a
    sample of coordinates could be framed by a sender equal to ours on the sample only."""
    radii = start_radii(mixed, mixed[own], exact=True)  # (what checkers bound the start by)
    smallest = min(radii)
    return own if radii[own] <= START_SLACK * smallest else radii.index(smallest)


def sets_hold(between: np.ndarray, sets: object) -> str | None:
    """Why ``sets`` (a reducer's statement, untrusted) are not nearest sets of the rows whose
    ``distances`` are ``between``, or None: each must be ``mixed_count(n)`` distinct rows, its
    own first, none farther than the row's k-th nearest distance and every row left out no
    nearer, both up to ``TIE_TOLERANCE``."""
    n = between.shape[0]
    k = mixed_count(n)
    if not isinstance(sets, list) or len(sets) != n:
        return f"it states {len(sets) if isinstance(sets, list) else 'no'} neighbour sets for {n} inputs"
    for row, chosen in enumerate(sets):
        if not (
            isinstance(chosen, list)
            and len(chosen) == k
            and all(type(j) is int and 0 <= j < n for j in chosen)
            and len(set(chosen)) == k
            and chosen[0] == row
        ):
            return f"its neighbour set of input {row} is not {k} distinct inputs starting with {row}"
        bound = float(np.sort(between[row])[k - 1])  # the k-th nearest (the row itself, at 0, is the first)
        slack = TIE_TOLERANCE * bound
        farthest_in = max(float(between[row, j]) for j in chosen)
        left_out = [float(between[row, j]) for j in range(n) if j not in chosen]
        if farthest_in > bound + slack or (left_out and min(left_out) < bound - slack):
            return f"its neighbour set of input {row} is not among the {k} nearest"
    return None
