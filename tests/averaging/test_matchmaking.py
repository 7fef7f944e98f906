"""Matchmaking through a real in-process DHT, Moshpit rounds, schemas, and state sharing."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from averaging.averager import GroupAverager
from averaging.group import MAX_GROUP_SIZE
from averaging.matchmaking import MatchmakingError
from averaging.matchmaking_rules import Candidate, grid_dimensions, propose_group, reached_directly
from dht.node import DHTNode
from peer import Identity, PeerAddress, PeerID, RemoteError, Router, open_peer_host


def test_grid_rule_pairs_like_a_hypercube():
    ids = [bytes([i]) * 20 for i in range(8)]
    candidates = [Candidate(i, True) for i in ids]
    assert grid_dimensions(8, 2) == 3
    seen_partners = {i: set() for i in ids}
    for round_number in range(3):
        groups = {propose_group(candidates, me, round_number, 2, 2).members for me in ids}
        assert all(len(g) == 2 for g in groups) and len(groups) == 4
        for group in groups:
            for member in group:
                seen_partners[member] |= set(group) - {member}
    assert all(len(partners) == 3 for partners in seen_partners.values())


def test_ragged_groups_merge_and_clients_never_lead():
    ids = [bytes([i]) * 20 for i in range(5)]
    candidates = [Candidate(i, can_lead=(i != ids[0])) for i in ids]
    proposals = {me: propose_group(candidates, me, 0, 2, 2) for me in ids}
    assert all(len(p.members) >= 2 for p in proposals.values())
    assert sorted(len(set(p.members)) for p in {p.members: p for p in proposals.values()}.values()) == [2, 3]
    assert all(p.leader != ids[0] for p in proposals.values())


def test_an_unreachable_leader_is_passed_over_without_moving_anyone_in_the_grid():
    ids = [bytes([i]) * 20 for i in range(8)]
    candidates = [Candidate(i, True) for i in ids]
    before = {me: propose_group(candidates, me, 0, 2, 2) for me in ids}
    dead = before[ids[1]].leader
    after = {me: propose_group(candidates, me, 0, 2, 2, unreachable={dead}) for me in ids if me != dead}
    for me, proposal in after.items():
        if dead in before[me].members:  # the dead leader's group: the next member leads, alone here
            assert proposal.leader != dead and dead not in proposal.members
            assert set(proposal.members) == set(before[me].members) - {dead}
        else:  # everyone else's group is the one the rest of the swarm computes
            assert proposal == before[me]


def test_a_short_digit_merges_whole_columns_into_full_groups_that_reach_the_exact_mean():
    for count, group_size in ((32, 16), (48, 16), (64, 16), (18, 3), (50, 5), (192, 8)):
        ids = [i.to_bytes(2, "big") * 10 for i in range(count)]
        candidates = [Candidate(i, True) for i in ids]
        values = {me: float(i * i % 17) for i, me in enumerate(ids)}
        mean = sum(values.values()) / count
        dimensions = grid_dimensions(count, group_size)
        for round_number in range(1, 1 + dimensions):  # (a 3-digit grid from its middle digit on)
            groups = {propose_group(candidates, me, round_number, group_size, 2).members for me in ids}
            assert sorted(m for g in groups for m in g) == sorted(ids)  # each peer in one group
            assert all(group_size * 3 // 4 <= len(g) <= MAX_GROUP_SIZE for g in groups), (count, round_number)
            for group in groups:
                average = sum(values[m] for m in group) / len(group)
                values.update(dict.fromkeys(group, average))
        assert all(abs(v - mean) < 1e-9 for v in values.values()), count
    # a short digit of a grid of 64s: merged no further than a leader can take
    candidates = [Candidate(i.to_bytes(2, "big") * 10, True) for i in range(96)]
    for round_number in range(2):
        groups = {propose_group(candidates, c.peer_id, round_number, 64, 2).members for c in candidates}
        assert sum(map(len, groups)) == 96 and max(map(len, groups)) <= MAX_GROUP_SIZE


async def open_swarm(nursery, count: int):
    """``count`` DHT nodes on 127.0.0.1, each bootstrapped from the first."""
    nodes = []

    async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED):
        async with DHTNode.open(initial_peers=initial) as node:
            task_status.started(node)
            await trio.sleep(math.inf)

    first = await nursery.start(run_node, [])
    nodes.append(first)
    for _ in range(count - 1):
        nodes.append(await nursery.start(run_node, [first.address]))
    return nodes


def make_averagers(nodes, values, **options):
    # These tests check exact averages: the plain mean (public swarms default to centered-clip,
    # which clips outliers of these few scalars, and in a pair moves a peer only as far as its own
    # updates allow; tests/averaging/test_robust_aggregation.py and test_small_groups.py cover it).
    options = {
        "prefix": "test",
        "matchmaking_timeout": 4.0,
        "sender_timeout": 3.0,
        "reducer_timeout": 5.0,
        "aggregation": "mean",
        **options,
    }
    return [GroupAverager([torch.tensor([float(v)])], node, **options) for node, v in zip(nodes, values, strict=True)]


async def step_all(averagers, results=None, **kwargs):
    results = results if results is not None else {}

    async def one(i, averager):
        results[i] = await averager.step(**kwargs)

    async with trio.open_nursery() as nursery:
        for i, averager in enumerate(averagers):
            nursery.start_soon(one, i, averager)
    return results


async def test_moshpit_rounds_converge_to_the_mean_with_pairs():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 8)
        values = [float(i * i) for i in range(8)]
        averagers = make_averagers(nodes, values, target_group_size=2, min_group_size=2)
        mean = sum(values) / len(values)
        spreads = []
        for _ in range(5):
            results = await step_all(averagers)
            assert all(len(r.group.members) == 2 for r in results.values())
            current = [a.tensors[0].item() for a in averagers]
            spreads.append(max(current) - min(current))
            assert sum(current) / len(current) == pytest.approx(mean, abs=1e-4)
        assert spreads[-1] < 1e-4 * (max(values) - min(values)), spreads
        nursery.cancel_scope.cancel()


async def test_group_of_four_averages_exactly_and_respects_target_size():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 4)
        averagers = make_averagers(nodes, [1.0, 2.0, 3.0, 6.0], target_group_size=4)
        started = trio.current_time()
        results = await step_all(averagers)
        elapsed = trio.current_time() - started
        for averaged in results.values():  # where the step's time went, as benchmarks/wan.py reports it
            timing = averaged.timing
            assert 0 < timing.allreduce_s and 0 < timing.matchmaking_s
            assert timing.matchmaking_s + timing.allreduce_s <= elapsed
        assert {len(r.group.members) for r in results.values()} == {4}
        assert len({r.group.group_id for r in results.values()}) == 1
        # each peer reduced its own shard of one plan (error feedback reads where parts fell)
        assert sorted(r.result.my_shard for r in results.values()) == [0, 1, 2, 3]
        plan = results[0].result.plan
        assert {r.result.plan for r in results.values()} == {plan} and plan.num_shards == 4
        for averager in averagers:
            assert averager.tensors[0].item() == pytest.approx(3.0, abs=1e-6)
        nursery.cancel_scope.cancel()


async def test_a_ragged_edge_merged_into_a_group_is_admitted_past_the_target_size():
    # 5 peers in groups of 4: the grid's second row holds one peer, merged into the first group,
    # so the leader expects 4 followers and must admit them all, not refuse the fifth as "full"
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 5)
        averagers = make_averagers(nodes, [1.0, 2.0, 3.0, 4.0, 10.0], target_group_size=4, min_group_size=2)
        with trio.fail_after(30):
            results = await step_all(averagers, timeout=20)
        assert {len(r.group.members) for r in results.values()} == {5}
        for averager in averagers:
            assert averager.tensors[0].item() == pytest.approx(4.0, abs=1e-6)
        nursery.cancel_scope.cancel()


async def test_mismatched_schemas_are_never_grouped():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 4)
        # (the exact mean of pairs of values that never change: see make_averagers)
        options = {"prefix": "mixed", "matchmaking_timeout": 3.0, "target_group_size": 4, "aggregation": "mean"}
        a = [GroupAverager([torch.ones(3) * i], node, **options) for i, node in enumerate(nodes[:2])]
        b = [GroupAverager([torch.ones(5) * (10 + i)], node, **options) for i, node in enumerate(nodes[2:])]
        results = await step_all(a + b)
        for r in results.values():
            assert len(r.group.members) == 2
        assert torch.allclose(a[0].tensors[0], torch.full((3,), 0.5))
        assert torch.allclose(b[0].tensors[0], torch.full((5,), 10.5))
        nursery.cancel_scope.cancel()


async def test_too_few_peers_raise_a_clear_error_after_the_deadline():
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        [averager] = make_averagers([node], [1.0], matchmaking_timeout=1.0)
        start = trio.current_time()
        with pytest.raises(MatchmakingError, match="within 1 s"):
            await averager.step()
        assert trio.current_time() - start < 2.5
        nursery.cancel_scope.cancel()


async def test_newcomer_loads_state_from_peers():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes[:2], [4.0, 8.0])
        await step_all(averagers)
        newcomer = GroupAverager([torch.tensor([0.0])], nodes[2], prefix="test")
        metadata = await newcomer.load_state_from_peers(timeout=5)
        assert newcomer.tensors[0].item() == pytest.approx(6.0)
        assert metadata["round"] == averagers[0].round
        assert newcomer.round == averagers[0].round
        nursery.cancel_scope.cancel()


async def test_a_peer_behind_in_rounds_catches_up_and_joins_the_group():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        averagers = make_averagers(nodes, [0.0, 3.0, 6.0], target_group_size=3, settle_time=0.2)
        results = {}

        async def one(i, round_number):
            results[i] = await averagers[i].step(round_number=round_number)

        async with trio.open_nursery() as steps:
            for i, round_number in enumerate([None, 7, 7]):  # these two have averaged before; the first is new
                steps.start_soon(one, i, round_number)
        assert {len(r.group.members) for r in results.values()} == {3}
        assert all(a.round == 8 for a in averagers)
        assert all(a.tensors[0].item() == pytest.approx(3.0) for a in averagers)
        nursery.cancel_scope.cancel()


async def test_a_follower_that_gives_up_is_not_left_in_the_group():
    from averaging.group import AveragingMode
    from averaging.matchmaking import Declaration, Matchmaker
    from peer import Identity, open_peer_host

    async with (
        open_peer_host(Identity.generate()) as leader_host,
        open_peer_host(Identity.generate()) as quitter,
        open_peer_host(Identity.generate()) as stayer,
    ):
        matchmaker = Matchmaker(leader_host, None, "p")

        def declaration(host):
            return Declaration(host.peer_id, host.listen_address, 1.0, AveragingMode.NODE, "schema", 0)

        expected = {quitter.peer_id, stayer.peer_id}
        result = {}

        async def lead():
            deadline = trio.current_time() + 1.5
            result["group"] = await matchmaker.lead(declaration(leader_host), expected, 3, 2, deadline)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            while not matchmaker.gathering:  # the leader has opened its invitation
                await trio.sleep(0)
            join = {**declaration(quitter).to_wire(), "patience": 10.0}
            async with trio.open_nursery() as dying:  # its process dies while waiting for the answer
                dying.start_soon(quitter.call, leader_host.listen_address, "avg.join.p", join)
                await trio.sleep(0.3)
                dying.cancel_scope.cancel()
            reply = await stayer.call(
                leader_host.listen_address, "avg.join.p", {**declaration(stayer).to_wire(), "patience": 10.0}
            )
        members = {m.peer_id for m in result["group"].members}
        assert members == {leader_host.peer_id, stayer.peer_id}
        assert {m[0] for m in reply.body["members"]} == {p.to_bytes() for p in members}


async def test_a_stranger_joining_with_a_tiny_patience_does_not_close_the_group_before_its_members_come():
    """Any peer can join any leader: if its claimed patience counted, one peer joining with a
    millisecond of it would close every group in the swarm at once, without its members."""
    from averaging.group import AveragingMode
    from averaging.matchmaking import Declaration, Matchmaker
    from peer import Identity, RemoteError, open_peer_host

    async with (
        open_peer_host(Identity.generate()) as leader_host,
        open_peer_host(Identity.generate()) as stranger,
        open_peer_host(Identity.generate()) as member,
    ):
        matchmaker = Matchmaker(leader_host, None, "p")

        def declaration(host):
            return Declaration(host.peer_id, host.listen_address, 1.0, AveragingMode.NODE, "schema", 3)

        result = {}

        async def lead():
            deadline = trio.current_time() + 10.0  # (it ends when the member joins)
            result["group"] = await matchmaker.lead(declaration(leader_host), {member.peer_id}, 3, 2, deadline)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            while not matchmaker.gathering:
                await trio.sleep(0)
            join = {**declaration(stranger).to_wire(), "patience": 0.3}
            with pytest.raises(RemoteError, match="did not form within the joiner's patience"):
                await stranger.call(leader_host.listen_address, "avg.join.p", join)
            await trio.sleep(0.3)
            assert matchmaker.gathering  # still waiting for the member it expects
            await member.call(
                leader_host.listen_address, "avg.join.p", {**declaration(member).to_wire(), "patience": 5.0}
            )
        assert {m.peer_id for m in result["group"].members} == {leader_host.peer_id, member.peer_id}


async def test_a_leader_left_behind_stops_waiting_once_the_next_round_asks_for_it():
    """A peer whose epoch ended late leads what its grid left of its group: members that matched
    already never come. Two peers asking it to lead the next round end that wait at once (one
    asker would not), long before its deadline, so it can catch up with them."""
    from averaging.group import AveragingMode
    from averaging.matchmaking import Declaration, Matchmaker

    async with (
        open_peer_host(Identity.generate()) as leader_host,
        open_peer_host(Identity.generate()) as first,
        open_peer_host(Identity.generate()) as second,
    ):
        matchmaker = Matchmaker(leader_host, None, "p")

        def declaration(host, round_number):
            return Declaration(host.peer_id, host.listen_address, 1.0, AveragingMode.NODE, "schema", round_number)

        gone = {PeerID(bytes([n]) * 20) for n in (7, 8)}  # matched elsewhere: they never ask
        ended = {}

        async def lead():
            with pytest.raises(MatchmakingError, match="the next round's peers ask for us"):
                found = frozenset({*gone, first.peer_id, second.peer_id})  # (the read that made us lead)
                await matchmaker.lead(declaration(leader_host, 5), gone, 3, 2, trio.current_time() + 10.0, known=found)
            ended["after"] = trio.current_time() - started

        async def ask(host):
            join = {**declaration(host, 6).to_wire(), "patience": 10.0}
            with pytest.raises(RemoteError, match="the joiner is a round ahead of this group"):
                await host.call(leader_host.listen_address, "avg.join.p", join)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lead)
            while not matchmaker.gathering:
                await trio.sleep(0)
            await ask(first)
            await ask(first)  # (the same peer again)
            await trio.sleep(0.5)
            assert matchmaker.gathering and not ended  # one asker is a claim: still waiting
            await ask(second)
        assert ended["after"] < 3.0, ended


async def test_averagers_on_one_peer_share_its_all_reduce_and_need_their_own_prefixes():
    """As an optimizer averages gradients and state side by side: distinct prefixes both work at
    once, while a second averager on a taken prefix fails at construction (it used to be built
    without its join handler, so its peers' joins reached the first averager instead)."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        grads = make_averagers(nodes, [1.0, 3.0], prefix="run.grads", target_group_size=2)
        state = make_averagers(nodes, [10.0, 30.0], prefix="run.state", target_group_size=2)
        assert grads[0].all_reduce is state[0].all_reduce  # one avg.reduce handler per peer
        with pytest.raises(ValueError, match="already averages under prefix 'run.grads'"):
            GroupAverager([torch.zeros(1)], nodes[0], prefix="run.grads")
        await step_all(grads + state)
        assert [a.tensors[0].item() for a in grads + state] == pytest.approx([2.0, 2.0, 20.0, 20.0])
        nursery.cancel_scope.cancel()


class DiesOnFirstJoin(Router):
    """A router whose peer vanishes (host, DHT node, everything) when the first follower asks to
    join its group: a leader that dies after the group formed around it, before announcing it."""

    def __init__(self, *peer_scopes: trio.CancelScope):
        super().__init__()
        self.peer_scopes = peer_scopes

    def add_unary(self, name, handler) -> None:
        if name.startswith("avg.join."):

            async def dies(request):
                for scope in self.peer_scopes:
                    scope.cancel()
                await trio.sleep_forever()

            handler = dies
        super().add_unary(name, handler)


async def step_until_cancelled(scope: trio.CancelScope, averager) -> None:
    with scope:
        await averager.step()


async def test_a_leader_that_dies_before_announcing_costs_nobody_the_round():
    # The grid rule's leader is the lowest peer ID of the group: that one dies.
    identities = sorted((Identity.generate() for _ in range(5)), key=lambda i: i.peer_id.to_bytes())
    nodes = []

    async def run_node(identity, router, scope, initial, task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            async with (
                open_peer_host(identity, router=router) as host,
                DHTNode.open(host=host, initial_peers=initial) as node,
            ):
                task_status.started(node)
                await trio.sleep(math.inf)

    async with trio.open_nursery() as nursery:
        leader_scope, leader_step_scope = trio.CancelScope(), trio.CancelScope()
        bootstrap = await nursery.start(run_node, identities[1], Router(), trio.CancelScope(), [])
        nodes.append(
            await nursery.start(
                run_node,
                identities[0],
                DiesOnFirstJoin(leader_scope, leader_step_scope),
                leader_scope,
                [bootstrap.address],
            )
        )
        nodes.append(bootstrap)
        for identity in identities[2:]:
            nodes.append(await nursery.start(run_node, identity, Router(), trio.CancelScope(), [bootstrap.address]))
        values = [100.0, 1.0, 2.0, 3.0, 6.0]
        averagers = make_averagers(nodes, values, target_group_size=5, settle_time=0.2)
        results = {}
        with trio.fail_after(8):
            async with trio.open_nursery() as steps:
                steps.start_soon(step_until_cancelled, leader_step_scope, averagers[0])
                await step_all(averagers[1:], results)
        healthy = {node.host.peer_id for node in nodes[1:]}
        for i, averager in enumerate(averagers[1:]):
            assert {m.peer_id for m in results[i].group.members} == healthy
            assert averager.tensors[0].item() == pytest.approx(3.0)
        nursery.cancel_scope.cancel()


async def test_a_peer_that_leaves_is_neither_elected_nor_waited_for_in_the_next_round():
    """A copy of examples/embed_averager.py that ended left its declaration behind: the others'
    leader waited for it until the deadline, every round, until the declaration expired."""
    # The leaver has the highest ID: a follower, whom the leader would wait for.
    identities = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id.to_bytes())
    scopes = [trio.CancelScope() for _ in identities]

    async def run_node(index, initial, task_status=trio.TASK_STATUS_IGNORED):
        with scopes[index]:
            async with DHTNode.open(identity=identities[index], initial_peers=initial) as node:
                task_status.started(node)
                await trio.sleep(math.inf)

    async with trio.open_nursery() as nursery:
        nodes = [await nursery.start(run_node, 0, [])]
        nodes += [await nursery.start(run_node, i, [nodes[0].address]) for i in (1, 2)]
        averagers = make_averagers(nodes, [1.0, 2.0, 6.0], target_group_size=3, settle_time=0.2)
        results = await step_all(averagers)
        assert {len(r.group.members) for r in results.values()} == {3}
        await averagers[2].leave()
        scopes[2].cancel()
        start = trio.current_time()
        results = await step_all(averagers[:2])
        assert trio.current_time() - start < 1.5  # the deadline is 4 s
        assert {len(r.group.members) for r in results.values()} == {2}
        nursery.cancel_scope.cancel()


def test_round_numbers_are_claims_that_move_a_peer_one_round_at_most():
    from averaging.matchmaking import round_to_join

    assert round_to_join(5, [5, 6, 10**12]) == 6  # one round ahead: catch up; far ahead: ignored
    assert round_to_join(5, [4, 10**12]) == 5
    assert round_to_join(0, [7, 7, 10**12]) == 7  # a newcomer joins where most peers are
    assert round_to_join(0, [0, 10**12]) == 0  # the lower median: one liar cannot move it
    assert round_to_join(0, []) == 0


def test_a_declaration_more_than_a_round_away_is_out_of_reach_unless_a_newcomers():
    from averaging.matchmaking_rules import in_reach

    assert in_reach(5, 4) and in_reach(5, 5) and in_reach(5, 6)  # one behind catches up; one ahead, we do
    assert not in_reach(5, 3) and not in_reach(5, 7) and not in_reach(5, 10**12)
    assert in_reach(5, 0)  # a newcomer joins where the swarm is


def test_a_view_is_settled_once_everyone_of_the_last_one_declared_the_round():
    from averaging.matchmaking import Declaration
    from averaging.matchmaking_rules import view_settled

    peers = [Identity.generate().peer_id for _ in range(3)]

    def declared(*rounds):
        return {p: Declaration(p, None, 1.0, "node", "s", r) for p, r in zip(peers, rounds, strict=False)}

    last = frozenset(peers[:2])
    assert view_settled(last, declared(5, 5), 5)
    assert view_settled(last, declared(5, 6, 5), 5)  # one a round ahead, and a newcomer: not waited for
    assert not view_settled(last, declared(5, 4), 5)  # its declaration is still the last round's
    assert not view_settled(last, declared(5), 5)  # one of the last view is missing (it may have left)
    assert not view_settled(frozenset(), declared(5, 5), 5)  # no last view: the settle time is waited out


async def test_a_swarm_that_stays_as_it_was_matches_without_waiting_out_the_settle_time():
    """Four peers, a long settle time: the first round waits it out; the next ones, whose views
    hold everyone the last one did, match as soon as every peer has declared; once a peer has
    left, the settle time is waited out again."""
    settle = 1.5
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 4)
        averagers = make_averagers(
            nodes, [1.0, 2.0, 3.0, 6.0], target_group_size=4, settle_time=settle, matchmaking_timeout=10.0
        )
        results = await step_all(averagers)
        assert all(r.timing.matchmaking_s >= settle for r in results.values())
        results = await step_all(averagers)
        assert {len(r.group.members) for r in results.values()} == {4}
        timings = [r.timing for r in results.values()]
        assert all(t.matchmaking_s < settle for t in timings), timings
        assert all(a.tensors[0].item() == pytest.approx(3.0) for a in averagers)
        await averagers[3].leave()
        results = await step_all(averagers[:3])
        assert {len(r.group.members) for r in results.values()} == {3}
        assert all(r.timing.matchmaking_s >= settle for r in results.values())
        nursery.cancel_scope.cancel()


def test_one_liar_declaring_a_far_round_strands_no_one():
    from averaging.matchmaking_errors import MatchmakingError, OutOfReach, no_group

    # a group too small with a liar's round 10^6 beside honest rounds 7 and 8: not stranded, not moved
    error = no_group("no group", 7, [10**6], [7, 8, 10**6], alone=False)
    assert type(error) is MatchmakingError
    # left behind by the whole swarm: stranded, at the swarm's (lower median) round
    error = no_group("no group", 1, [5, 5, 6], [5, 5, 6], alone=False)
    assert isinstance(error, OutOfReach) and error.swarm_round == 5


async def test_peers_that_send_in_different_codecs_declare_different_schemas():
    """A plan's parts count their bytes in the round's codec, so members sending in different
    codecs would cut the round differently and refuse each other's parts: they never meet."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        codecs = ["none", "float16", "blockwise_8bit", "uint8", "topk_2bit"]
        schemas = {
            codec: GroupAverager([torch.zeros(3)], node, prefix=f"codecs-{index}", codec=codec).schema
            for index, codec in enumerate(codecs)
        }
        assert len(set(schemas.values())) == len(codecs)
        again = GroupAverager([torch.zeros(3)], node, prefix="codecs-again", codec="uint8").schema
        assert again == schemas["uint8"]
        nursery.cancel_scope.cancel()


def test_a_group_is_led_by_a_member_reached_directly_when_it_has_one():
    """Its whole group dials the leader at once, and a peer behind NAT is reached through circuits
    its relay caps per peer: ranked first, it leads only a group of peers behind NAT like it."""
    ids = [bytes([i]) * 20 for i in range(4)]
    behind_nat = {ids[0], ids[1]}
    candidates = [Candidate(i, True, direct=i not in behind_nat) for i in ids]
    assert {propose_group(candidates, me, 0, 4, 2).leader for me in ids} == {ids[2]}
    assert propose_group(candidates, ids[0], 0, 4, 2, unreachable={ids[2], ids[3]}).leader == ids[0]
    relayed = [Candidate(i, True, direct=False) for i in ids]
    assert {propose_group(relayed, me, 0, 4, 2).leader for me in ids} == {ids[0]}
    assert reached_directly(PeerAddress.parse("10.0.0.1:4000")) and not reached_directly(None)
    relay = "10.0.0.1:4000/2BDPhm6jnSsaZzH6babYdMQgwipK/relay/2JfXpTjFn2Yy5wAULvMjy1pCzR8b"
    assert not reached_directly(PeerAddress.parse(relay))
