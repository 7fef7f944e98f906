"""Nearest-neighbour mixing before CenteredClip (``averaging/mixing.py``): the sets a reducer
mixes, how far a checker lets them differ from its own, and a mixed part's answer judged as
checkers judge it: an honest one holds, a reducer that mixes other rows or does not mix is named."""

from __future__ import annotations

import torch

from averaging.mixing import TIE_TOLERANCE, mix, mixed_count, nearest_sets, sets_hold
from averaging.reduction import ShardReduction
from averaging.robust import Aggregation, centered_clip, clip_weights
from averaging.verification import PartCheck, PartInputs
from tests.averaging.test_verification import GROUP, ids, signed_rows

DIM = 64


def test_each_row_mixes_with_its_nearest_rows_itself_first() -> None:
    # k = n - (ceil(n / 2) - 1): each mixed row holds at most as many hostile rows as CenteredClip tolerates
    assert [mixed_count(n) for n in (2, 3, 4, 5, 8, 16)] == [2, 2, 3, 3, 5, 9]
    values = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [10.0, 10.0], [10.0, 11.0]])
    sets = nearest_sets(values)
    assert sets == [[0, 1, 2], [1, 0, 2], [2, 0, 1], [3, 4, 2], [4, 3, 2]]
    mixed = mix(values, sets)
    torch.testing.assert_close(mixed[3], values[[3, 4, 2]].mean(dim=0))
    assert sets_hold(values, sets) is None


def test_a_checker_takes_any_nearest_sets_up_to_near_ties_and_nothing_else() -> None:
    # rows 1 and 2 are as far from row 0 as rounding can tell: either may be its second neighbour
    values = torch.tensor([[0.0, 0.0], [3.0, 4.0], [4.0, 3.0], [9.0, 9.0], [30.0, 0.0]], dtype=torch.float32)
    sets = nearest_sets(values)
    swapped = [list(s) for s in sets]
    swapped[0] = [0, 2, 1] if sets[0][1] == 1 else [0, 1, 2]
    assert sets_hold(values, swapped) is None
    # a clear outsider is not a near tie
    outsider = [list(s) for s in sets]
    outsider[0] = [0, 1, 4]
    assert "not among the 3 nearest" in sets_hold(values, outsider)
    nudged = values.clone()
    nudged[2] *= 1 + 100 * TIE_TOLERANCE  # row 2 now clearly farther from row 0 than row 1
    ordered = nearest_sets(nudged)
    assert ordered[0] == [0, 1, 3] or ordered[0][:2] == [0, 1]
    for bad in (None, sets[:-1], [[1, 0, 2], *sets[1:]], [[0, 1, 1], *sets[1:]], [[0, 1, "2"], *sets[1:]]):
        assert sets_hold(values, bad) is not None, bad


def mixed_answer(peers, values, weights):
    """What an honest mixing reducer (``peers[0]``) answers for one part: its reply and the inputs
    it keeps for checks, as the reduction keeps them."""
    reduction = ShardReduction([DIM], list(peers), aggregation=Aggregation.CENTERED_CLIP_MIXED, keep_inputs=True)
    for peer, row, weight in zip(peers, values, weights, strict=True):
        reduction.set_weight(peer, weight)
        reduction.add_part(peer, 0, row.clone())
    reply = reduction.outcome().averaged.clone()
    senders, raw, kept, start, _, sets = reduction.kept_inputs[0]
    inputs = PartInputs(
        list(senders), raw, kept, reduction.part_taus[0], Aggregation.CENTERED_CLIP_MIXED, start,
        signed_rows(list(senders), raw, kept), sets,
    )  # fmt: skip
    return inputs, reply


def test_a_mixed_answer_holds_over_the_wire_and_a_reducer_that_mixes_otherwise_is_named() -> None:
    peers = ids(8)
    generator = torch.Generator().manual_seed(3)
    mu = torch.randn(DIM, generator=generator)
    honest = [mu + 2 * torch.randn(DIM, generator=generator) for _ in range(6)]
    values = torch.stack(honest + [-4 * mu] * 2)  # two quiet attackers inside the honest spread
    weights = [1.0] * 8
    inputs, reply = mixed_answer(peers, values, weights)
    assert inputs.neighbours is not None and len(inputs.neighbours) == 8
    me = peers[3]
    body, payload = inputs.to_message()
    parsed = PartInputs.parse(body, bytes(payload), DIM, 16)
    check = PartCheck(me, peers[0], values[3].clone(), 1.0, list(peers), reply, None, GROUP, 0)
    assert check.verdict(parsed) is None
    # mixing narrows the honest spread the attackers hide in: the answer is nearer the honest mean
    plain = torch.empty(DIM)
    centered_clip(list(values.unbind(0)), clip_weights(weights), plain, center=values[0])
    honest_mean = torch.stack(honest).mean(dim=0)
    assert (reply - honest_mean).norm() < (plain - honest_mean).norm()
    # a reducer that mixes rows of its choice: named even with the reply those sets give
    chosen = [[row, *[j for j in range(7, -1, -1) if j != row][:4]] for row in range(8)]
    other_reply = torch.empty(DIM)
    centered_clip(
        list(mix(values, chosen).unbind(0)), clip_weights(weights), other_reply, center=mix(values, chosen)[0]
    )
    lie = PartInputs(
        *[getattr(inputs, f) for f in ("senders", "weights", "values", "tau", "aggregation", "start", "signed")], chosen
    )
    assert "nearest" in (
        PartCheck(me, peers[0], values[3].clone(), 1.0, list(peers), other_reply, None, GROUP, 0).verdict(lie) or ""
    )
    # a reducer that states the nearest sets and answers with plain CenteredClip
    assert "away from the aggregate" in (
        PartCheck(me, peers[0], values[3].clone(), 1.0, list(peers), plain, None, GROUP, 0).verdict(parsed) or ""
    )
    # sets stated for a part answered as plain CenteredClip
    unmixed = PartInputs(
        *[getattr(inputs, f) for f in ("senders", "weights", "values", "tau")],
        Aggregation.CENTERED_CLIP,
        inputs.start,
        inputs.signed,
        inputs.neighbours,
    )
    assert "did not mix" in (check.verdict(unmixed) or "")


def test_a_group_of_two_is_not_mixed_into_one_mean() -> None:
    """Mixing both rows of two would make them one: they are aggregated as plain CenteredClip does
    (a group too small to outvote a liar is bounded by the members' own history: ``own_radius.py``)."""
    peers = ids(2)
    values = torch.stack([torch.ones(DIM), torch.full((DIM,), 5.0)])
    inputs, reply = mixed_answer(peers, values, [1.0, 1.0])
    assert inputs.neighbours is None
    plain = torch.empty(DIM)
    centered_clip(list(values.unbind(0)), [1.0, 1.0], plain, center=values[0])
    torch.testing.assert_close(reply, plain)
