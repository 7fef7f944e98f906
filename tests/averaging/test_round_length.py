"""Local-updates rounds end on the swarm's progress (``averaging/round_length.py``): the rule
alone, and two in-process peers of different speeds that end every round together."""

from __future__ import annotations

import pytest
import torch
import trio

from averaging.epoch_evidence import EpochEvidence
from averaging.local_rounds import OverlappedRounds, SequentialRounds
from averaging.local_updates import LocalUpdatesOptimizer
from averaging.progress import PeerProgress, SwarmProgress
from averaging.round_length import MAX_STRETCH, round_over
from peer import PeerID
from tests.daemon.test_training import open_swarm

ME, A, B, C = (PeerID(bytes([i]) * 20) for i in (1, 2, 3, 4))


def view(mine: PeerProgress, others: dict[PeerID, PeerProgress], evidenced: int | None = None) -> SwarmProgress:
    return SwarmProgress({ME: mine, **others}, evidenced, ME)


def test_alone_a_round_is_local_steps():
    alone = view(PeerProgress(3, 90, 1.0), {})
    assert not round_over(alone, 3, 9, 90, local_steps=10)
    assert round_over(alone, 3, 10, 100, local_steps=10)


def test_a_round_ends_when_the_swarm_took_local_steps_per_peer():
    # two peers in round 3, batches of 10, 10 local steps: 200 samples in all
    slow = PeerProgress(3, 40, 1.0)
    assert not round_over(view(PeerProgress(3, 150, 1.0), {A: slow}), 3, 15, 150, local_steps=10)
    assert round_over(view(PeerProgress(3, 160, 1.0), {A: slow}), 3, 16, 160, local_steps=10)
    # the slow peer ends on the fast one's samples, after fewer steps than local_steps
    fast = PeerProgress(3, 140, 1.0)
    assert round_over(view(PeerProgress(3, 60, 1.0), {A: fast}), 3, 6, 60, local_steps=10)


def test_own_steps_stay_within_the_stretch():
    # a claim of many samples cannot end our round before local_steps / MAX_STRETCH steps
    liar = PeerProgress(3, 10**9, 1.0)
    floor = 10 // MAX_STRETCH
    assert not round_over(view(PeerProgress(3, 10 * (floor - 1), 1.0), {A: liar}), 3, floor - 1, 10 * (floor - 1), 10)
    # peers that claim to take part and never train cannot hold it open past local_steps * MAX_STRETCH
    idle = {A: PeerProgress(3, 0, 1.0), B: PeerProgress(2, 0, 1.0)}
    ceiling = 10 * MAX_STRETCH
    assert not round_over(view(PeerProgress(3, 10 * (ceiling - 1), 1.0), idle), 3, ceiling - 1, 10 * (ceiling - 1), 10)
    assert round_over(view(PeerProgress(3, 10 * ceiling, 1.0), idle), 3, ceiling, 10 * ceiling, 10)


def test_a_peer_still_in_the_previous_round_holds_ours_back_and_one_far_behind_does_not():
    behind = PeerProgress(2, 10**6, 1.0)  # its samples are for round 2: none count for ours
    assert not round_over(view(PeerProgress(3, 150, 1.0), {A: behind}), 3, 15, 150, 10)
    far_behind = PeerProgress(0, 10**6, 1.0)  # loading state, not taking part
    assert round_over(view(PeerProgress(3, 100, 1.0), {A: far_behind}), 3, 10, 100, 10)


def test_when_the_swarm_moved_past_our_round_it_ends_as_soon_as_the_floor_allows():
    ahead = view(PeerProgress(3, 10, 1.0), {A: PeerProgress(4, 0, 1.0)}, evidenced=4)
    floor = 10 // MAX_STRETCH
    assert round_over(ahead, 3, floor, 10 * floor, local_steps=10)
    assert not round_over(ahead, 3, 0, 0, local_steps=10)


def test_two_identities_claiming_the_next_round_cannot_make_rounds_single_steps():
    """Claims of one epoch past ours are evidence from two identities that agree (or from one
    peer we last averaged with); renewed every round, they ended every round after one step."""
    evidence = EpochEvidence(ME, samples_per_epoch=None)
    honest = PeerProgress(3, 10, 1.0)
    for epoch in (3, 4, 5):  # whatever our round, the liars claim the next one
        mine = PeerProgress(epoch, 10, 1.0)
        claims = {ME: mine, A: PeerProgress(epoch + 1, 0, 1.0), B: PeerProgress(epoch + 1, 0, 1.0), C: honest}
        swarm = SwarmProgress(claims, evidence.evidenced(claims, epoch, now=float(epoch)), ME)
        assert swarm.epoch == epoch + 1  # the evidence takes their word for it
        assert not round_over(swarm, epoch, 1, 10, local_steps=10)
        assert round_over(swarm, epoch, 10 // MAX_STRETCH, 50, local_steps=10)


def quick_optimizers(nodes, schedule: str, background, **options) -> tuple[list, list[LocalUpdatesOptimizer]]:
    """One weight and one local-updates optimizer per node, with loopback deadlines, exchanging
    progress every 50 ms."""
    weights = [torch.nn.Parameter(torch.zeros(4)) for _ in nodes]
    optimizers = [
        LocalUpdatesOptimizer(
            torch.optim.SGD([weight], lr=0.1),
            node,
            codec="none",
            settle_time=0.1,
            average_state_every=0,
            rounds=SequentialRounds() if schedule == "sequential" else OverlappedRounds(background),
            progress_interval=0.05,
            **options,
        )
        for weight, node in zip(weights, nodes, strict=True)
    ]
    return weights, optimizers


@pytest.mark.parametrize("schedule", ["sequential", "overlapped"])
async def test_peers_of_different_speeds_end_their_rounds_together_and_average_every_one(schedule):
    """A fixed count of local steps per round let a peer three times slower fall further behind
    every round until the two never met in a group; on the swarm's progress, every round of
    both is averaged with the other, and the fast peer takes more of the round's steps."""
    rounds, local_steps = 6, 6
    async with trio.open_nursery() as nursery, trio.open_nursery() as background:
        nodes = await open_swarm(nursery, 2)
        weights, optimizers = quick_optimizers(
            nodes,
            schedule,
            background,
            prefix="speeds",
            local_steps=local_steps,
            target_group_size=2,
            matchmaking_timeout=2.0,
        )
        steps = [[0] * (rounds + 1) for _ in nodes]
        groups: list[list[int]] = [[], []]

        async def train(i: int, seconds_per_step: float) -> None:
            optimizer = optimizers[i]
            while optimizer.epoch < rounds:
                weights[i].grad = torch.ones(4)
                steps[i][optimizer.epoch] += 1
                await trio.sleep(seconds_per_step)
                if await optimizer.step(10):
                    record = optimizer.replica.last_round
                    groups[i].append(record.group if record is not None and record.averaged else 0)

        with trio.fail_after(60):
            async with trio.open_nursery() as peers:
                peers.start_soon(train, 0, 0.03)
                peers.start_soon(train, 1, 0.09)
        assert groups == [[2] * rounds, [2] * rounds], (groups, steps)
        fast, slow = steps
        assert sum(fast[1:rounds]) > sum(slow[1:rounds]), steps
        background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("schedule", ["sequential", "overlapped"])
async def test_a_peer_that_fell_rounds_behind_while_running_loads_the_swarms_state(schedule):
    """Only a peer's first step used to look for a swarm far ahead: one cut off for a while (here:
    it stops stepping while the others run on) came back rounds behind and stayed there, ending
    its rounds alone, since no group of its round forms again."""
    local_steps = 2
    async with trio.open_nursery() as nursery, trio.open_nursery() as background:
        nodes = await open_swarm(nursery, 3)
        weights, optimizers = quick_optimizers(
            nodes,
            schedule,
            background,
            prefix="behind-later",
            local_steps=local_steps,
            target_group_size=3,
            matchmaking_timeout=1.0,
            load_state_timeout=10.0,
        )
        away = trio.Event()

        async def train(i: int, until: int) -> None:
            optimizer = optimizers[i]
            while optimizer.epoch < until:
                if i == 2 and optimizer.epoch >= 2 and not away.is_set():
                    away.set()
                    return  # cut off: it stops here, and comes back below
                weights[i].grad = torch.ones(4)
                await optimizer.step(10)
                await trio.sleep(0.01)

        with trio.fail_after(60):
            async with trio.open_nursery() as peers:
                for i in range(3):
                    peers.start_soon(train, i, 9)
        behind = optimizers[2].epoch
        assert behind <= 3 and min(o.epoch for o in optimizers[:2]) >= 9
        jumps = []
        with trio.fail_after(30):  # it comes back: once it sees the swarm, it takes its state
            while optimizers[2].epoch < 8:
                weights[2].grad = torch.ones(4)
                before = optimizers[2].epoch
                await optimizers[2].step(10)
                jumps.append(optimizers[2].epoch - before)
                await trio.sleep(0.01)
        assert max(jumps) >= 5, jumps  # not one round at a time, alone
        starts = [optimizer.snapshot[0] for optimizer in optimizers]
        assert torch.equal(starts[2], starts[0]) or torch.equal(starts[2], starts[1]), starts
        background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
