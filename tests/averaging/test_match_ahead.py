"""Matchmaking ahead of the step: groups formed while peers still accumulate, and what happens to
them when members step apart or leave."""

from __future__ import annotations

import math
import statistics

import torch
import trio

from averaging.averager import GroupAverager
from averaging.match_ahead import MatchAhead, matchmaking_due
from averaging.optimizer import CollaborativeOptimizer
from averaging.progress import PeerProgress, SwarmProgress
from dht.node import DHTNode
from peer import PeerID


async def open_swarm(nursery, count: int):
    """``count`` DHT nodes, each in its own cancel scope so that a test can take one away."""
    nodes, scopes = [], []

    async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            async with DHTNode.open(initial_peers=initial) as node:
                task_status.started((node, scope))
                await trio.sleep(math.inf)

    for i in range(count):
        node, scope = await nursery.start(run_node, [nodes[0].address] if i else [])
        nodes.append(node)
        scopes.append(scope)
    return nodes, scopes


def make_averagers(nodes, values, size=3000, **extra):
    # Exact means of a few distinct values: the plain mean (a public swarm's default, centered-clip,
    # clips outliers among so few; tests/averaging/test_robust_aggregation.py covers it).
    options = {"prefix": "ahead", "matchmaking_timeout": 4.0, "sender_timeout": 3.0, "reducer_timeout": 5.0}
    options["aggregation"] = "mean"
    options.update(target_group_size=len(nodes), **extra)
    pairs = zip(nodes, values, strict=True)
    return [GroupAverager([torch.full((size,), float(v))], node, **options) for node, v in pairs]


async def find_groups(averagers):
    formed = {}

    async def one(i, averager):
        formed[i] = await averager.find_group(7)

    async with trio.open_nursery() as nursery:
        for i, averager in enumerate(averagers):
            nursery.start_soon(one, i, averager)
    return formed


def test_matchmaking_is_due_once_the_swarm_is_predicted_to_reach_the_target_within_the_lead():
    me, other = PeerID(b"\x01" * 20), PeerID(b"\x02" * 20)

    def view(samples, rate):
        return SwarmProgress({me: PeerProgress(3, samples, rate), other: PeerProgress(3, samples, rate)}, 3, me)

    assert not matchmaking_due(view(100, 50.0), 3, 1000, lead=2.0)  # 800 missing at 100/s: 8 s away
    assert matchmaking_due(view(420, 50.0), 3, 1000, lead=2.0)  # 160 missing: 1.6 s away
    assert matchmaking_due(view(500, 0.0), 3, 1000, lead=2.0)  # reached, whatever the rate
    assert not matchmaking_due(view(0, 0.0), 3, 1000, lead=2.0)  # no rate known yet: no prediction
    assert not matchmaking_due(view(420, 50.0), 4, 1000, lead=2.0)  # samples of another epoch count nothing


async def test_a_group_formed_ahead_averages_when_its_members_step_apart():
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes, [1.0, 2.0, 6.0])
        formed = await find_groups(averagers)
        assert len({f.group.group_id for f in formed.values()}) == 1 and {f.round for f in formed.values()} == {7}
        results = {}

        async def step(i, delay):
            await trio.sleep(delay)  # this member's epoch ends later than the first one's
            results[i] = await averagers[i].step(weight=1.0, group=formed[i])

        with trio.fail_after(20):
            async with trio.open_nursery() as steps:
                for i, delay in enumerate([0.0, 0.5, 1.5]):
                    steps.start_soon(step, i, delay)
        for i, averager in enumerate(averagers):
            assert not results[i].result.failed_peers
            assert torch.allclose(averager.tensors[0], torch.full((3000,), 3.0))
            assert averager.round == 8 and results[i].timing.matchmaking_s == 0.0
        nursery.cancel_scope.cancel()


async def test_a_member_that_left_after_the_group_formed_is_dropped_and_the_rest_average():
    async with trio.open_nursery() as nursery:
        nodes, scopes = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes, [1.0, 3.0, 100.0])
        formed = await find_groups(averagers)
        scopes[2].cancel()  # the third member leaves before anyone steps
        await trio.sleep(0)
        results = {}

        async def step(i):
            results[i] = await averagers[i].step(weight=1.0, group=formed[i])

        with trio.fail_after(20):
            async with trio.open_nursery() as steps:
                for i in range(2):
                    steps.start_soon(step, i)
        for i in range(2):
            assert nodes[2].host.peer_id in results[i].result.failed_peers
            values = set(averagers[i].tensors[0].tolist())
            # the shards the live members reduced hold their mean; the leaver's kept local values
            assert 2.0 in values and values <= {2.0, [1.0, 3.0][i]}
        nursery.cancel_scope.cancel()


async def test_a_leader_matching_ahead_admits_a_peer_that_declared_after_it_read_the_declarations():
    """Two peers start matching; the third (not the one that would lead) declares once they have
    read the declarations without it. Held open, the leader takes it in when it asks, and the
    group is whole; without holding it open the first two would have formed a pair."""
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 3)
        nodes.sort(key=lambda node: node.host.peer_id.to_bytes())  # the last one never leads
        averagers = make_averagers(nodes, [1.0, 2.0, 3.0], settle_time=0.1)
        due = trio.Event()
        formed = {}

        async def match(i, delay):
            await trio.sleep(delay)  # this peer saw the swarm's progress later than the others
            formed[i] = await averagers[i].find_group(2, hold_open=due)

        with trio.fail_after(10):
            async with trio.open_nursery() as matching:
                for i, delay in enumerate([0.0, 0.0, 0.6]):
                    matching.start_soon(match, i, delay)
        assert {len(f.group.members) for f in formed.values()} == {3}
        assert len({f.group.group_id for f in formed.values()}) == 1
        nursery.cancel_scope.cancel()


class Line(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8))


async def test_collaborative_peers_start_the_all_reduce_without_waiting_for_matchmaking():
    """Batches that take 20 ms (a model's compute, simulated), epochs of about 2 s, a settle time of
    0.4 s: the group forms while the epoch accumulates, so between the swarm reaching the target
    and the all-reduce starting there is next to nothing, not a settle time and a DHT round; the
    same for the state's round every ``average_state_every`` epochs."""
    settle = 0.4
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 3)
        target = torch.arange(8, dtype=torch.float32)
        waits, groups, state_waits = [], [], []

        async def train(node, seed):
            model = Line()
            optimizer = CollaborativeOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.5),
                node,
                prefix="ahead-train",
                target_batch_size=3 * 32 * 30,
                target_group_size=3,
                settle_time=settle,
                matchmaking_timeout=3.0,
                averaging_timeout=6.0,
                progress_interval=0.1,
                average_state_every=2,
                matching=MatchAhead(nursery),
            )
            state_rounds = []  # what the state averager's steps returned
            state_step = optimizer.state_averager.step

            async def recorded_state_step(*args, **kwargs):
                state_rounds.append(await state_step(*args, **kwargs))
                return state_rounds[-1]

            optimizer.state_averager.step = recorded_state_step
            generator = torch.Generator().manual_seed(seed)
            while optimizer.epoch < 4:
                noise = torch.randn(32, 8, generator=generator)
                loss = ((model.weight - target - noise) ** 2).mean()
                loss.backward()
                await trio.sleep(0.02)
                if await optimizer.step(32):
                    matchmaking_s = optimizer.last_round.matchmaking_s  # None: no group formed
                    if optimizer.epoch > 1 and matchmaking_s is not None:  # the first epoch had no rate to predict from
                        waits.append(optimizer.grads_ahead.last_wait_s + matchmaking_s)
                        groups.append(optimizer.last_averaging["group"])
                    state_timing = state_rounds[-1].timing if state_rounds else None
                    if optimizer.epoch % 2 == 0 and state_timing is not None:  # the state averaged too
                        state_waits.append(optimizer.state_ahead.last_wait_s + state_timing.matchmaking_s)
            return model

        with trio.fail_after(60):
            async with trio.open_nursery() as peers:
                for i, node in enumerate(nodes):
                    peers.start_soon(train, node, i)
        assert groups and all(size == 3 for size in groups), groups
        assert statistics.median(waits) < settle / 4, waits
        assert len(state_waits) == 6 and statistics.median(state_waits) < settle / 4, state_waits
        nursery.cancel_scope.cancel()


async def test_a_step_cancelled_while_it_waits_for_its_group_ends_the_matchmaking_ahead():
    """A lone peer matches ahead (it will find no one until the matchmaking deadline); its step is
    cancelled while it waits for the group: the matchmaking behind it ends with it, instead of
    running on (and, as a leader, forming a group nobody will average in)."""
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 1)
        averager = GroupAverager(
            [torch.zeros(8)], nodes[0], prefix="alone", target_group_size=2, min_group_size=2, matchmaking_timeout=30.0
        )
        ahead = MatchAhead(nursery).for_averager(averager, refresh_interval=0.1)
        matching = ahead.start(5, round_number=5)
        with trio.move_on_after(0.3):
            await ahead.take(5)
        with trio.fail_after(2):
            assert await matching.wait() is None
        nursery.cancel_scope.cancel()


async def test_a_reducer_banned_after_the_group_formed_ahead_does_not_set_our_values():
    """The group is formed ahead; before the step, peer 0 catches the third member lying (in the
    round still in flight) and bans it. Its shard of the group's round keeps peer 0's own values."""
    async with trio.open_nursery() as nursery:
        nodes, _ = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes, [1.0, 2.0, 6.0])
        formed = await find_groups(averagers)
        liar = nodes[2].host.peer_id
        averagers[0].all_reduce.checks.banned.ban(liar, "lied")
        results = {}

        async def step(i):
            results[i] = await averagers[i].step(weight=1.0, group=formed[i])

        with trio.fail_after(20):
            async with trio.open_nursery() as steps:
                for i in range(3):
                    steps.start_soon(step, i)
        group = formed[0].group
        index = next(i for i, m in enumerate(group.reducers) if m.peer_id == liar)
        ours = results[0].result
        start, end = ours.plan.shard_bounds(index)
        assert end > start and index in ours.local_shards and liar in ours.failed_peers
        mine = averagers[0].tensors[0]
        assert torch.equal(mine[start:end], torch.full((end - start,), 1.0))
        assert torch.equal(mine[:start], torch.full((start,), 3.0)) and torch.equal(
            mine[end:], torch.full((3000 - end,), 3.0)
        )
        assert torch.equal(averagers[1].tensors[0], torch.full((3000,), 3.0))  # peer 1 banned no one
        nursery.cancel_scope.cancel()
