"""Local-updates rounds across in-process peers whose epochs start apart, with either schedule."""

from __future__ import annotations

import time

import pytest
import torch
import trio

from averaging.local_rounds import OverlappedRounds, SequentialRounds
from averaging.local_updates import LocalUpdatesOptimizer
from averaging.matchmaking import MatchmakingError
from dht.node import DHTNode
from dht.peer_dictionary import peer_subkey

from .test_training import open_swarm


def one_step_optimizer(weight, node, prefix: str, *, group_size: int, average_state_every: int, rounds):
    """A local-updates optimizer of one inner step per round with short, loopback deadlines."""
    return LocalUpdatesOptimizer(
        torch.optim.SGD([weight], lr=0.1),
        node,
        prefix=prefix,
        local_steps=1,
        codec="none",
        target_group_size=group_size,
        settle_time=0.1,
        matchmaking_timeout=2.0,
        averaging_timeout=6.0,
        average_state_every=average_state_every,
        rounds=rounds,
    )


@pytest.mark.parametrize("schedule", ["sequential", "overlapped"])
async def test_a_peer_a_round_behind_counts_the_round_it_shares_and_state_averaging_meets_all(schedule):
    """Three peers, one an outer round behind: as a joiner is that loaded a donor's state while
    the donor's next outer step was in flight. Its first round averaged in the others' round for the
    next epoch, but it counted one epoch less for good, so every ``average_state_every`` rounds it
    averaged the start alone ('only 1 matching peer(s) declared'), a matchmaking deadline lost."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        async with trio.open_nursery() as background:
            weights = [torch.nn.Parameter(torch.zeros(3)) for _ in nodes]
            optimizers = [
                one_step_optimizer(
                    weight,
                    node,
                    "behind",
                    group_size=3,
                    average_state_every=2,
                    rounds=SequentialRounds() if schedule == "sequential" else OverlappedRounds(background),
                )
                for weight, node in zip(weights, nodes, strict=True)
            ]
            optimizers[0].replica.epoch = optimizers[1].replica.epoch = 1
            meetings: dict[int, list[int]] = {i: [] for i in range(3)}  # group sizes of start averagings
            seen: list = [None] * 3

            def note_start_averaging(i: int) -> None:
                result = optimizers[i].start_averager.last_result
                if result is not seen[i]:
                    meetings[i].append(len(result.group.members))
                    seen[i] = result

            async def train(i: int) -> None:
                optimizer = optimizers[i]
                while optimizer.epoch < 6:
                    weights[i].grad = torch.ones(3)
                    await optimizer.step(1)
                    note_start_averaging(i)

            with trio.fail_after(60):
                async with trio.open_nursery() as peers:
                    for i in range(3):
                        peers.start_soon(train, i)
                # overlapped: the start averaging begun as the last round finished runs on
                while any(len(meetings[i]) < 3 for i in range(3)):
                    await trio.sleep(0.05)
                    for i in range(3):
                        note_start_averaging(i)
            background.cancel_scope.cancel()
        assert [optimizer.epoch for optimizer in optimizers] == [6, 6, 6]
        # at epochs 2, 4 and 6, always all three
        assert all(sizes == [3, 3, 3] for sizes in meetings.values()), meetings
        nursery.cancel_scope.cancel()


async def test_a_declaration_far_ahead_from_outside_the_group_does_not_push_the_epoch():
    """Anyone can store a matchmaking declaration: a client-mode one claiming round 10**12, kept
    fresh, made both honest peers count an extra epoch every round (2, 4, 6, ...)."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        honest, hostile = nodes[:2], nodes[2]
        weights = [torch.nn.Parameter(torch.zeros(3)) for _ in honest]
        optimizers = [
            one_step_optimizer(w, node, "h", group_size=2, average_state_every=4, rounds=SequentialRounds())
            for w, node in zip(weights, honest, strict=True)
        ]
        key = f"{optimizers[0].delta_averager.prefix}.matchmaking"
        claim = {"address": None, "bandwidth": 0.0, "mode": "client", "round": 10**12}
        claim["schema"] = optimizers[0].delta_averager.schema

        async def keep_claiming() -> None:
            while True:
                subkey = peer_subkey(hostile.host.identity.public_key)
                await hostile.store(key, claim, time.time() + 5, subkey=subkey)
                await trio.sleep(0.5)

        nursery.start_soon(keep_claiming)
        await trio.sleep(0.5)
        epochs: dict[int, list[int]] = {0: [], 1: []}

        async def train(i: int) -> None:
            for _ in range(4):
                weights[i].grad = torch.ones(3)
                await optimizers[i].step(1)
                epochs[i].append(optimizers[i].epoch)

        with trio.fail_after(120):
            async with trio.open_nursery() as peers:
                for i in range(2):
                    peers.start_soon(train, i)
        assert epochs == {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}
        nursery.cancel_scope.cancel()


async def test_between_overlapped_rounds_nothing_stalls_the_inner_steps():
    """The start's periodic averaging and the progress exchange run in the background; the start's
    correction lands at a step once it is done (here: before the next outer step)."""
    async with DHTNode.open() as node, trio.open_nursery() as background:
        weight = torch.nn.Parameter(torch.zeros(3))
        optimizer = LocalUpdatesOptimizer(
            torch.optim.SGD([weight], lr=0.1),
            node,
            prefix="start",
            local_steps=4,
            codec="none",
            average_state_every=1,
            rounds=OverlappedRounds(background),
        )
        release, started, never = trio.Event(), trio.Event(), trio.Event()

        async def no_group(weight=1.0, timeout=None, group=None):
            raise MatchmakingError("alone, as the test says")

        async def held_start_round(weight=1.0, timeout=None, group=None):
            started.set()
            await release.wait()
            for averaged in optimizer.outer_step.start_average:
                averaged.add_(1.0)  # the group's start stood 1 above ours

        async def hanging_fetch(samples):
            await never.wait()

        optimizer.delta_averager.step = no_group
        optimizer.start_averager.step = held_start_round

        async def step() -> bool:
            weight.grad = torch.zeros(3)  # no local progress: only the correction moves the weight
            return await optimizer.step(1)

        with trio.fail_after(10):
            await step()  # the first step reads the swarm before training
            optimizer.replica.fetch = hanging_fetch
            while not started.is_set():  # until a round has ended and begun averaging the start
                await step()
            assert optimizer.inner_steps < optimizer.local_steps - 1
            while optimizer.inner_steps < optimizer.local_steps - 1:  # the next round's steps go on
                assert await step() is False
        assert weight.tolist() == [0.0, 0.0, 0.0]
        release.set()
        with trio.fail_after(10):
            assert await step() is True  # the round ends: the correction landed before its outer step
        assert weight.tolist() == [1.0, 1.0, 1.0] and optimizer.outer_step.start[0].tolist() == [1.0, 1.0, 1.0]
        background.cancel_scope.cancel()
