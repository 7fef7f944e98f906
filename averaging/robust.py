"""Robust aggregation of one part: CenteredClip over the senders' contributions, sans I/O.

A reducer that takes the plain weighted mean hands any single sender the whole result: one finite
1e30 contribution, or one claimed weight of 2**40, sets the average. With ``centered-clip`` a
reducer aggregates each part with CenteredClip (Karimireddy, He and Jaggi, "Learning from History
for Byzantine Robust Optimization", ICML 2021; used per part by BTARD, Gorbunov et al., "Secure
Distributed Training at Scale", ICML 2022)::

    v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||) / sum_i w_i

a fixed-point iteration whose every step moves ``v`` by at most ``tau * w_i / sum(w)`` on account
of sender ``i``, however far away its ``x_i`` lies. A hostile minority can therefore pull the
result by O(tau * hostile weight share), not more.

Choices the papers leave open, and ours:

- **Start.** The papers start from the last round's result (momentum); a part has no such memory
  here (shards follow the group), and the mean is no start (1e30 / n away). We start from the
  contribution whose radius (below) is smallest, estimated from one Gram matrix of a sample of
  coordinates: while fewer than half are hostile it lies within the honest cloud, and it is the
  same whoever reduces. A reducer's own contribution is no start: a quiet attacker that reduces
  honestly would start from its own (IPM's -4x the honest mean, Xie et al. 2020), whose radius
  takes in every honest contribution, and its shard would come out as the mean, pulled past zero
  (on digits with 2 of 8 attackers the honest peers fell from 0.958 to 0.476). The reducer's own
  contribution stays the start while its radius is within ``START_SLACK`` of the smallest (it is
  then as good a start, and saves a pass), and is always the origin the contributions are taken
  relative to. A reducer that sends nothing starts from the coordinate-wise median.
- **Radius.** ``tau`` is ``RADIUS_SHARE`` (1 / sqrt 2) times the ``floor(n / 2)``-th smallest
  distance from that start to the ``n`` contributions (its own, at 0, included). While fewer
  than half are hostile, at least ``floor(n / 2) + 1`` are honest, so from an honest start that
  distance is at most the distance to the farthest honest one: it scales with the honest spread
  (BTARD's choice of tau follows the honest variance) with no knob to tune per model. In high
  dimensions honest contributions that deviate independently lie at nearly equal distances from
  each other, sqrt 2 times their distance from their mean, which is where the iteration ends:
  so tau is about the honest contributions' distance from the result, and on a clean group they
  are clipped by a few percent at most (the result is the mean up to that), while a contribution
  farther out (ALIE with z > 1, a sign flip, min-max's) is clipped to the honest spread. The whole
  distance instead let each of those pull by up to sqrt 2 times as much (on digits with 2 of 8
  attackers, over 3 seeds: ALIE z = 2 on local updates 0.914 against 0.947, label flipping 0.932
  against 0.944, clean 0.966 / 0.965 against 0.960 / 0.964). Peers that check a reducer
  (``verification.py``) recompute the radius from the reducer's start, and bound that start.
- **Iterations.** At most ``MAX_ITERATIONS``, ending once a step moves ``v`` by less than
  ``TOLERANCE * tau``; from an honest start a clean group takes a few.
- **Weights.** Claimed weights are clipped to ``MAX_WEIGHT_RATIO`` times the median positive
  weight of the part's contributors before anything else (``clip_weights``).

Contributions are taken relative to the trusted point, one row each of a workspace, so an iteration is
two passes over them (distances to ``v`` from ``rows @ v``, then the step); values too large for
float32 squares (a 1e30 contribution) switch the part to float64, which only hostile inputs need.
Small parts (``GRAM_LIMIT`` values over all contributions: a small model's, where each torch call
costs more than the values it touches) iterate instead on the rows' float64 Gram matrix, n x n
numbers, and read the rows once more only for the result (``_centered_clip_gram``).
"""

from __future__ import annotations

import enum
import math

import numpy as np
import torch

__all__ = [
    "START_SLACK",
    "Aggregation",
    "MAX_ITERATIONS",
    "MAX_WEIGHT_RATIO",
    "RADIUS_SHARE",
    "TOLERANCE",
    "centered_clip",
    "clip_radius",
    "clip_weights",
    "resolve_aggregation",
]

# A peer's weight is the samples it accumulated; honest peers of one swarm differ by their speed.
# 2x the group's median lets a peer that did twice the typical work count double, while a hostile
# quarter of a group (each claiming the cap) holds at most 2f / (2f + n - f) <= 2/5 of the weight
# whenever the honest weights are at least the median: under CenteredClip's breakdown point of
# one half, so the clipped iteration stays anchored to the honest majority.
MAX_WEIGHT_RATIO = 2.0
# Bounded work per part: from the reducer's own contribution a clean group converges in 2-3 steps;
# attackers far away are clipped from the first step on, so the bound only cuts off a slow crawl
# near the fixed point.
MAX_ITERATIONS = 20
# Our own contribution is kept as the start while its radius is within this factor of the
# smallest radius among the members': honest high-dimensional contributions give radii within a
# few percent of each other, so an honest reducer keeps its own start (one pass fewer) about as
# often as not, while a quiet attacker's contribution (IPM, min-max: its radius takes in the honest
# cloud) or a replica that lags lies beyond it, and starts from the closest-knit contribution.
START_SLACK = 1.05
# A step shorter than this share of tau ends the iteration: far below what any single
# contribution may move the result by (tau * its weight share).
TOLERANCE = 1e-4
# The radius, as a share of the start's ``floor(n / 2)``-th distance: an honest start is about
# sqrt 2 times as far from the other honest contributions as the result is (see "Radius").
RADIUS_SHARE = 1 / math.sqrt(2)


class Aggregation(str, enum.Enum):
    MEAN = "mean"  # the weighted mean: exact, and at any one sender's mercy
    CENTERED_CLIP = "centered-clip"  # CenteredClip, weights clipped to the median's ratio
    # CenteredClip over nearest-neighbour mixes of the contributions (``mixing.py``), on request
    CENTERED_CLIP_MIXED = "centered-clip-mixed"

    @property
    def robust(self) -> bool:
        """Whether one sender's contribution moves the result by a bounded amount (CenteredClip)."""
        return self is not Aggregation.MEAN


def resolve_aggregation(aggregation: Aggregation | str, private: bool) -> Aggregation:
    """``auto``: centered-clip in public swarms (anyone may join), the exact mean in private ones
    (every member is known)."""
    if aggregation == "auto":
        return Aggregation.MEAN if private else Aggregation.CENTERED_CLIP
    return Aggregation(aggregation)


def clip_weights(weights: list[float], ratio: float = MAX_WEIGHT_RATIO) -> list[float]:
    """Each weight capped at ``ratio`` times the median positive weight (the lower median: with
    fewer than half the weights hostile it is at most an honest one)."""
    positive = sorted(w for w in weights if w > 0)
    if not positive:
        return list(weights)
    cap = ratio * positive[(len(positive) - 1) // 2]
    return [min(w, cap) for w in weights]


def clip_radius(parts: list[torch.Tensor], center: torch.Tensor | None) -> float:
    """The radius ``centered_clip`` picks for ``parts`` from ``center`` (see the module docstring)."""
    if len(parts) < 2:
        return 0.0
    if center is None:
        center = torch.stack(parts).median(dim=0).values
    distances = torch.linalg.vector_norm(torch.stack(parts).double() - center.double(), dim=1)
    return RADIUS_SHARE * float(distances.sort().values[len(parts) // 2])


def centered_clip(
    parts: list[torch.Tensor],
    weights: list[float],
    out: torch.Tensor,
    *,
    center: torch.Tensor | None = None,
    tau: float | None = None,
    workspace: torch.Tensor | None = None,
    choose_start: bool = True,
    min_tau: float = 0.0,
) -> tuple[float, int | None]:
    """Write the CenteredClip aggregate of ``parts`` (1-d float32, all finite, weights positive
    and already clipped) into ``out``; returns the clipping radius tau (0 for a single part), and
    the index of the part it started from instead of ``center``, if it did (see "Start").

    ``center``: a contribution this peer trusts (its own); the iteration starts there unless
    another is closer-knit (see "Start"), and the contributions are taken relative to it (exact
    distances in float32 even where they are tiny next to the values, as between replicas'
    parameters). Without one it starts from the coordinate-wise median (a sort: several times
    the cost). ``tau``: the radius to use instead of choosing one, and ``choose_start=False`` to
    start at ``center`` whatever it is (to recompute another peer's aggregate). ``workspace``: at
    least ``len(parts) * numel`` float32 values to work in (else allocated). ``min_tau``: the
    least radius it chooses (for mixed rows, which can coincide: ``mixing.tau_floor``)."""
    n = len(parts)
    if n == 0:
        raise ValueError("nothing to aggregate")
    if n == 1:
        out.copy_(parts[0])
        return 0.0, None
    numel = parts[0].numel()
    if n * numel <= GRAM_LIMIT:
        return _centered_clip_gram(parts, weights, out, center, tau, choose_start, min_tau)
    if workspace is not None and workspace.numel() >= n * numel:
        rows = workspace[: n * numel].view(n, numel)
    else:
        rows = torch.empty(n, numel, dtype=torch.float32)
    moved_to = _start_instead(parts, center) if center is not None and choose_start and n > 2 else None
    if moved_to is not None:  # our own contribution is no start: start from the closest-knit one
        again = dict(tau=tau, workspace=workspace, choose_start=False, min_tau=min_tau)
        tau, _ = centered_clip(parts, weights, out, center=parts[moved_to], **again)
        return tau, moved_to
    if center is None:
        center = torch.stack(parts, out=rows).median(dim=0).values
    for row, part in zip(rows, parts, strict=True):
        torch.sub(part, center, out=row)
    norms = torch.linalg.vector_norm(rows, dim=1)
    if not torch.isfinite(norms).all():  # beyond float32's squares: only hostile values get here
        rows = torch.stack([part.double() for part in parts]).sub_(center.double())
        norms = torch.linalg.vector_norm(rows, dim=1)
    # The n-long quantities (distances, weights, clip factors) are Python floats: for the small
    # parts of small models, tensor calls on 8 numbers would cost more than the parts themselves.
    dist = [float(d) for d in norms.double().tolist()]
    squares = [d * d for d in dist]
    if tau is None:
        tau = max(RADIUS_SHARE * sorted(dist)[n // 2], min_tau)
    total = math.fsum(weights)
    w = [weight / total for weight in weights]
    # v, relative to the start, lives in ``out`` (float32) unless the rows had to be float64
    v = out if rows.dtype == torch.float32 else torch.empty(numel, dtype=rows.dtype)
    for iteration in range(MAX_ITERATIONS if tau > 0 else 1):
        scale = [wi if d <= tau else wi * tau / d for wi, d in zip(w, dist, strict=True)]
        coefficients = torch.tensor(scale, dtype=rows.dtype)
        if iteration == 0:  # v is 0: the step is the clipped mean of the rows
            torch.matmul(coefficients.unsqueeze(0), rows, out=v.unsqueeze(0))
            moved = float(torch.linalg.vector_norm(v))
        else:
            step = coefficients @ rows
            step.sub_(v, alpha=math.fsum(scale))
            v += step
            moved = float(torch.linalg.vector_norm(step))
        if moved <= TOLERANCE * tau:
            break
        projections = (rows @ v).double().tolist()
        v_square = float(torch.linalg.vector_norm(v)) ** 2
        dist = [math.sqrt(max(0.0, sq - 2 * p + v_square)) for sq, p in zip(squares, projections, strict=True)]
    if v is out:
        out.add_(center)
    else:
        torch.add(v, center, out=out)
    return tau, None


def _start_instead(parts: list[torch.Tensor], center: torch.Tensor) -> int | None:
    """The part to start from if ``center`` (our trusted contribution) has a radius beyond
    ``START_SLACK`` times the smallest, all by the radii of a sample of coordinates (see "Start");
    else None."""
    n, numel = len(parts), parts[0].numel()
    step = -(-numel // RADII_SAMPLE)  # (the sample ``start_radii`` would take, without stacking the rest)
    rows = torch.stack([part[::step] for part in parts]).double().sub_(center[::step].double())
    gram = (rows @ rows.T).numpy()
    radii = np.sort(row_distances(rows, None, gram), axis=1)[:, n // 2]
    own = float(np.sort(np.sqrt(np.maximum(gram.diagonal(), 0.0)))[n // 2])
    if own > START_SLACK * float(radii.min()):
        return int(np.argmin(radii))
    return None


# Parts of at most this many values, over all contributions, iterate on their Gram matrix
# (``_centered_clip_gram``): one float64 matrix product, then n x n steps. Above it the rows are
# streamed each step, which costs fewer passes than the Gram matrix's n for large groups and keeps
# float32.
GRAM_LIMIT = 1 << 18


def _centered_clip_gram(
    parts: list[torch.Tensor],
    weights: list[float],
    out: torch.Tensor,
    center: torch.Tensor | None,
    tau: float | None,
    choose_start: bool,
    min_tau: float = 0.0,
) -> tuple[float, int | None]:
    """``centered_clip`` for small parts, where a step over the rows costs less than the calls
    that make it: ``v`` stays a combination ``c @ rows`` of the contributions relative to the start
    (it starts at 0 and each step is one), so with the rows' Gram matrix ``G`` every distance is
    ``sqrt(G_ii - 2 (G c)_i + c G c)`` and every step's length ``sqrt(d G d)``: the iteration runs
    on n numbers, and the rows are read twice (the Gram matrix, then ``v``). Exact float64
    throughout (the rows as float64 differences: no squares overflow), so the tolerance test is as
    sharp as the streamed one's."""
    n = len(parts)
    trusted = center is not None
    stacked = torch.stack(parts).double()
    start = stacked.median(dim=0).values if center is None else center.double()
    rows = stacked.sub_(start)
    gram = (rows @ rows.T).numpy()
    squares = gram.diagonal().copy()
    dist = np.sqrt(squares)
    if trusted and choose_start and n > 2:
        between = row_distances(rows, None, gram)  # (float64 differences of float32 values: exact)
        radii = np.sort(between, axis=1)[:, n // 2]
        if float(np.sort(dist)[n // 2]) > START_SLACK * float(radii.min()):  # a closer-knit start
            moved_to = int(np.argmin(radii))
            tau, _ = _centered_clip_gram(parts, weights, out, parts[moved_to], tau, False, min_tau)
            return tau, moved_to
    if tau is None:
        tau = max(RADIUS_SHARE * float(np.sort(dist)[n // 2]), min_tau)
    w = np.asarray(weights, dtype=np.float64)
    w = w / math.fsum(weights)
    c = np.zeros(n)
    gram_c = np.zeros(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        for _iteration in range(MAX_ITERATIONS if tau > 0 else 1):
            scale = np.where(dist <= tau, w, w * tau / dist)
            step = scale - scale.sum() * c  # v + sum_i scale_i (x_i - v), as coefficients
            c += step
            gram_step = gram @ step
            gram_c += gram_step
            if math.sqrt(max(0.0, float(step @ gram_step))) <= TOLERANCE * tau:
                break
            dist = np.sqrt(np.maximum(squares - 2 * gram_c + float(c @ gram_c), 0.0))
    v = torch.from_numpy(c) @ rows
    torch.add(v, start, out=v)
    out.copy_(v)
    return tau, None


# The rows that ``start_radii`` samples at most: enough for its estimate to hold within a few
# percent on high-dimensional contributions, and one small matrix product however large a part.
RADII_SAMPLE = 1 << 16


def start_radii(values: torch.Tensor, origin: torch.Tensor, exact: bool = False) -> list[float]:
    """For each row of ``values``, the radius ``centered_clip`` would pick starting there
    (``row_distances`` relative to ``origin``, best a trusted row), over an even sample of
    ``RADII_SAMPLE`` coordinates unless ``exact``."""
    n, numel = values.shape
    if not exact and numel > RADII_SAMPLE:
        step = -(-numel // RADII_SAMPLE)
        values, origin = values[:, ::step], origin[::step]
    return np.sort(row_distances(values, origin), axis=1)[:, n // 2].tolist()


# A squared distance below this share of the two rows' squares (relative to the origin) has lost
# too many digits to the Gram matrix's cancellation (rows close to each other, far from the
# origin): ``row_distances`` takes it from the rows' difference instead.
CANCELLATION = 1e-6


def row_distances(values: torch.Tensor, origin: torch.Tensor | None, gram: np.ndarray | None = None) -> np.ndarray:
    """Every distance between the rows of ``values`` (n x m), in float64: from the Gram matrix
    of the rows relative to ``origin`` (None: they are relative already; ``gram``: that matrix,
    if the caller has it), except between rows
    close to each other and far from the origin (a replica that lags as the origin, the others
    in agreement), where ``|a|^2 + |b|^2 - 2ab`` cancels to noise: those from their difference,
    taken on ``values`` themselves (a difference relative to the origin would be rounded)."""
    if gram is None:
        rows = values.double() if origin is None else values.double() - origin.double()
        gram = (rows @ rows.T).numpy()
    squares = gram.diagonal()
    total = squares[:, None] + squares[None, :]
    between = total - 2 * gram
    lost = np.triu(between < CANCELLATION * total, 1)
    distances = np.sqrt(np.maximum(between, 0.0))
    for row in np.flatnonzero(lost.any(axis=1)):
        others = np.flatnonzero(lost[row])
        exact = torch.linalg.vector_norm(values[others].double() - values[row].double(), dim=1).numpy()
        distances[row, others] = exact
        distances[others, row] = exact
    np.fill_diagonal(distances, 0.0)
    return distances
