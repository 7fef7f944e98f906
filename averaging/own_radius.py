"""How far a round too small to outvote a liar may move a peer's values: a radius that the peer's
own history sets, sans I/O.

CenteredClip (``robust.py``) outvotes a liar only where honest contributions are the majority of
at least ``MIN_OUTVOTING``: among two senders (a group of two, or a larger one whose other senders
dropped out) the clipping radius and the median weight are whatever the other sender makes them,
so it sets the average (a 1e30 contribution gives 5e29 on both shards, its own reducer's included,
which recomputes honestly). Nothing inside such a round tells a liar from an honest peer whose
values differ, so each peer bounds the round by what it knows of itself: its averages may move
its values by at most ``RADIUS_FACTOR`` times the largest of its own last ``HISTORY_ROUNDS``
updates, and beyond that radius it keeps its own values (the move is scaled down onto the sphere).

A peer's own update in a round is how far its values moved since the last round by its own doing:
the smaller of their distance to what the last round left in them (training moved the parameters
from there) and to what it sent in the last round (a fresh gradient replaced the last one). Each
of the two counts nothing that another peer did to us in the case it is meant for, and the smaller
can only be smaller still, so a liar can shrink our radius, never grow it. An honest partner that
trains as we do differs from us by about our updates and theirs, and the mean moves us by half of
that: well inside the radius. A peer with no history yet (its first round, or the first after
loading a donor's state) has radius 0 and keeps its own values in such a round; one whose values
never change averages with nobody in it.

Distances are estimated on an even sample of at most ``SAMPLE`` coordinates, scaled up to the
whole vector: two small copies per averager, not two copies of the model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch

__all__ = ["HISTORY_ROUNDS", "MIN_OUTVOTING", "RADIUS_FACTOR", "SAMPLE", "OwnRadius", "bound_move", "bound_sparse_move"]

# One liar among three senders is outvoted: CenteredClip's radius from an honest start is the
# distance to the nearer other sender, an honest one, and the median weight is an honest one's.
MIN_OUTVOTING = 3
# The mean of two honest replicas moves each by half their difference, which is about the sum of
# both peers' updates since they last agreed: twice our own leaves room for a partner that trains
# a little faster or on different data, and holds a liar to twice what we moved by ourselves.
RADIUS_FACTOR = 2.0
# The largest update of this many rounds: one quiet round (a short epoch) does not shrink the radius.
HISTORY_ROUNDS = 8
# Coordinates the distances are estimated on: the estimate holds within a few percent for updates
# spread over many coordinates (as ``robust.RADII_SAMPLE``), in 512 KiB of float64 per copy.
SAMPLE = 1 << 16


class OwnRadius:
    """One averager's own history: samples of what it sent and was left with in its last round,
    and its recent update sizes. ``before_round`` with the values about to be sent gives the
    radius for the round; ``after_round`` with what the round left in them."""

    def __init__(self) -> None:
        self._sent: torch.Tensor | None = None
        self._left: torch.Tensor | None = None
        self._scale = 1.0  # sqrt(values / sampled values)
        self._updates: deque[float] = deque(maxlen=HISTORY_ROUNDS)

    def before_round(self, tensors: Sequence[torch.Tensor]) -> float:
        """Record this round's own values (to be sent); returns the radius the round may move them."""
        sample, scale = _sample(tensors)
        if self._sent is not None and self._left is not None and self._sent.shape == sample.shape:
            since_left = float(torch.linalg.vector_norm(sample - self._left))
            since_sent = float(torch.linalg.vector_norm(sample - self._sent))
            update = min(since_left, since_sent) * scale
            if math.isfinite(update):
                self._updates.append(update)
        self._sent, self._scale = sample, scale
        return RADIUS_FACTOR * max(self._updates, default=0.0)

    def after_round(self, tensors: Sequence[torch.Tensor]) -> None:
        """Record what the round (or its failure: our own values) left in the tensors."""
        self._left, _ = _sample(tensors)

    def reset(self) -> None:
        """Forget the history (the values were replaced wholesale: a donor's state was loaded)."""
        self._sent = self._left = None
        self._updates.clear()


def _sample(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """An even sample of the tensors' values (float64, CPU), and sqrt(values / sampled)."""
    total = sum(t.numel() for t in tensors)
    step = max(1, -(-total // SAMPLE))
    pieces = [t.detach().reshape(-1)[::step].to(device="cpu", dtype=torch.float64) for t in tensors]
    sample = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float64)
    return sample, math.sqrt(total / sample.numel()) if sample.numel() else 1.0


def bound_move(
    flat: torch.Tensor, parts: list[tuple[int, torch.Tensor]], radius: float
) -> tuple[list[tuple[int, torch.Tensor]], float]:
    """``parts`` ((flat offset, averaged values)) moved toward ``flat`` (our own values) so that
    together they move it by at most ``radius`` (L2 over all of them); returns them and how far they
    would have moved it. Parts within the radius come back as they are (tensor work)."""
    squares = math.fsum(
        float(torch.linalg.vector_norm(values.double() - flat[start : start + values.numel()].double())) ** 2
        for start, values in parts
    )
    moved = math.sqrt(squares)
    if moved <= radius:
        return parts, moved
    keep = radius / moved if math.isfinite(moved) else 0.0
    bounded = []
    for start, values in parts:
        own = flat[start : start + values.numel()]
        if keep == 0.0:
            bounded.append((start, own.clone()))
        else:
            bounded.append((start, (own.double() + (values.double() - own.double()) * keep).to(own.dtype)))
    return bounded, moved


def bound_sparse_move(
    flat: torch.Tensor, parts: list[tuple[int, torch.Tensor]], radius: float
) -> tuple[list[tuple[int, torch.Tensor]], float]:
    """``bound_move`` for a sparse codec's averages (``sparse_codec.py``), which hold only the
    values each chunk kept and zeros for the rest, which the round did not average: the move is
    measured and scaled at the kept values alone, and the rest stay zero (error feedback keeps our
    contribution to them), so that bounding it never turns a sparse average dense."""
    kept = [(start, values != 0) for start, values in parts]
    squares = math.fsum(
        float(torch.linalg.vector_norm((values.double() - flat[start : start + values.numel()].double())[mask])) ** 2
        for (start, values), (_, mask) in zip(parts, kept, strict=True)
    )
    moved = math.sqrt(squares)
    if moved <= radius:
        return parts, moved
    keep = radius / moved if math.isfinite(moved) else 0.0
    bounded = []
    for (start, values), (_, mask) in zip(parts, kept, strict=True):
        own = flat[start : start + values.numel()].double()
        toward = own + (values.double() - own) * keep if keep else own
        bounded.append((start, torch.where(mask, toward, 0.0).to(values.dtype)))
    return bounded, moved
