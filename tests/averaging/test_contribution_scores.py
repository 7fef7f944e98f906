"""Contributions scored against a held-out loss (``averaging/contribution_scores.py``): the sans-I/O
arithmetic and verdicts, then real rounds where a reducer given a reference bans a sender whose
contributions keep pulling against it, and bans nobody in a swarm whose senders help."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
import trio

from averaging.averager import GroupAverager
from averaging.contribution_scores import (
    BAN_BELOW,
    EARLY_MARGIN,
    EARLY_ROUNDS,
    MEMORY_ROUNDS,
    MIN_ROUNDS,
    ContributionScores,
    ShardAlignment,
)
from averaging.robust import Aggregation
from tests.averaging.test_allreduce import make_group, run_round, start_peers
from tests.averaging.test_matchmaking import open_swarm, step_all


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_a_shards_cosine_is_its_parts_weighted_by_the_reference_and_leaves_our_own_out():
    torch.manual_seed(0)
    reference = torch.randn(100)
    senders = {name: torch.randn(100) for name in ("a", "b", "me")}
    bounds = [(0, 30), (30, 70), (70, 100)]
    alignment = ShardAlignment(reference, [0, 30, 70], own="me")
    for index, (start, end) in enumerate(bounds):
        alignment.add_part(index, {name: values[start:end] for name, values in senders.items()})
    found = alignment.cosines()
    assert set(found) == {"a", "b"}
    for name in ("a", "b"):
        weights = [float(reference[a:b].square().sum()) for a, b in bounds]
        parts = [cosine(reference[a:b], senders[name][a:b]) for a, b in bounds]
        expected = sum(w * c for w, c in zip(weights, parts, strict=True)) / sum(weights)
        assert found[name] == pytest.approx(expected, abs=1e-5)


def test_a_sender_in_some_parts_only_is_scored_on_those():
    """A sender dropped midway is in the parts before: its cosine is over those, against the same
    parts of the reference, not diluted by parts it never sent."""
    reference = torch.tensor([1.0, 0.0, 0.0, 1.0])
    alignment = ShardAlignment(reference, [0, 2])
    alignment.add_part(0, {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0, 0.0])})
    alignment.add_part(1, {"b": torch.tensor([0.0, -1.0])})
    found = alignment.cosines()
    assert found["b"] == pytest.approx(0.0, abs=1e-6)  # +1 in one part, -1 in the other
    assert found["a"] == pytest.approx(1.0)


def test_one_huge_value_hides_nothing_of_the_other_parts():
    """An attacker pulling against the loss in every part, with one value near float32's limit
    in one of them: that part's cosine goes to ~0, the others keep theirs, nothing overflows."""
    torch.manual_seed(0)
    reference = torch.randn(4000)
    attack = -reference.clone()
    attack[5] = 1e20  # finite: contributions pass, CenteredClip clips its part alone
    alignment = ShardAlignment(reference, [0, 1000, 2000, 3000])
    for index in range(4):
        alignment.add_part(index, {"liar": attack[index * 1000 : (index + 1) * 1000]})
    assert alignment.cosines()["liar"] < -0.7


def test_a_sparse_contribution_is_compared_on_the_values_it_sent():
    """Top-k of every 64: a sparse contribution pointing straight against the loss scores -1, as a
    dense one would (over the whole part its cosine could never go below -0.13)."""
    torch.manual_seed(0)
    reference = torch.randn(4096)
    kept = torch.zeros(4096)
    chosen = reference.abs().topk(64).indices
    kept[chosen] = -reference[chosen]
    alignment = ShardAlignment(reference, [0])
    alignment.add_part(0, {"sparse": kept})
    assert alignment.cosines()["sparse"] == pytest.approx(-1.0, abs=1e-5)


def test_our_own_contribution_is_scored_apart_from_the_senders():
    reference = torch.tensor([1.0, 1.0])
    alignment = ShardAlignment(reference, [0], own="me")
    alignment.add_part(0, {"a": torch.tensor([1.0, 0.0]), "me": torch.tensor([-1.0, -1.0])})
    assert set(alignment.cosines()) == {"a"}
    assert alignment.own_cosine() == pytest.approx(-1.0)
    assert ShardAlignment(reference, [0]).own_cosine() is None  # we sent nothing


def test_rounds_in_which_our_own_contribution_did_not_lower_the_loss_are_not_counted():
    """Near a minimum of the swarm's loss honest senders of skewed data pull every way around it,
    and so do we: such rounds say nothing about anyone."""
    scores = ContributionScores()
    for _ in range(5 * MIN_ROUNDS):
        assert scores.observe({"skewed": -0.6}, own=-0.05) == []
        assert scores.observe({"skewed": -0.6}, own=None) == []
    assert scores.score("skewed") is None
    assert scores.observe({"skewed": -0.6}, own=0.3) == []
    assert scores.score("skewed") == (pytest.approx(-0.6), 1)


def test_a_zero_reference_or_contribution_scores_nobody():
    alignment = ShardAlignment(torch.zeros(4), [0])
    alignment.add_part(0, {"a": torch.ones(4)})
    assert alignment.cosines() == {}
    alignment = ShardAlignment(torch.ones(4), [0])
    alignment.add_part(0, {"a": torch.zeros(4)})
    assert alignment.cosines() == {}


def test_a_sender_that_keeps_raising_the_loss_is_judged_after_early_rounds_and_forgotten():
    scores = ContributionScores()
    for _ in range(EARLY_ROUNDS - 1):
        assert scores.observe({"liar": -0.6, "honest": 0.2}) == []
    [(judged, mean)] = scores.observe({"liar": -0.6, "honest": 0.2})
    assert judged == "liar" and mean == pytest.approx(-0.6)
    assert scores.score("liar") is None  # the ban takes over
    assert scores.score("honest") == (pytest.approx(0.2), EARLY_ROUNDS)


def test_a_mean_below_the_line_from_scattered_rounds_waits_for_more_rounds():
    """Five rounds averaging -0.46 but scattered (three at -1, two above zero) are not yet clear
    evidence; rounds that hold that mean make it clear, by ``MIN_ROUNDS`` at the latest."""
    scattered = [-1.0, -1.0, -1.0, 0.5, 0.2]
    scores = ContributionScores()
    for cosine in scattered:
        assert scores.observe({"unsure": cosine}) == []
    assert scores.score("unsure") == (pytest.approx(-0.46), EARLY_ROUNDS)
    rounds = EARLY_ROUNDS
    while not scores.observe({"unsure": -0.46}):
        rounds += 1
    assert EARLY_ROUNDS < rounds <= MIN_ROUNDS


def test_a_sender_is_judged_early_once_its_mean_is_a_standard_error_below_the_line():
    """Rounds that scatter around -0.55 put the mean below the line at once, but clear of it by a
    standard error (``EARLY_MARGIN`` of them) only as they add up."""
    cosines = [-0.9, -0.2, -0.9, -0.2, -0.5, -0.55, -0.55, -0.55, -0.55]
    expected = next(
        n
        for n in range(EARLY_ROUNDS, len(cosines) + 1)
        if statistics.fmean(cosines[:n]) + EARLY_MARGIN * statistics.stdev(cosines[:n]) / n**0.5 < BAN_BELOW
    )
    assert EARLY_ROUNDS < expected < MIN_ROUNDS  # (the case tests the margin, not either end)
    scores = ContributionScores()
    judged_at = next(n for n, cosine in enumerate(cosines, 1) if scores.observe({"liar": cosine}))
    assert judged_at == expected


def test_the_early_rule_needs_a_plain_mean():
    """A mean that weighs only the last few rounds (``memory_rounds`` under ``min_rounds``) has no
    standard error of its rounds: a sender that turns is judged by ``min_rounds`` alone."""
    scores = ContributionScores(memory_rounds=3)
    cosines = [0.2] * 3 + [-0.8] * 9
    judged_at = next(n for n, cosine in enumerate(cosines, 1) if scores.observe({"turns": cosine}))
    assert judged_at == MIN_ROUNDS


def test_a_nan_cosine_is_not_counted():
    scores = ContributionScores()
    assert scores.observe({"odd": math.nan}) == []
    assert scores.score("odd") is None
    for _ in range(EARLY_ROUNDS - 1):
        assert scores.observe({"odd": -0.6}) == []
    assert [sender for sender, _ in scores.observe({"odd": -0.6})] == ["odd"]


def test_the_early_rule_needs_two_rounds_for_a_spread():
    with pytest.raises(ValueError, match="early_rounds"):
        ContributionScores(early_rounds=1)


def test_noisy_honest_cosines_are_never_judged():
    """Honest cosines on skewed data are noisy and sometimes negative for a while; their mean is
    what counts, and it stays far above the line."""
    rng = random.Random(1)
    scores = ContributionScores()
    for _ in range(500):
        assert scores.observe({peer: rng.gauss(0.05, 0.35) for peer in range(8)}) == []


def test_a_sender_that_turns_is_judged_within_memory():
    """Good behaviour does not buy a long run of bad: the mean weighs recent rounds (a mean over
    all of them would take ~800 rounds of -0.9 to fall below the line after 1,000 of 0.5)."""
    scores = ContributionScores()
    for _ in range(1000):
        assert scores.observe({"turncoat": 0.5}) == []
    rounds = next(n for n in range(1, 100) if scores.observe({"turncoat": -0.9}))
    assert rounds <= 2 * MEMORY_ROUNDS


def test_tracked_senders_are_bounded():
    scores = ContributionScores(max_tracked=10)
    for peer in range(100):
        scores.observe({peer: 0.1})
    assert len(scores) == 10
    assert scores.score(99) is not None and scores.score(0) is None


@pytest.mark.parametrize("aggregation", [Aggregation.MEAN, Aggregation.CENTERED_CLIP])
async def test_a_reducer_with_a_reference_bans_a_sender_that_pulls_against_it(aggregation):
    """Four peers average vectors near the reference's direction, but one sends minus the honest
    mean (inner-product manipulation): every honest reducer that scores it sees a negative cosine
    each round, and within ``MIN_ROUNDS`` rounds has banned it for that; nobody else is banned for
    their contributions. (Generous deadlines: four peers on a loaded 2-core machine can miss the
    default ones, and a sender dropped for lateness is a matter for the reducer checks.)"""
    torch.manual_seed(0)
    size, attacker = 4, 3
    reference = torch.randn(4000)
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, size)
        for _ in range(MIN_ROUNDS):
            group = make_group(peers)  # a new group ID each round
            honest = [reference + 2.0 * torch.randn(4000) for _ in range(size - 1)]
            tensors = [[h.clone()] for h in honest] + [[-4.0 * torch.stack(honest).mean(0)]]
            results = {}
            references = {i: [reference] for i in range(size) if i != attacker}
            options = {"aggregation": aggregation, "sender_timeout": 10.0, "reducer_timeout": 20.0}
            await run_round(peers, group, tensors, [1.0] * size, results, reference_of=references, **options)
        for i in range(size - 1):
            cosines = results[i].alignment
            assert cosines[peers[attacker].host.peer_id] < BAN_BELOW
            assert all(cosines[peers[j].host.peer_id] > 0 for j in range(size - 1) if j != i)
            reasons = peers[i].service.checks.banned.reasons
            assert "held-out loss" in reasons.get(peers[attacker].host.peer_id, "")
            assert not any("held-out loss" in reasons.get(peers[j].host.peer_id, "") for j in range(size - 1))
        assert not results[attacker].alignment  # given no reference, it scores nobody
        nursery.cancel_scope.cancel()


async def test_a_reference_of_the_wrong_size_is_refused():
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 2)
        group = make_group(peers)
        with pytest.raises(ValueError, match="reference holds 3 values"):
            await peers[0].service.run(group, [torch.zeros(10)], reference=[torch.zeros(3)])
        nursery.cancel_scope.cancel()


async def test_a_reference_that_fails_costs_the_scoring_not_the_round(caplog):
    """The held-out gradient is the task's code (out of memory, a frozen parameter ...): when it
    raises, that round scores nobody and averages as ever."""

    def broken():
        raise RuntimeError("CUDA out of memory")

    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        tensors = [[torch.full((8,), float(i))] for i in range(2)]
        averagers = [
            GroupAverager(t, node, prefix="scored", target_group_size=2, aggregation="mean", reference=broken)
            for t, node in zip(tensors, nodes, strict=True)
        ]
        results = await step_all(averagers, timeout=10.0)
        assert all(result.result.succeeded for result in results.values())
        assert all(torch.allclose(t[0], torch.full((8,), 0.5)) for t in tensors)
        assert all(not result.result.alignment for result in results.values())
        assert "contributions not scored" in caplog.text
        nursery.cancel_scope.cancel()


def test_a_reference_that_is_not_finite_scores_nobody():
    """A task whose held-out loss diverged gives a NaN gradient: no sender is scored on it."""
    alignment = ShardAlignment(torch.tensor([float("nan"), 1.0]), [0], own="me")
    alignment.add_part(0, {"a": torch.tensor([1.0, 1.0]), "me": torch.tensor([1.0, 1.0])})
    assert alignment.cosines() == {} and alignment.own_cosine() is None
