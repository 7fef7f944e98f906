"""The updates that ``benchmarks/byzantine.py``'s quiet attackers send are the ones their papers
define (ALIE, IPM, sign flip, label flip, min-max / min-sum), and its label-skewed shards split the
training data."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.byzantine_cases.attacks import (
    MIN_MAX,
    MIN_SUM,
    QUIET,
    alie,
    alie_z_max,
    fits,
    flip_labels,
    ipm,
    largest_gamma,
    min_max,
    min_sum,
    sign_flip,
)
from benchmarks.byzantine_cases.shards import MIN_SHARD, dirichlet_split

# three honest updates of two coordinates: mean (3, 10), standard deviation (2, 4)
HONEST = torch.tensor([[1.0, 10.0], [3.0, 14.0], [5.0, 6.0]])


def spread_honest(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(7, 40, generator=generator) * torch.linspace(0.1, 2.0, 40) + 0.5


def test_alie_sends_the_mean_minus_z_standard_deviations():
    assert torch.equal(alie(HONEST, 1.5), torch.tensor([0.0, 4.0]))
    assert torch.equal(alie(HONEST, 0.0), torch.tensor([3.0, 10.0]))


def test_alie_z_max_is_baruch_et_al_formula():
    # s = floor(n/2 + 1) - f honest peers to win over; z = Phi^-1((n - s) / n)
    assert alie_z_max(8, 1) == 0.0  # s = 4: half the peers
    assert alie_z_max(8, 2) == pytest.approx(0.318639, abs=1e-6)  # s = 3: Phi^-1(5/8)
    assert alie_z_max(16, 3) == pytest.approx(0.318639, abs=1e-6)  # s = 6: Phi^-1(10/16)
    assert alie_z_max(50, 24) == pytest.approx(1.750686, abs=1e-6)  # s = 2: Phi^-1(0.96)
    with pytest.raises(ValueError):
        alie_z_max(4, 3)  # s = 0: the attackers are a majority, no z to find


def test_ipm_sends_minus_eps_times_the_honest_mean():
    assert torch.equal(ipm(HONEST, 4.0), torch.tensor([-12.0, -40.0]))
    assert torch.equal(ipm(HONEST, 0.5), torch.tensor([-1.5, -5.0]))


def test_sign_flip_negates_its_own_update_and_label_flip_maps_y_to_9_minus_y():
    own = torch.tensor([0.5, -2.0])
    assert torch.equal(sign_flip(own), torch.tensor([-0.5, 2.0]))
    assert torch.equal(flip_labels(torch.tensor([0, 3, 9])), torch.tensor([9, 6, 0]))
    honest_update = QUIET["label-flip"].update(own, HONEST, 4, 1)
    assert torch.equal(honest_update, own) and QUIET["label-flip"].flips_labels


def test_the_bisection_finds_the_largest_gamma_that_fits():
    assert largest_gamma(lambda gamma: gamma <= 3.7) == pytest.approx(3.7, rel=1e-5)
    assert largest_gamma(lambda gamma: gamma <= 0.01) == pytest.approx(0.01, rel=1e-5)


@pytest.mark.parametrize("direction", ["std", "unit"])
def test_min_max_goes_as_far_along_p_as_the_honest_max_distance_allows(direction):
    honest = spread_honest(1)
    mu, sigma = honest.mean(dim=0), honest.std(dim=0)
    p = -sigma if direction == "std" else -mu / mu.norm()
    update = min_max(honest, direction)
    gamma = float((update - mu) @ p / (p @ p))
    assert gamma > 0
    assert torch.allclose(update, mu + gamma * p, atol=1e-5)  # along p, nothing else
    pairwise = torch.cdist(honest.double(), honest.double()) ** 2
    farthest = ((honest.double() - update.double()) ** 2).sum(dim=1).max()
    assert farthest <= pairwise.max() * (1 + 1e-6)  # within the honest max squared distance
    assert not fits(honest, mu + gamma * 1.001 * p, MIN_MAX)  # and no farther along p would be


@pytest.mark.parametrize("direction", ["std", "unit"])
def test_min_sum_gamma_is_where_the_summed_distance_meets_the_honest_bound(direction):
    honest = spread_honest(2)
    n, mu, sigma = len(honest), honest.mean(dim=0), honest.std(dim=0)
    p = -sigma if direction == "std" else -mu / mu.norm()
    update = min_sum(honest, direction)
    # sum_i ||mu + gamma p - g_i||^2 = sum_i ||mu - g_i||^2 + n gamma^2 ||p||^2 (the cross term
    # vanishes about the mean), so gamma has a closed form to check the bisection against
    bound = ((honest[:, None, :] - honest[None, :, :]) ** 2).sum(dim=2).sum(dim=1).max()
    spread = ((honest - mu) ** 2).sum()
    gamma = math.sqrt(float(bound - spread) / (n * float(p @ p)))
    assert torch.allclose(update, mu + gamma * p, rtol=1e-4, atol=1e-5)
    assert fits(honest, update, MIN_SUM) and not fits(honest, mu + gamma * 1.001 * p, MIN_SUM)


def test_the_label_skewed_split_shares_out_every_image_once_and_skews_the_mix():
    labels = torch.arange(1000) % 10
    shards = dirichlet_split(labels, 8, seed=3)
    joined = torch.cat(shards).sort().values
    assert torch.equal(joined, torch.arange(1000))  # every item, in exactly one shard
    assert min(len(shard) for shard in shards) >= MIN_SHARD
    assert all(torch.equal(a, b) for a, b in zip(shards, dirichlet_split(labels, 8, seed=3), strict=True))
    # iid shards would hold about 10% of each class; Dirichlet(0.5) gives most peers a dominant one
    top_share = [torch.bincount(labels[shard], minlength=10).max() / len(shard) for shard in shards]
    assert sum(share > 0.25 for share in top_share) >= 4
