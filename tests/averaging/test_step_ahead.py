"""Steps in a rhythm find their group formed ahead (``averaging/step_ahead.py``): peers that step
every so often start each step's all-reduce at once, a step that comes before its matchmaking ahead
began matches itself, and a group formed ahead is used however long the step came after it."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import trio

from averaging.averager import FormedGroup
from averaging.matchmaking import MatchmakingError
from averaging.step_ahead import StepAhead
from tests.averaging.test_match_ahead import make_averagers, open_swarm

SETTLE = 0.5
MATCHMAKING_TIMEOUT = 5.0
TRAINING_S = 1.0  # what each peer does between its steps


async def test_steps_in_a_rhythm_start_with_their_group_formed_and_average_exactly():
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes, [1.0, 2.0, 6.0], settle_time=SETTLE)
        steps = [StepAhead(averager, nursery) for averager in averagers]
        matchmaking: dict[int, list[float]] = {i: [] for i in range(3)}

        async def train(i: int) -> None:
            for number in range(5):
                with torch.no_grad():
                    averagers[i].tensors[0].fill_([1.0, 2.0, 6.0][i] + number)
                done = await steps[i].step(timeout=4.0)
                assert len(done.group.members) == 3 and not done.result.failed_peers
                assert torch.allclose(averagers[i].tensors[0], torch.full((3000,), 3.0 + number))
                matchmaking[i].append(done.timing.matchmaking_s)
                await trio.sleep(TRAINING_S)

        async with trio.open_nursery() as peers:
            for i in range(3):
                peers.start_soon(train, i)
        for i in range(3):
            await steps[i].close()
            await averagers[i].leave()
        nursery.cancel_scope.cancel()
    # A group formed at the step formed after every member's step began (a DHT read and the joins
    # came first); from the third step on (once there is a period) it formed before some began.
    quickest = [min(matchmaking[i][number] for i in range(3)) for number in range(5)]
    assert min(quickest[:2]) > 0, quickest
    assert quickest[2:] == [0.0, 0.0, 0.0], quickest


async def test_steps_that_break_the_rhythm_still_average():
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 2)
        averagers = make_averagers(nodes, [1.0, 3.0], settle_time=SETTLE)
        steps = [StepAhead(averager, nursery) for averager in averagers]
        sizes = []

        async def train(i: int, pauses: list[float]) -> None:
            for pause in pauses:
                done = await steps[i].step(timeout=4.0)
                sizes.append((i, len(done.group.members)))
                await trio.sleep(pause)

        # Three steps a second apart, then a long pause past the rhythm (the group formed ahead
        # for the next step waits for both, or its matchmaking times out), then two quick steps
        # (the next step comes before matchmaking ahead has begun).
        async with trio.open_nursery() as peers:
            for i in range(2):
                peers.start_soon(train, i, [TRAINING_S, TRAINING_S, 12.0, 0.0, 0.0])
        assert sorted(sizes) == [(0, 2)] * 5 + [(1, 2)] * 5
        for step in steps:
            await step.close()
        nursery.cancel_scope.cancel()


class ScriptedAverager:
    """Stands in for a GroupAverager on a virtual clock: a step that is handed no group finds one
    after the next of ``matching_s``; a group formed ahead forms once its step is due."""

    def __init__(self, matching_s: list[float], allreduce_s: float = 0.1, failing: frozenset[int] = frozenset()):
        self.settings = types.SimpleNamespace(settle_time=SETTLE, matchmaking_timeout=MATCHMAKING_TIMEOUT)
        self.round = 0
        self.matching_s = matching_s
        self.allreduce_s = allreduce_s
        self.formed_ahead: list[bool] = []  # per step: was its group formed ahead
        self.failing = failing  # the steps (from 1) whose matchmaking fails after its time

    async def find_group(self, round_number: int, hold_open: trio.Event) -> FormedGroup:
        with trio.move_on_after(MATCHMAKING_TIMEOUT):  # (as matchmaking gives up at its deadline)
            await hold_open.wait()
            return FormedGroup(None, round_number, trio.current_time())
        raise MatchmakingError("no averaging group formed")

    async def step(self, weight, timeout, group=None, on_group=None) -> None:
        self.formed_ahead.append(group is not None)
        if group is None:
            await trio.sleep(self.matching_s.pop(0) if self.matching_s else 0.05)
            if len(self.formed_ahead) in self.failing:
                raise MatchmakingError("no averaging group formed")
            group = FormedGroup(None, self.round, trio.current_time())
        self.round = group.round + 1
        on_group(group)
        await trio.sleep(self.allreduce_s)


async def step_through(
    averager: ScriptedAverager, count: int, pause: Callable[[int, bool], float]
) -> tuple[StepAhead, list[int]]:
    """``count`` steps of ``averager`` through ``StepAhead``, step ``number`` followed by
    ``pause(number, failed)`` seconds (``failed``: it formed no group, which the loop goes on
    from); returns the loop and the numbers of the steps that failed."""
    failures = []
    async with trio.open_nursery() as nursery:
        steps = StepAhead(averager, nursery)
        for number in range(count):
            try:
                await steps.step(timeout=4.0)
            except MatchmakingError:
                failures.append(number)
            await trio.sleep(pause(number, failures[-1:] == [number]))
        await steps.close()
    return steps, failures


async def test_the_rhythm_leaves_out_the_first_steps_long_matchmaking(autojump_clock):
    # The first step reads and settles in full (2 s here), the second finds its view settled at
    # once: its next step comes 2 s sooner than start-to-start says, and the group formed ahead
    # must have begun by then.
    averager = ScriptedAverager(matching_s=[2.0, 0.05])
    steps, failures = await step_through(averager, 5, lambda number, failed: TRAINING_S)
    assert failures == [] and averager.formed_ahead == [False, False, True, True, True]
    assert steps.period is not None and abs(steps.period - (TRAINING_S + averager.allreduce_s)) < 1e-6


async def test_a_step_whose_matchmaking_failed_leaves_its_search_out_of_the_rhythm(autojump_clock):
    # The second step looks for a group for 3 s and finds none: the third step comes a training
    # time after it ended, and the fourth must find its group formed ahead all the same.
    averager = ScriptedAverager(matching_s=[0.05, 3.0, 0.05], failing=frozenset({2}))
    _, failures = await step_through(averager, 5, lambda number, failed: TRAINING_S)
    assert failures == [1] and averager.formed_ahead == [False, False, False, True, True]


async def three_peers_stepping(pauses: list[list[float]]) -> dict[int, list]:
    """Three averagers on 127.0.0.1 stepping through ``StepAhead``, peer i pausing ``pauses[i]``
    after its steps; per peer, each step's (group size, failed peers, seconds) or its error."""
    outcomes: dict[int, list] = {i: [] for i in range(3)}
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes, [1.0, 2.0, 6.0], settle_time=SETTLE)
        steps = [StepAhead(averager, nursery) for averager in averagers]

        async def train(i: int) -> None:
            for pause in pauses[i]:
                started = trio.current_time()
                try:
                    done = await steps[i].step(timeout=4.0)
                    took = trio.current_time() - started
                    outcomes[i].append((len(done.group.members), len(done.result.failed_peers), took))
                except MatchmakingError as error:
                    outcomes[i].append(str(error))
                await trio.sleep(pause)

        async with trio.open_nursery() as peers:
            for i in range(3):
                peers.start_soon(train, i)
        for i in range(3):
            await steps[i].close()
            await averagers[i].leave()
        nursery.cancel_scope.cancel()
    return outcomes


def groups(outcomes: list) -> list:
    """(group size, failed peers) of each step, or its error."""
    return [outcome[:2] if isinstance(outcome, tuple) else outcome for outcome in outcomes]


async def test_peers_whose_steps_come_off_their_rhythm_together_average_with_the_group_formed_ahead():
    # A training loop's pauses vary (an evaluation, a checkpoint): after steps a second apart,
    # every peer pauses 3.3-3.7 s, its group formed ahead long before. A peer that dropped that
    # group as too old would match its round again, where the leaders that matched it refuse
    # joins: groups of 2, and one peer alone.
    outcomes = await three_peers_stepping([[TRAINING_S, TRAINING_S, 3.3 + 0.2 * i, TRAINING_S] for i in range(3)])
    assert {i: groups(outcomes[i]) for i in range(3)} == {i: [(3, 0)] * 4 for i in range(3)}, outcomes


async def test_a_peer_that_steps_after_its_group_averaged_without_it_learns_so_in_a_round_trip():
    # Its group formed ahead; the others stepped on time, waited ROUND_WAIT for it and averaged
    # without it. Their round is over, so they refuse its parts (RoundOver) and send it none: its
    # own shard stops waiting for them at once instead of after its senders' deadline (3 s here).
    outcomes = await three_peers_stepping([[TRAINING_S] * 4] * 2 + [[TRAINING_S, TRAINING_S, 11.0, 0.0]])
    size, failed, took = outcomes[2][3]  # the late step, with the group formed for it
    assert (size, failed) == (3, 2) and took < 1.0, outcomes[2]
    assert groups(outcomes[0]) == [(3, 0)] * 3 + [(3, 1)], outcomes[0]


async def test_a_loop_whose_steps_come_at_uneven_intervals_finds_every_group_formed_ahead(autojump_clock):
    # Gradient accumulation with an evaluation every other step: steps come 0.4 s and 2.1 s apart
    # in turn. Planned by the last interval alone, every step after a long one came before its
    # matchmaking ahead had begun (and matched at the step); planned by the shortest recent one,
    # each group forms in time and waits for its step.
    averager = ScriptedAverager(matching_s=[0.05, 0.05])
    _, failures = await step_through(averager, 8, lambda number, failed: 0.3 if number % 2 == 0 else 2.0)
    assert failures == [] and averager.formed_ahead == [False, False] + [True] * 6


async def test_a_step_retried_at_once_after_it_failed_leaves_the_loops_interval_alone(autojump_clock):
    # Steps 30 s apart; the second finds no group and the loop retries at once. That retry's
    # interval (none) is no interval of the loop: planned by it, matchmaking ahead began at once,
    # gave up at its deadline long before each step came, and the next steps matched at the step.
    averager = ScriptedAverager(matching_s=[0.05, 3.0, 0.05], failing=frozenset({2}))
    _, failures = await step_through(averager, 8, lambda number, failed: 0.0 if failed else 30.0)
    assert failures == [1] and averager.formed_ahead == [False, False, False] + [True] * 5
