"""A group too small to outvote a liar (two senders) under robust aggregation: the other member
sets CenteredClip's radius and the median weight, so a 1e30 contribution or a claimed weight of
2**40 would set the average. An honest peer's values move no farther than its own recent
updates allow, while an honest partner still averages exactly."""

from __future__ import annotations

import torch
import trio

from averaging.averager import GroupAverager
from averaging.compression import get_codec
from averaging.own_radius import RADIUS_FACTOR, OwnRadius, bound_move, bound_sparse_move
from tests.averaging.test_matchmaking import open_swarm

DIM = 1024
STEP = 0.1  # the scale of each peer's own update between rounds


async def test_a_partner_in_a_group_of_two_moves_us_no_farther_than_our_own_updates() -> None:
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        generator = torch.Generator().manual_seed(0)
        start = torch.randn(DIM, generator=generator) * 10
        ours, theirs = start.clone(), start.clone()
        options = {"prefix": "pair", "target_group_size": 2, "matchmaking_timeout": 2.0, "settle_time": 0.1}
        # a public swarm: ``auto`` is centered-clip
        honest, attacker = GroupAverager([ours], nodes[0], **options), GroupAverager([theirs], nodes[1], **options)
        updates: list[float] = []

        async def one_round(attack: str | None) -> tuple[torch.Tensor, torch.Tensor]:
            """Both train a step of their own, then average; returns ours before and after."""
            update = torch.randn(DIM, generator=generator) * STEP
            ours.add_(update)
            updates.append(float(update.norm()))
            theirs.copy_(ours + torch.randn(DIM, generator=generator) * STEP)  # an honest-looking partner
            weight = 1.0
            if attack == "huge":
                theirs.fill_(1e30)
            elif attack == "heavy":
                theirs.copy_(ours + 1000.0)
                weight = 2.0**40
            before, partner = ours.clone(), theirs.clone()
            async with trio.open_nursery() as peers:
                peers.start_soon(honest.step)
                peers.start_soon(lambda: attacker.step(weight=weight))
            return before, partner

        # no history yet: nothing says how far our values may move, so they stay ours
        before, _ = await one_round("huge")
        assert torch.equal(ours, before)
        # an honest partner near us averages exactly
        for _ in range(2):
            before, partner = await one_round(None)
            assert torch.allclose(ours, (before + partner) / 2, atol=1e-5)
        # a liar moves us by at most RADIUS_FACTOR times our largest recent update
        for attack in ("huge", "heavy"):
            before, _ = await one_round(attack)
            moved = float((ours - before).norm())
            assert torch.isfinite(ours).all()
            assert 0 < moved <= RADIUS_FACTOR * max(updates) * 1.001, (attack, moved, max(updates))
        nursery.cancel_scope.cancel()


def test_the_radius_follows_our_own_updates_and_nothing_a_round_wrote() -> None:
    """Parameters (training moves them on from what the round left) and gradients (a fresh one
    each round, whatever the round left): either way the radius is twice our own update, however
    far a liar moved us in the round before; estimated on a sample of a large vector."""
    generator = torch.Generator().manual_seed(1)
    size = 1 << 20  # 16 x the sample

    def noise() -> torch.Tensor:
        return torch.randn(size, generator=generator) * STEP

    # parameters: each round trains on from what the last one left
    history, values, updates = OwnRadius(), noise(), []
    assert history.before_round([values]) == 0.0  # no history yet
    for _ in range(3):
        left = values + 1000.0  # a liar moved us far (past any bound)
        history.after_round([left])
        update = noise()
        updates.append(float(update.norm()))
        values = left + update
        radius = history.before_round([values])
        assert abs(radius - RADIUS_FACTOR * max(updates)) <= 0.05 * radius, radius
    # gradients: each round sends a fresh one
    history, sent, updates = OwnRadius(), noise(), []
    history.before_round([sent])
    for _ in range(3):
        history.after_round([sent + 1000.0])
        fresh = noise()
        updates.append(float((fresh - sent).norm()))
        radius = history.before_round([fresh])
        assert abs(radius - RADIUS_FACTOR * max(updates)) <= 0.05 * radius, radius  # not the liar's move
        sent = fresh


def test_a_sparse_average_is_bounded_at_the_values_it_kept_and_stays_sparse() -> None:
    """A sparse codec's average holds zeros where the round averaged nothing: bounding the move
    as a dense one would count our whole contribution there as moved and write it back scaled,
    turning the average dense; the sparse bound measures and scales the kept values alone."""
    ours = torch.arange(1.0, 9.0)
    averaged = torch.tensor([0.0, 0.0, 30.0, 0.0, 0.0, 6.0 + 40.0, 0.0, 0.0])  # a liar pulled 2 values
    [(start, bounded)], moved = bound_sparse_move(ours, [(0, averaged)], radius=5.0)
    assert start == 0 and abs(moved - (27.0**2 + 40.0**2) ** 0.5) < 1e-9
    assert torch.equal(bounded != 0, averaged != 0)  # still sparse, at the same values
    move = bounded[[2, 5]] - ours[[2, 5]]
    assert abs(float(move.norm()) - 5.0) < 1e-5 and abs(float(move[0] / move[1]) - 27.0 / 40.0) < 1e-6
    near = torch.where(averaged != 0, ours + 0.1, 0.0)
    assert bound_sparse_move(ours, [(0, near)], radius=5.0)[0][0][1] is near  # within the radius: as it is
    dense = bound_move(ours, [(0, averaged)], radius=5.0)[0][0][1]
    assert bool((dense != 0).all())  # (what the dense bound would have written back)


async def step_both(ours: GroupAverager, theirs: GroupAverager):
    """One round of the two averagers together; what ours was."""
    rounds = []

    async def our_step() -> None:
        rounds.append(await ours.step())

    async with trio.open_nursery() as peers:
        peers.start_soon(our_step)
        peers.start_soon(theirs.step)
    return rounds[0]


async def test_a_sparse_round_too_small_to_outvote_a_liar_keeps_what_we_sent_and_owes_the_rest() -> None:
    """With no history our radius is 0: a sparse round of two keeps, at the values its average
    kept, our contribution as we sent it (2-bit), not our exact values (the rest of them stays owed
    in error feedback: applying it here would count it twice), and zero elsewhere: where the liar
    alone sent values, nothing is applied."""
    from averaging.sparse_codec import as_sent

    async with trio.open_nursery() as nodes_nursery:
        nodes = await open_swarm(nodes_nursery, 2)
        generator = torch.Generator().manual_seed(1)
        ours = torch.randn(3 * DIM, generator=generator)
        theirs = ours.clone()
        theirs[::97] = 1e30  # as we are, but for a few huge values
        options = {"prefix": "sparse-pair", "target_group_size": 2, "matchmaking_timeout": 2.0, "settle_time": 0.1}
        honest = GroupAverager([ours], nodes[0], codec="topk_2bit", **options)
        attacker = GroupAverager([theirs], nodes[1], codec="topk_2bit", **options)
        before = ours.clone()
        rounds = [await step_both(honest, attacker)]
        assert rounds[0].result.bounded[1] == 0.0  # our radius: no history yet
        kept = ours != 0
        assert 0 < int(kept.sum()) < ours.numel() // 8 and float(ours.abs().max()) < 10  # sparse, no liar's value
        plan = rounds[0].result.plan
        parts = [part for shard in range(plan.num_shards) for part in plan.parts(shard)]
        sent = as_sent(get_codec("topk_2bit"), before, parts, 0)
        assert torch.equal(ours[kept], sent[kept]) and not torch.equal(ours[kept], before[kept])
        nodes_nursery.cancel_scope.cancel()


async def test_a_liar_moves_a_sparse_round_by_no_more_than_the_share_of_our_updates_it_carries() -> None:
    """Our radius comes from our whole updates, but a sparse round carries only our few largest
    values: at those it is scaled by the share of our values' norm that we sent, so a liar in a
    group of two gets no more room than an honest partner's sparse average needs."""
    from averaging.sparse_codec import as_sent

    async with trio.open_nursery() as nodes_nursery:
        nodes = await open_swarm(nodes_nursery, 2)
        generator = torch.Generator().manual_seed(4)
        center = torch.randn(3 * DIM, generator=generator) * 10  # what we send is new each round, near it
        ours, theirs = center.clone(), center.clone()
        options = {"prefix": "sparse-radius", "target_group_size": 2, "matchmaking_timeout": 2.0, "settle_time": 0.1}
        honest = GroupAverager([ours], nodes[0], codec="topk_2bit", **options)
        partner = GroupAverager([theirs], nodes[1], codec="topk_2bit", **options)
        updates: list[float] = []
        sent_last: list[torch.Tensor] = []

        async def one_round(huge: bool):
            fresh = center + torch.randn(3 * DIM, generator=generator) * STEP  # (as a new pseudo-gradient)
            if sent_last:  # our own update as OwnRadius reads it: the nearer of what the round left and we sent
                updates.append(min(float((fresh - ours).norm()), float((fresh - sent_last[-1]).norm())))
            sent_last.append(fresh.clone())
            ours.copy_(fresh)
            theirs.copy_(ours + torch.randn(3 * DIM, generator=generator) * STEP)
            if huge:
                theirs.mul_(1e6)
            before = ours.clone()
            return before, (await step_both(honest, partner)).result

        for _ in range(3):  # our history: no attack yet
            await one_round(huge=False)
        before, result = await one_round(huge=True)
        plan = result.plan
        sent = as_sent(get_codec("topk_2bit"), before, [p for i in range(plan.num_shards) for p in plan.parts(i)], 0)
        share = float(sent.norm() / before.norm())
        moved, radius = result.bounded
        assert moved > radius and share < 0.5
        assert radius <= RADIUS_FACTOR * max(updates) * share * 1.01
        kept = ours != 0
        assert float((ours[kept] - sent[kept]).norm()) <= radius * 1.001
        nodes_nursery.cancel_scope.cancel()
