"""Contributions scored by what they do to this peer's held-out loss, over rounds, sans I/O.

Robust aggregation bounds how far a contribution can pull a part, but a quiet attacker stays
inside the honest spread and pulls every round. On label-skewed data the honest spread is wide,
and there CenteredClip lets inner-product manipulation (every attacker sends -eps times the
honest mean, Xie et al. 2020) and label flipping cost 0.07-0.11 of held-out accuracy on digits.
What such an attacker cannot hide is the direction it pulls in: against the loss.

So a reducer that knows the gradient of a held-out loss at the point the round's contributions
start from (its ``reference``: the gradient itself in collaborative training, at the shared start
in local updates) scores each sender's contribution to its shard by the cosine between the two.
A contribution ``x`` is applied as ``params - lr * x``, so its first-order effect on that loss is
``-lr * <reference, x>``: a positive cosine lowers the loss, a negative one raises it (the
stochastic descent score of Zeno, Xie, Koyejo, Gupta 2019, without its magnitude term, which
CenteredClip's radius already bounds; permissionless runs score submissions by loss improvement
the same way). One round's cosine is noisy (one batch, one shard), so a sender is judged on its
running mean (``ContributionScores``): a sender whose mean is below ``BAN_BELOW`` after
``MIN_ROUNDS`` rounds made our held-out loss worse round after round, and is banned; so is one
whose mean is below it by ``EARLY_MARGIN`` standard errors of its rounds from ``EARLY_ROUNDS`` on.

What the measurements chose (``benchmarks/byzantine.py --scored``: digits, 8 peers, 2 attackers,
label-skewed shards, 3 initial models; the reference on 256 training images every peer holds).
Traced over whole shards (21 runs, no bans), honest senders' running means stayed above -0.3, the
attackers' of IPM and sign flipping fell below -0.4 within 10-30 rounds, label flipping's lay in
[-0.45, -0.1], so it is caught in gradient mode only; with the per-part cosines below, no honest
peer was banned in any run. Rounds in which our own contribution did not lower the loss are
not counted: near the swarm's minimum, honest senders of skewed data pull every way around it
(without this rule, honest senders were banned after ~80 rounds). A reference from the reducer's
own skewed data separates nothing (honest senders down to -0.49, IPM up to +0.04): the scoring
data must be the swarm's objective, not one peer's slice of it. Accuracy drop from the clean run
(mean of 3), without / with scores: IPM in gradient mode 0.110 / 0.006, label flipping 0.070 /
0.036; clean runs unchanged, no honest peer banned. ALIE, min-max and min-sum stay near the honest
mean, point with it, and are not caught. Local updates at the outer lr 0.35 (4 initial models):
sign flipping 0.102 unscored, 0.006 scored; IPM 0.086 / 0.010-0.014; label flipping
0.035 either way.

Memory: one score per sender, at most ``MAX_TRACKED`` (the least recently seen go first), so new
identities cannot grow it; a banned sender's score goes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

__all__ = [
    "BAN_BELOW",
    "MAX_TRACKED",
    "MEMORY_ROUNDS",
    "MIN_ROUNDS",
    "EARLY_ROUNDS",
    "EARLY_MARGIN",
    "INFORMATIVE",
    "ContributionScores",
    "HeldOutGradient",
    "ShardAlignment",
    "part_cosine",
]

MIN_ROUNDS = 10  # a sender is judged by its mean after this many scored rounds
# ... or sooner, from EARLY_ROUNDS on, if its mean lies below the line by EARLY_MARGIN standard
# errors of its rounds' cosines. Every round before the ban is a round the attacker's pull lands (in
# local updates the outer momentum carries it on): two sign flippers of 8 on label-skewed shards
# (outer lr 0.35, 4 initial models) cost 0.036 judged after 10 rounds, and 0.006 judged within 5-8,
# about what their absence alone costs (0.004-0.013). A sender that pulls against the loss does so
# round after round; an honest one whose few rounds happen to average below the line scatters, and
# the margin leaves it to its later rounds. Simulated, 8 senders x 200 rounds, 6,000 runs, cosines
# drawn from N(0.05, 0.35) (wider than honest senders' on skewed digits): about 1 run in 600
# judges an honest sender (3 with the margin 0.5, 11 with the plain mean after 5 rounds, none
# after 10 alone); from N(-0.1, 0.35), near the line, 28-45 runs in 600 do, against 18-21 judged
# after 10 rounds alone. A sender drawn from N(-0.5, 0.15) is judged at round 5; from N(-0.45,
# 0.15) at round 6 (median: 42% at 5, 23% at 10 or later).
EARLY_ROUNDS = 5
EARLY_MARGIN = 1.0
BAN_BELOW = -0.4  # a running mean cosine below this: its contributions raise our held-out loss
MEMORY_ROUNDS = 32  # the mean weighs the last ~this many rounds (older behaviour fades)
MAX_TRACKED = 4096
INFORMATIVE = 0.0  # a round counts if our own contribution's cosine is at least this

# The gradient of this peer's held-out loss at the given values of its parameters (one tensor per
# parameter, in the optimizer's order): what the optimizers score contributions against.
HeldOutGradient = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


class ShardAlignment:
    """One round's alignment of each sender's contribution to our shard with the reference, part by
    part as the shard is aggregated.

    A part's cosine compares the values a sender sent (its nonzero ones: a sparse codec's kept
    values) with the reference's at the same places, so a sparse contribution that points
    against the loss scores as a dense one would. A sender's cosine is the mean over the parts it
    contributed to, each weighted by the reference's squared norm there (where the loss is
    steepest counts most). Per part, not over the whole shard: one huge value (finite values
    pass) would otherwise swamp a sender's norm and bring its cosine to ~0, hiding the pull of
    every other part, while CenteredClip clips parts apart and the value costs its sender only the
    pull of its own part."""

    def __init__(self, reference: torch.Tensor, part_offsets: Sequence[int], own: Hashable | None = None):
        self.reference = reference.detach().reshape(-1).to(torch.float32)
        self.part_offsets = list(part_offsets)
        self.own = own  # our own contribution: not scored, but it says whether the round can be
        self._sums: dict[Hashable, tuple[float, float]] = {}  # sender -> (weighted cosines, weights)

    def add_part(self, index: int, contributions: Mapping[Hashable, torch.Tensor]) -> None:
        """Part ``index``'s contributions (sender -> values), as aggregated, ours among them."""
        if not contributions:
            return
        start = self.part_offsets[index]
        size = next(iter(contributions.values())).numel()
        reference = self.reference[start : start + size]
        squares = reference.square()
        for sender, values in contributions.items():
            found = part_cosine(reference, values.reshape(-1), squares)
            if found is not None:
                cosine, weight = found
                total, weights = self._sums.get(sender, (0.0, 0.0))
                self._sums[sender] = (total + cosine * weight, weights + weight)

    def _cosine(self, sender: Hashable) -> float | None:
        total, weights = self._sums.get(sender, (0.0, 0.0))
        return max(-1.0, min(1.0, total / weights)) if weights > 0 else None

    def cosines(self) -> dict[Hashable, float]:
        """Each scored sender's cosine over the parts it contributed to (senders with no values, or
        a zero reference where they sent, have none)."""
        found = {sender: self._cosine(sender) for sender in self._sums if sender != self.own}
        return {sender: cosine for sender, cosine in found.items() if cosine is not None}

    def own_cosine(self) -> float | None:
        """The cosine of our own contribution with the reference (None: we sent none)."""
        return None if self.own is None else self._cosine(self.own)


def part_cosine(reference: torch.Tensor, values: torch.Tensor, squares: torch.Tensor) -> tuple[float, float] | None:
    """(cosine, weight) of one part's ``values`` with ``reference`` (``squares``: its squares) over
    the values sent (nonzero), the weight being the reference's squared norm there; None if either
    is zero there. Sums that overflow float32 (values near 1e20) are taken again in float64."""
    sent = (values != 0).to(reference.dtype)
    figures = [float(reference @ values), float(values @ values), float(squares @ sent)]
    if not all(math.isfinite(figure) for figure in figures):
        wide, widest = reference.double(), values.double()
        figures = [float(wide @ widest), float(widest @ widest), float(wide.square() @ sent.double())]
    dot, norm_squared, weight = figures
    if not (norm_squared > 0 and weight > 0 and all(math.isfinite(figure) for figure in figures)):
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(norm_squared * weight))), weight


class ContributionScores:
    """Each sender's running mean cosine (``ShardAlignment``) over the rounds we reduced its
    contributions, and the verdict on it."""

    def __init__(
        self,
        min_rounds: int = MIN_ROUNDS,
        ban_below: float = BAN_BELOW,
        memory_rounds: int = MEMORY_ROUNDS,
        max_tracked: int = MAX_TRACKED,
        informative: float = INFORMATIVE,
        early_rounds: int = EARLY_ROUNDS,
        early_margin: float = EARLY_MARGIN,
    ):
        self.min_rounds, self.ban_below, self.informative = min_rounds, ban_below, informative
        self.memory_rounds, self.max_tracked = memory_rounds, max_tracked
        if early_rounds < 2:
            raise ValueError(f"early_rounds must be 2 or more (a spread needs two rounds), not {early_rounds}")
        self.early_rounds, self.early_margin = early_rounds, early_margin
        # the early rule's rounds: those whose running mean is a plain one
        self._plain_until = min(min_rounds, memory_rounds)
        # sender -> (mean, rounds, sum of squared deviations over its first plain rounds)
        self._scores: OrderedDict[Hashable, tuple[float, int, float]] = OrderedDict()

    def observe(self, cosines: Mapping[Hashable, float], own: float | None = 1.0) -> list[tuple[Hashable, float]]:
        """Take one round's cosines, and our own contribution's; returns the senders judged now,
        with their mean (they are forgotten: a ban takes over). A round in which our own
        contribution did not lower the loss either (cosine under ``INFORMATIVE``) is not counted:
        near a minimum of the swarm's loss, honest senders of skewed data pull every way around
        it, and so do we. Our own, not the aggregate's: attackers that turn the aggregate would
        otherwise leave every round they win uncounted."""
        if own is None or own < self.informative:
            return []
        judged = []
        for sender, cosine in cosines.items():
            if not math.isfinite(cosine):  # (says nothing, and would stick to the mean)
                continue
            mean, rounds, spread = self._scores.pop(sender, (0.0, 0, 0.0))
            rounds += 1
            step = (cosine - mean) / min(rounds, self.memory_rounds)
            if rounds <= self._plain_until:  # (Welford's update)
                spread += (cosine - mean) * (cosine - mean - step)
            mean += step
            if self._below_the_line(mean, rounds, spread):
                judged.append((sender, mean))
                continue
            self._scores[sender] = (mean, rounds, spread)
            while len(self._scores) > self.max_tracked:
                self._scores.popitem(last=False)
        return judged

    def _below_the_line(self, mean: float, rounds: int, spread: float) -> bool:
        if mean >= self.ban_below:
            return False
        if rounds >= self.min_rounds:
            return True
        if not self.early_rounds <= rounds <= self._plain_until:
            return False
        standard_error = math.sqrt(spread / (rounds - 1) / rounds)
        return mean + self.early_margin * standard_error < self.ban_below

    def score(self, sender: Hashable) -> tuple[float, int] | None:
        """(running mean cosine, rounds scored) of ``sender``, if tracked."""
        found = self._scores.get(sender)
        return None if found is None else found[:2]

    def __len__(self) -> int:
        return len(self._scores)
