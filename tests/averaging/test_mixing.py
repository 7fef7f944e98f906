"""Nearest-neighbour mixing before CenteredClip (``averaging/mixing.py``): the sets a reducer
mixes, how far a checker lets them differ from its own, and a mixed part's answer judged as
checkers judge it: an honest one holds, a reducer that mixes other rows, does not mix, or answers
by another rule than the round's is named."""

from __future__ import annotations

import pytest
import torch
import trio

from averaging.averager import GroupAverager
from averaging.local_updates import LocalUpdatesOptimizer
from averaging.mixing import TIE_TOLERANCE, distances, mix, mixed_count, nearest_sets, sets_hold, tau_floor
from averaging.reduction import ShardReduction
from averaging.robust import Aggregation, centered_clip, clip_weights
from averaging.settings import LOCAL_UPDATES
from averaging.verification import PartCheck, PartInputs
from tests.averaging.test_verification import GROUP, ids, signed_rows
from tests.daemon.test_training import open_swarm

DIM = 64
MIXED = Aggregation.CENTERED_CLIP_MIXED


def test_each_row_mixes_with_its_nearest_rows_itself_first() -> None:
    # k = n - (ceil(n / 2) - 1): each mixed row holds at most as many hostile rows as CenteredClip tolerates
    assert [mixed_count(n) for n in (2, 3, 4, 5, 8, 16)] == [2, 2, 3, 3, 5, 9]
    values = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [10.0, 10.0], [10.0, 11.0]])
    between = distances(values)
    sets = nearest_sets(between)
    assert sets == [[0, 1, 2], [1, 0, 2], [2, 0, 1], [3, 4, 2], [4, 3, 2]]
    mixed = mix(values, sets)
    torch.testing.assert_close(mixed[3], values[[3, 4, 2]].mean(dim=0))
    assert sets_hold(between, sets) is None
    # (float64 distances: a hostile row of huge finite values does not make every set acceptable)
    huge = torch.cat([values, torch.full((1, 2), 3e38)])
    assert sets_hold(distances(huge), [[0, 5, 4], *nearest_sets(distances(huge))[1:]]) is not None


def test_a_checker_takes_nearest_sets_up_to_near_ties_and_nothing_else() -> None:
    # row 0 at the origin; rows 2 and 3 both about 2 from it, 3 farther by a share x; k = 3
    for x, holds in ((0.5 * TIE_TOLERANCE, True), (3 * TIE_TOLERANCE, False), (1e-2, False)):
        values = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.0, -2.0 * (1 + x)], [9.0, 9.0]])
        between = distances(values)
        sets = nearest_sets(between)
        assert sets[0] == [0, 1, 2]
        assert (sets_hold(between, [[0, 1, 3], *sets[1:]]) is None) is holds, x
    # rows tied at the bound may be swapped, the nearest row may not be left out for them
    tied = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 5.0], [0.0, -5.0]])
    between = distances(tied)
    assert sets_hold(between, [[0, 1, 3], *nearest_sets(between)[1:]]) is None
    assert sets_hold(between, [[0, 2, 3], *nearest_sets(between)[1:]]) is not None
    sets = nearest_sets(between)
    for bad in (None, sets[:-1], [[1, 0, 2], *sets[1:]], [[0, 1, 1], *sets[1:]], [[0, 1, "2"], *sets[1:]]):
        assert sets_hold(between, bad) is not None, bad
    assert sets_hold(between, [[0, True, 3], *sets[1:]]) is not None  # (a bool is no index)


def answer(peers, values, rule=MIXED, reducer_contributes=False):
    """What an honest reducer (``peers[0]``) of ``rule`` answers for one part: its reply and the
    inputs it keeps for checks, as the reduction keeps them."""
    reduction = ShardReduction([values.shape[1]], list(peers), aggregation=rule, keep_inputs=True)
    for peer, row in zip(peers, values, strict=True):
        if reducer_contributes and peer == peers[0]:
            reduction.add_local(peer, row.clone(), 1.0)
        else:
            reduction.set_weight(peer, 1.0)
            reduction.add_part(peer, 0, row.clone())
    reply = reduction.outcome().averaged.clone()
    senders, raw, kept, start, _, sets = reduction.kept_inputs[0]
    signed = signed_rows(list(senders), raw, kept)
    inputs = PartInputs(list(senders), raw, kept, reduction.part_taus[0], rule, start, signed, sets)
    body, payload = inputs.to_message()
    return PartInputs.parse(body, bytes(payload), values.shape[1], 16), reply


def quiet_attack(dim: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Six honest rows spread widely around their mean, and two quiet attackers at -4x it."""
    generator = torch.Generator().manual_seed(seed)
    mu = torch.randn(dim, generator=generator)
    honest = torch.stack([mu + 2 * torch.randn(dim, generator=generator) for _ in range(6)])
    return torch.cat([honest, torch.stack([-4 * mu] * 2)]), honest


def check(peers, values, me, reply, rule=MIXED) -> PartCheck:
    return PartCheck(peers[me], peers[0], values[me].clone(), 1.0, list(peers), reply, None, GROUP, 0, aggregation=rule)


def test_a_mixed_answer_holds_and_a_reducer_that_mixes_otherwise_is_named() -> None:
    peers = ids(8)
    values, honest = quiet_attack(DIM)
    inputs, reply = answer(peers, values)
    assert inputs.neighbours is not None and len(inputs.neighbours) == 8
    assert check(peers, values, 3, reply).verdict(inputs) is None
    # mixing narrows the honest spread the attackers hide in: the answer is nearer the honest mean
    plain_inputs, plain = answer(peers, values, Aggregation.CENTERED_CLIP)
    honest_mean = honest.mean(dim=0)
    assert (reply - honest_mean).norm() < (plain - honest_mean).norm()
    # a reducer that mixes rows of its choice: named even with the reply those sets give
    chosen = [[row, *[j for j in range(7, -1, -1) if j != row][:4]] for row in range(8)]
    rows = mix(values, chosen)
    other_reply = torch.empty(DIM)
    centered_clip(list(rows.unbind(0)), clip_weights([1.0] * 8), other_reply, center=rows[0])
    fields = [getattr(inputs, f) for f in ("senders", "weights", "values", "tau", "aggregation", "start", "signed")]
    assert "nearest" in (check(peers, values, 3, other_reply).verdict(PartInputs(*fields, chosen)) or "")
    # a reducer that states the nearest sets and answers with plain CenteredClip
    assert "away from the aggregate" in (check(peers, values, 3, plain).verdict(inputs) or "")
    # sets stated for a part answered as plain CenteredClip
    unmixed = PartInputs(*fields[:4], Aggregation.CENTERED_CLIP, inputs.start, inputs.signed, inputs.neighbours)
    assert "did not mix" in (check(peers, values, 3, plain, Aggregation.CENTERED_CLIP).verdict(unmixed) or "")


def test_a_reducer_that_answers_by_another_rule_than_the_rounds_is_named() -> None:
    """Either robust rule holds by itself; a liar may not pick the weaker one for its shard."""
    peers = ids(8)
    values, _ = quiet_attack(DIM)
    mixed_inputs, mixed_reply = answer(peers, values)
    plain_inputs, plain_reply = answer(peers, values, Aggregation.CENTERED_CLIP)
    assert check(peers, values, 3, plain_reply, Aggregation.CENTERED_CLIP).verdict(plain_inputs) is None
    assert "not the round's" in (check(peers, values, 3, plain_reply).verdict(plain_inputs) or "")
    assert "not the round's" in (
        check(peers, values, 3, mixed_reply, Aggregation.CENTERED_CLIP).verdict(mixed_inputs) or ""
    )


@pytest.mark.parametrize("dim", [64, 1 << 16])  # radii from the Gram matrix, and from passes over the rows
@pytest.mark.parametrize("attacker_reduces", [False, True])
def test_a_mixing_reducer_that_contributes_starts_as_every_checker_recomputes(dim, attacker_reduces) -> None:
    """The reducer's own mixed row is its start unless another is closer-knit (a quiet attacker's
    own, at -4x the mean, is not): every sender's check recomputes the same start and radius."""
    peers = ids(8)
    values, _ = quiet_attack(dim, seed=5)
    if attacker_reduces:
        values = values.roll(2, 0)  # the reducer (row 0) is one of the attackers
    inputs, reply = answer(peers, values, reducer_contributes=True)
    assert inputs.start is not None and inputs.neighbours is not None
    for me in range(1, 8):
        assert check(peers, values, me, reply).verdict(inputs) is None, me


@pytest.mark.parametrize("n", [3, 4, 5])
def test_in_small_groups_mixed_rows_that_coincide_do_not_shut_out_the_other_contributions(n) -> None:
    """With three members the closest pair mix to one row: a radius from the mixed rows alone
    would be 0 and the result that pair's mean, whatever the third sent. The radius is at least
    the raw spread over sqrt(k), so every honest contribution counts."""
    peers = ids(n)
    generator = torch.Generator().manual_seed(n)
    values = torch.randn(n, DIM, generator=generator)
    inputs, reply = answer(peers, values)
    between = distances(values)
    assert inputs.tau >= tau_floor(between) > 0
    pair_means = [values[s].mean(dim=0) for s in nearest_sets(between)]
    assert all(not torch.allclose(reply, mean) for mean in pair_means)
    assert (reply - values.mean(dim=0)).norm() < min((reply - mean).norm() for mean in pair_means)
    assert check(peers, values, 1, reply).verdict(inputs) is None


def test_a_sender_equal_to_the_reducers_own_on_a_sample_cannot_get_it_accused() -> None:
    """Checkers bound the start by exact radii; a start chosen from a sample of coordinates (as
    plain CenteredClip chooses on large parts) kept the reducer's own, at radius 0 on the sample,
    while the pair it is not in mixes to one row of exact radius 0: the check failed it."""
    generator = torch.Generator().manual_seed(0)
    size = 1 << 17  # past the Gram path's limit, and sampled for radii
    peers = ids(3)
    own, honest = torch.randn(size, generator=generator), torch.randn(size, generator=generator)
    framer = own.clone()
    framer[1::2] = own[1::2] + 1.5 * (honest[1::2] - own[1::2])  # ours on the even coordinates only
    values = torch.stack([own, honest, framer])
    inputs, reply = answer(peers, values, reducer_contributes=True)
    assert check(peers, values, 1, reply).verdict(inputs) is None


def test_a_group_of_two_is_not_mixed_into_one_mean() -> None:
    """Mixing both rows of two would make them one: they are aggregated as plain CenteredClip does
    (a group too small to outvote a liar is bounded by the members' own history: ``own_radius.py``)."""
    peers = ids(2)
    values = torch.stack([torch.ones(DIM), torch.full((DIM,), 5.0)])
    inputs, reply = answer(peers, values)
    assert inputs.neighbours is None
    plain = torch.empty(DIM)
    centered_clip(list(values.unbind(0)), [1.0, 1.0], plain, center=values[0])
    torch.testing.assert_close(reply, plain)


async def test_local_updates_mix_only_when_asked() -> None:
    """Mixing is a rule a swarm asks for (it did not hold its worst case better on skewed shards,
    see ``mixing.py``): ``auto`` stays centered-clip in a public swarm."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        params = [torch.nn.Parameter(torch.zeros(3))]
        assert not node.host.access.private
        plain = LocalUpdatesOptimizer(torch.optim.SGD(params, lr=0.1), node, prefix="auto", local_steps=2)
        assert [f.averager.settings.rounds.aggregation for f in plain.fragments] == [Aggregation.CENTERED_CLIP]
        settings = LOCAL_UPDATES.replace(aggregation="centered-clip-mixed")
        mixed = LocalUpdatesOptimizer(
            torch.optim.SGD(params, lr=0.1), node, prefix="mixed", local_steps=2, settings=settings
        )
        assert [f.averager.settings.rounds.aggregation for f in mixed.fragments] == [MIXED]
        nursery.cancel_scope.cancel()


async def test_peers_that_chose_different_rules_declare_different_schemas() -> None:
    """Each peer checks by its own rule, so peers of different rules would take each other's
    reducers for liars: matchmaking never groups them (the schema is part of what it matches)."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        tensors = [torch.zeros(3)]
        schemas = {
            rule: GroupAverager(tensors, node, prefix=f"rules-{index}", aggregation=rule).schema
            for index, rule in enumerate(["auto", "centered-clip", "centered-clip-mixed", "mean"])
        }
        assert schemas["auto"] == schemas["centered-clip"]  # (a public swarm)
        assert len({schemas["centered-clip"], schemas["centered-clip-mixed"], schemas["mean"]}) == 3
        nursery.cancel_scope.cancel()
