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
from tests.daemon.test_training import open_swarm


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
            for ahead in optimizers[:2]:
                await ahead.replica.move_to_epoch(1)
            meetings: dict[int, list[tuple[int, int]]] = {i: [] for i in range(3)}
            starts: dict[int, list] = {i: [] for i in range(3)}  # what each start averager's steps returned

            def record_starts(i: int) -> None:
                for averager in optimizers[i].start_averagers:  # (the start's pieces take turns)
                    step = averager.step

                    async def recorded_step(*args, step=step, **kwargs):
                        starts[i].append(await step(*args, **kwargs))
                        return starts[i][-1]

                    averager.step = recorded_step

            async def train(i: int) -> None:
                optimizer, seen = optimizers[i], 0
                record_starts(i)
                while optimizer.epoch < 6:
                    weights[i].grad = torch.ones(3)
                    if await optimizer.step(1) and optimizer.epoch % 2 == 0:
                        # the start was averaged as this round finished: with whom (0: nobody)
                        new = starts[i][seen:]
                        meetings[i].append((optimizer.epoch, len(new[-1].group.members) if new else 0))
                        seen = len(starts[i])

            with trio.fail_after(60):
                async with trio.open_nursery() as peers:
                    for i in range(3):
                        peers.start_soon(train, i)
            background.cancel_scope.cancel()
        assert [optimizer.epoch for optimizer in optimizers] == [6, 6, 6]
        assert all(rounds == [(2, 3), (4, 3), (6, 3)] for rounds in meetings.values()), meetings
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
        for seen in epochs.values():  # one epoch per round at most (a round takes 1 or 2 steps)
            steps = list(zip([0, *seen[:-1]], seen, strict=True))
            assert all(0 <= after - before <= 1 for before, after in steps) and seen[-1] >= 2, epochs
        nursery.cancel_scope.cancel()


async def test_between_overlapped_rounds_the_progress_exchange_does_not_stall_the_inner_steps():
    async with DHTNode.open() as node, trio.open_nursery() as background:
        weight = torch.nn.Parameter(torch.zeros(3))
        optimizer = LocalUpdatesOptimizer(
            torch.optim.SGD([weight], lr=0.1),
            node,
            prefix="exchange",
            local_steps=2,
            codec="none",
            average_state_every=0,
            rounds=OverlappedRounds(background),
        )
        never = trio.Event()

        async def no_group(weight=1.0, timeout=None, group=None, round_number=None):
            raise MatchmakingError("alone, as the test says")

        async def hanging_fetch(samples):
            await never.wait()

        optimizer.delta_averager.step = no_group
        stepped = []
        with trio.fail_after(10):
            weight.grad = torch.zeros(3)
            stepped.append(await optimizer.step(1))  # the first step reads the swarm before training
            optimizer.replica.fetch = hanging_fetch
            while optimizer.epoch < 4:  # rounds end, and each one's exchange hangs in the background
                weight.grad = torch.zeros(3)
                stepped.append(await optimizer.step(1))
        assert stepped.count(True) == 4
        background.cancel_scope.cancel()


class _HangingRound:
    """A LocalRound whose averaging never ends (a group that never forms, a peer that stalls)."""

    epoch = 3

    class outer_step:  # noqa: N801 (what OverlappedRounds calls on it)
        @staticmethod
        def compute_deltas_and_anchor():
            return []

    def __init__(self):
        self.restarted = 0

    async def average_deltas(self, epoch, weight):
        await trio.sleep_forever()

    async def advance(self, apply, record):
        raise AssertionError("an abandoned round's outer step must never land")

    async def finish_round(self, record):
        raise AssertionError("no round landed")

    def restart_round(self):
        self.restarted += 1


async def test_abandoning_an_overlapped_round_cancels_its_averaging_even_before_it_started():
    """A state load drops the round in flight; abandon() right after end_round() (before the
    averaging task ran) must still cancel it, not wait out the averaging's own deadlines."""
    run = _HangingRound()
    async with trio.open_nursery() as background:
        rounds = OverlappedRounds(background)
        assert await rounds.end_round(run, 1.0) is False
        with trio.fail_after(2):
            await rounds.abandon()
        assert await rounds.end_round(run, 1.0) is False  # a fresh first round: nothing lands
        with trio.fail_after(2):
            await trio.sleep(0.05)  # (the averaging task has started this time)
            await rounds.abandon()
        assert run.restarted == 2
        background.cancel_scope.cancel()
