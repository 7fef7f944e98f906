"""What each attacker sends, as the papers that evaluate robust aggregators define it.

Every function takes the round's honest updates as the rows of ``honest`` (the attackers are
omniscient about them, as in the papers: in process they read the honest peers' gradients or
pseudo-gradients of the round before they send) and returns the one update that every attacker
sends. Statistics are per coordinate: ``mu`` the mean of the rows, ``sigma`` their standard
deviation (``torch.std``'s, with Bessel's correction, as the reference implementations use).

* ALIE, "A Little Is Enough" (Baruch, Baruch, Goldberg 2019): ``mu - z * sigma``, with ``z`` from
  the paper's formula (``alie_z_max``: the largest z for which enough honest updates lie farther
  from the mean than the attackers' do) or fixed.
* IPM, inner-product manipulation (Xie, Koyejo, Gupta 2020): ``-eps * mu``.
* Sign flip: the attacker's own honest update, negated.
* Label flip: the attacker trains honestly on labels ``y -> 9 - y`` (``flip_labels``); its update
  is its own.
* Min-max and min-sum (Shejwalkar, Houmansadr 2021, "Manipulating the Byzantine"): ``mu + gamma *
  p`` with ``p = -unit(mu)`` or ``-sigma``, ``gamma`` the largest for which the update's largest
  (min-max) or summed (min-sum) squared distance to the honest updates stays within the largest
  such distance among the honest updates themselves; found by bisection (``largest_gamma``).

The loud attacks of part 1 (scaled, sign flipped x10, random noise, each with weight 2**40 and a
lying reducer) are kept beside them as ``LOUD``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import torch

__all__ = [
    "Attack",
    "LOUD",
    "QUIET",
    "alie",
    "alie_z_max",
    "fits",
    "flip_labels",
    "ipm",
    "largest_gamma",
    "min_max",
    "min_sum",
    "MIN_MAX",
    "MIN_SUM",
    "perturbation",
    "sign_flip",
]

CLASSES = 10  # digits: labels 0..9, flipped to 9 - y
# The bisection on gamma stops when the interval is this share of gamma (the paper's tau is an
# absolute 1e-5 on a gamma of order 1-10; relative works for both directions' scales).
GAMMA_TOLERANCE = 1e-6
GAMMA_CAP = 2.0**60  # doubling past this means p does not move the update (p == 0)


def honest_mean(honest: torch.Tensor) -> torch.Tensor:
    return honest.mean(dim=0)


def honest_std(honest: torch.Tensor) -> torch.Tensor:
    return honest.std(dim=0) if len(honest) > 1 else torch.zeros_like(honest[0])


def alie_z_max(n: int, f: int) -> float:
    """Baruch et al.'s z for n peers of which f attack: ``s = floor(n/2 + 1) - f`` honest peers
    must be won over, and z is where the normal CDF reaches ``(n - s) / n``."""
    s = math.floor(n / 2 + 1) - f
    if not 0 < s < n:
        raise ValueError(f"ALIE needs 0 < s < n, got s = {s} for n = {n}, f = {f}")
    return NormalDist().inv_cdf((n - s) / n)


def alie(honest: torch.Tensor, z: float) -> torch.Tensor:
    return honest_mean(honest) - z * honest_std(honest)


def ipm(honest: torch.Tensor, eps: float) -> torch.Tensor:
    return -eps * honest_mean(honest)


def sign_flip(own: torch.Tensor) -> torch.Tensor:
    return -own


def flip_labels(targets: torch.Tensor) -> torch.Tensor:
    return (CLASSES - 1) - targets


def perturbation(honest: torch.Tensor, direction: str) -> torch.Tensor:
    """Shejwalkar and Houmansadr's p: ``unit`` (-mu / ||mu||) or ``std`` (-sigma)."""
    if direction == "unit":
        mu = honest_mean(honest)
        norm = float(mu.norm())
        return -mu / norm if norm > 0 else torch.zeros_like(mu)
    if direction == "std":
        return -honest_std(honest)
    raise ValueError(f"unknown perturbation {direction!r}")


def squared_distances(rows: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    return ((rows - point) ** 2).sum(dim=1)


def pairwise_squared(honest: torch.Tensor) -> torch.Tensor:
    return torch.stack([squared_distances(honest, row) for row in honest])


def _largest(distances: torch.Tensor) -> float:
    return float(distances.max())


def _total(distances: torch.Tensor) -> float:
    return float(distances.sum())


# How far an update is from the honest ones, given its squared distances to each: min-max's
# measure is the largest, min-sum's the total.
Spread = Callable[[torch.Tensor], float]
MIN_MAX: Spread = _largest
MIN_SUM: Spread = _total


def honest_bound(honest: torch.Tensor, spread: Spread) -> float:
    """The largest spread of an honest update from the honest ones."""
    return max(spread(row) for row in pairwise_squared(honest))


def fits(honest: torch.Tensor, update: torch.Tensor, spread: Spread) -> bool:
    """Whether ``update`` is no farther from the honest updates than the farthest honest one."""
    return spread(squared_distances(honest, update)) <= honest_bound(honest, spread)


def largest_gamma(fits_gamma: Callable[[float], bool]) -> float:
    """The largest gamma >= 0 with ``fits_gamma(gamma)``, for a condition that holds on
    [0, gamma*] and fails beyond (both spreads are convex in gamma, and at gamma = 0, the mean,
    within the honest bound): double until it fails, then bisect."""
    low, high = 0.0, 1.0
    while fits_gamma(high):
        low, high = high, high * 2
        if high > GAMMA_CAP:
            return low
    while high - low > GAMMA_TOLERANCE * high:
        middle = (low + high) / 2
        low, high = (middle, high) if fits_gamma(middle) else (low, middle)
    return low


def adaptive(honest: torch.Tensor, direction: str, spread: Spread) -> torch.Tensor:
    """``mu + gamma * p`` with the largest gamma whose spread stays within the honest bound."""
    mu, p = honest_mean(honest), perturbation(honest, direction)
    if float(p.norm()) == 0:
        return mu
    bound = honest_bound(honest, spread)
    gamma = largest_gamma(lambda gamma: spread(squared_distances(honest, mu + gamma * p)) <= bound)
    return mu + gamma * p


def min_max(honest: torch.Tensor, direction: str = "std") -> torch.Tensor:
    return adaptive(honest, direction, MIN_MAX)


def min_sum(honest: torch.Tensor, direction: str = "std") -> torch.Tensor:
    return adaptive(honest, direction, MIN_SUM)


# An attack's update, from the attacker's own update, the honest ones (rows), n and f.
Update = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class Attack:
    """One attack of the catalogue. ``family``: ``model`` (model poisoning: the update is
    forged), ``label`` (data poisoning: honest training on flipped labels) or ``loud`` (part 1's
    attacks, with weight 2**40 and a lying reducer). Quiet attackers claim weight 1 and reduce
    honestly."""

    name: str
    family: str
    update: Update

    @property
    def loud(self) -> bool:
        return self.family == "loud"

    @property
    def flips_labels(self) -> bool:
        return self.family == "label"


def _noise(own: torch.Tensor, honest: torch.Tensor, n: int, f: int) -> torch.Tensor:
    noise = torch.randn(own.numel())
    return noise * (10 * float(own.norm()) / float(noise.norm()))


LOUD = (
    Attack("scaled", "loud", lambda own, honest, n, f: own * 1e4),
    Attack("sign-flipped", "loud", lambda own, honest, n, f: own * -10.0),
    Attack("random", "loud", _noise),
)

QUIET = {
    attack.name: attack
    for attack in (
        Attack("alie-zmax", "model", lambda own, honest, n, f: alie(honest, alie_z_max(n, f))),
        Attack("alie-z1", "model", lambda own, honest, n, f: alie(honest, 1.0)),
        Attack("alie-z2", "model", lambda own, honest, n, f: alie(honest, 2.0)),
        *(
            Attack(f"ipm-{eps:g}", "model", lambda own, honest, n, f, eps=eps: ipm(honest, eps))
            for eps in (0.1, 0.5, 4.0, 100.0)
        ),
        Attack("sign-flip", "model", lambda own, honest, n, f: sign_flip(own)),
        Attack("min-max-std", "model", lambda own, honest, n, f: min_max(honest, "std")),
        Attack("min-max-unit", "model", lambda own, honest, n, f: min_max(honest, "unit")),
        Attack("min-sum-std", "model", lambda own, honest, n, f: min_sum(honest, "std")),
        Attack("min-sum-unit", "model", lambda own, honest, n, f: min_sum(honest, "unit")),
        Attack("label-flip", "label", lambda own, honest, n, f: own),
    )
}
