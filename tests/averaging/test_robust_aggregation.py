"""Robust aggregation: one hostile sender with a huge contribution or a huge claimed weight moves
a centered-clip reducer's average by a bounded amount, where it sets the plain mean."""

from __future__ import annotations

import torch
import trio

from averaging.reduction import ShardReduction
from averaging.robust import Aggregation, centered_clip, clip_weights, resolve_aggregation
from tests.averaging.test_allreduce import flat, make_group, random_tensors, run_round, start_peers

DIM = 4096


def honest_cloud(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    center = torch.randn(DIM, generator=generator) * 10
    return [center + torch.randn(DIM, generator=generator) for _ in range(count)]


def spread(points: list[torch.Tensor]) -> float:
    """The farthest honest point's distance from the honest mean."""
    mean = torch.stack(points).mean(0)
    return max(float((p - mean).norm()) for p in points)


def test_clean_contributions_give_the_mean():
    points = honest_cloud(8)
    out = torch.empty(DIM)
    assert centered_clip(points, [1.0] * 8, out, center=points[0])[1] is None  # from our own
    assert torch.allclose(out, torch.stack(points).mean(0), atol=1e-3)


def test_huge_contributions_move_the_result_by_a_bounded_amount():
    honest = honest_cloud(6)
    mean, bound = torch.stack(honest).mean(0), spread(honest)
    for hostile in (torch.full((DIM,), 1e30), torch.full((DIM,), -3e38), honest[1] * -1e6):
        for attackers in (1, 2, 3):
            points = honest + [hostile] * attackers
            out = torch.empty(DIM)
            centered_clip(points, [1.0] * len(points), out, center=honest[0])
            assert torch.isfinite(out).all()
            assert float((out - mean).norm()) < bound, (attackers, float((out - mean).norm()), bound)
            # a reducer whose own contribution is the hostile one starts from an honest one
            _tau, moved_to = centered_clip(points, [1.0] * len(points), out, center=hostile)
            assert moved_to is not None and moved_to < len(honest)
            assert float((out - mean).norm()) < bound, (attackers, float((out - mean).norm()), bound)
            # a reducer that sends nothing starts from the coordinate-wise median instead
            centered_clip(points, [1.0] * len(points), out)
            assert float((out - mean).norm()) < bound


def inner_product_attack(seed: int = 3) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """IPM (Xie et al. 2020) on a cloud whose spread is twice its mean's norm, as a gradient's
    noise is next to its mean: 6 honest points, 2 attackers at -4x the honest mean. Their radius
    (2.7x the honest spread) is no outlier's, yet it takes in every honest point."""
    generator = torch.Generator().manual_seed(seed)
    mu = torch.randn(DIM, generator=generator)
    mu *= 0.5 / mu.norm()
    honest = [mu + torch.randn(DIM, generator=generator) / DIM**0.5 for _ in range(6)]
    return mu, honest, -4 * mu


def test_a_quiet_attacker_that_reduces_starts_where_an_honest_reducer_does(monkeypatch):
    """A reducer's own contribution is no start: an IPM attacker that reduces honestly would start
    at -4x the mean, whose radius takes in every honest point, and its shard would be the mean,
    pulled past zero. Whoever reduces starts in the honest cloud, and the aggregate keeps the
    honest mean's direction (both the Gram iteration and the streamed one)."""
    import averaging.robust as robust

    mu, honest, hostile = inner_product_attack()
    points = honest + [hostile, hostile.clone()]
    assert float(torch.stack(points).mean(0) @ mu) < 0  # the mean is sign-flipped
    for limit in (0, len(points) * DIM):
        monkeypatch.setattr(robust, "GRAM_LIMIT", limit)
        by_honest, by_attacker = torch.empty(DIM), torch.empty(DIM)
        tau, _ = centered_clip(points, [1.0] * 8, by_honest, center=honest[0])
        attacker_tau, moved_to = centered_clip(points, [1.0] * 8, by_attacker, center=hostile)
        assert moved_to is not None and moved_to < len(honest)
        assert abs(attacker_tau - tau) <= 0.05 * tau
        for out in (by_honest, by_attacker):
            assert float(out @ mu) > 0.05 * float(mu @ mu)


def test_attackers_past_the_honest_spread_are_clipped_to_it(monkeypatch):
    """Two of eight attackers at twice the honest contributions' distance from their mean (ALIE
    with z = 2 in high dimensions, a sign flip) lie within the start's distance to the honest
    ones (sqrt 2 times that): a radius of the whole distance leaves them unclipped, and they
    pull as in the mean (f / n x 2 spreads = 0.5). The radius is the honest spread, so they pull
    by about f / n of it, while a clean group still gets its mean."""
    import averaging.robust as robust

    generator = torch.Generator().manual_seed(0)
    honest = honest_cloud(6)
    mean = torch.stack(honest).mean(0)
    spread_from_mean = sum(float((h - mean).norm()) for h in honest) / len(honest)
    away = torch.randn(DIM, generator=generator)
    away /= away.norm()
    hostile = mean - 2 * spread_from_mean * away
    for limit in (0, 8 * DIM):
        monkeypatch.setattr(robust, "GRAM_LIMIT", limit)
        out = torch.empty(DIM)
        centered_clip(honest + [hostile, hostile.clone()], [1.0] * 8, out, center=honest[0])
        assert float((mean - out) @ away) < 0.4 * spread_from_mean
        centered_clip(honest, [1.0] * 6, out, center=honest[0])
        assert float((out - mean).norm()) < 1e-3 * spread_from_mean


def test_claimed_weights_are_capped_at_twice_the_median():
    assert clip_weights([1.0, 2.0, 3.0, 2.0**40]) == [1.0, 2.0, 3.0, 4.0]
    assert clip_weights([0.0, 5.0]) == [0.0, 5.0]
    assert clip_weights([]) == []


def test_auto_is_robust_in_public_swarms_only():
    assert resolve_aggregation("auto", private=False) is Aggregation.CENTERED_CLIP
    assert resolve_aggregation("auto", private=True) is Aggregation.MEAN
    assert resolve_aggregation("mean", private=False) is Aggregation.MEAN


def reduce_shard(points: list[torch.Tensor], weights: list[float], aggregation: Aggregation) -> torch.Tensor:
    """One reducer (sender 0, its own contribution) over two parts of the shard."""
    sizes = [DIM // 2, DIM // 2]
    senders = list(range(len(points)))
    reduction = ShardReduction(sizes, senders, aggregation=aggregation)
    reduction.add_local(0, points[0], weights[0])
    for sender in senders[1:]:
        reduction.set_weight(sender, weights[sender])
        reduction.add_part(sender, 0, points[sender][: DIM // 2].clone())
        reduction.add_part(sender, 1, points[sender][DIM // 2 :].clone())
        reduction.finish_sender(sender)
    averaged = reduction.outcome().averaged
    assert averaged is not None
    return averaged


def test_a_reducer_bounds_a_1e30_contribution_and_a_2_to_the_40_weight():
    honest = honest_cloud(5)
    mean, bound = torch.stack(honest).mean(0), spread(honest)
    huge = honest + [torch.full((DIM,), 1e30)]
    far = honest + [mean + 100.0]
    heavy = [1.0] * 5 + [2.0**40]
    # the plain mean: either one sets the average
    assert float(reduce_shard(huge, [1.0] * 6, Aggregation.MEAN).min()) > 1e28
    assert torch.allclose(reduce_shard(far, heavy, Aggregation.MEAN), mean + 100.0, atol=1e-3)
    # centered-clip: neither moves it out of the honest cloud
    for points, weights in ((huge, [1.0] * 6), (far, heavy), (huge, heavy)):
        averaged = reduce_shard(points, weights, Aggregation.CENTERED_CLIP)
        assert float((averaged - mean).norm()) < bound


async def test_a_hostile_sender_does_not_steer_a_robust_all_reduce():
    """Five honest peers and one sending 1e30 with weight 2**40: every honest peer ends within
    the honest cloud (with the mean, at 1e30). (It reduces nothing here: what a lying reducer
    does is for the reducer checks to catch.)"""
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 6)
        group = make_group(peers, bandwidths=[1.0] * 5 + [0.0])
        tensors = [random_tensors(i) for i in range(6)]
        honest = [flat(t).clone() for t in tensors[:5]]
        mean, bound = torch.stack(honest).mean(0), spread(honest)
        for t in tensors[5]:
            t.fill_(1e30)
        results = {}
        await run_round(
            peers,
            group,
            tensors,
            [1.0] * 5 + [2.0**40],
            results,
            aggregation="centered-clip",
            sender_timeout=10.0,
            reducer_timeout=20.0,
        )
        for i in range(5):
            assert results[i].succeeded
            assert float((flat(tensors[i]) - mean).norm()) < bound
        nursery.cancel_scope.cancel()


def test_small_parts_iterate_on_their_gram_matrix_to_the_same_aggregate(monkeypatch):
    """The Gram-matrix iteration of small parts and the streamed one of large parts agree: on a
    clean cloud, with hostile 1e30 and float32-extreme values, from a start far out, from the
    median, and on identical contributions (a radius of 0)."""
    import averaging.robust as robust

    cloud = honest_cloud(7)
    far = [p.clone() for p in cloud]
    far[0] += 1000.0
    cases = [
        (cloud, [1.0] * 7, cloud[0]),
        (cloud + [torch.full((DIM,), 1e30)], [1.0] * 7 + [2.0], cloud[0]),
        (cloud + [torch.full((DIM,), 3e38), torch.full((DIM,), -3e38)], [1.0] * 9, cloud[0]),
        (far, [1.0] * 7, far[0]),
        (cloud, [1.0, 2.0, 1.0, 1.0, 0.5, 1.0, 1.0], None),
        ([cloud[0].clone() for _ in range(4)], [1.0] * 4, cloud[0]),
    ]
    for parts, weights, center in cases:
        results = []
        for limit in (0, len(parts) * DIM):
            monkeypatch.setattr(robust, "GRAM_LIMIT", limit)
            out = torch.empty(DIM)
            tau, moved_to = centered_clip(parts, weights, out, center=center)
            results.append((tau, moved_to, out))
        (tau, moved_to, streamed), (gram_tau, gram_moved_to, gram) = results
        if moved_to is None:
            assert gram_moved_to is None and abs(tau - gram_tau) <= 1e-5 * tau
            assert float((streamed - gram).norm()) <= 1e-4 * tau + 1e-6
        else:  # both moved to the honest contribution of least radius: near-ties may pick another
            assert gram_moved_to is not None and abs(tau - gram_tau) <= 0.05 * tau
            assert float((streamed - gram).norm()) <= 0.02 * tau
    assert results[0][0] == 0.0  # the identical contributions


async def test_a_robust_round_nobody_checks_signs_and_keeps_nothing(monkeypatch):
    """Commitments and kept inputs serve only the reducer checks: with the checks off a
    centered-clip round neither commits to its parts nor keeps a reducer's inputs, and still
    averages."""
    import averaging.reducer_checks

    def no_signing(*args, **kwargs):
        raise AssertionError("parts were committed to in a round nobody checks")

    monkeypatch.setattr(averaging.reducer_checks, "commit", no_signing)
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 4)
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(4)]
        results = {}
        await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", check_reducers=False)
        for i in range(4):
            assert results[i].succeeded and not results[i].reducer_checks
            assert len(peers[i].service.checks.kept) == 0
        assert all(torch.allclose(flat(t), flat(tensors[0])) for t in tensors)
        nursery.cancel_scope.cancel()


def test_weights_too_small_for_float32_still_give_the_weighted_mean():
    """Claims of 1e-300 (finite, positive, within bounds) underflow float32: the part's average
    must still be their weighted mean, never 0 / 0."""
    points = honest_cloud(3)
    for aggregation in (Aggregation.MEAN, Aggregation.CENTERED_CLIP):
        averaged = reduce_shard(points, [1e-300, 1e-300, 2e-300], aggregation)
        assert torch.isfinite(averaged).all(), aggregation
    expected = (points[0] + points[1] + 2 * points[2]) / 4
    assert torch.allclose(reduce_shard(points, [1e-300, 1e-300, 2e-300], Aggregation.MEAN), expected, atol=1e-5)
