"""Peers whose reads of the declarations differ, or come back at different times, still form one
group without reading the declarations over and over: a leader whose read missed a member that
its followers' reads found looks again instead of closing without it; a follower that asks before
its leader has chosen to lead waits for the choice; a peer whose group cannot form reads less and
less often."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import trio

from averaging.averager import GroupAverager
from averaging.cells import Cells
from averaging.group import AveragingMode
from averaging.joins import NotLeading
from averaging.matchmaking import Declaration, Matchmaker, MatchmakingError
from averaging.matchmaking_errors import OutOfReach
from dht import DHTConfig
from dht.peer_dictionary import subkey_peer
from dht.records import pack
from peer import PeerID, Router
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm


class MissesReads:
    """A DHT node whose first ``times`` reads of a dictionary that holds one writer's entry miss
    it, as a read does when that writer's store has not yet reached the holders this read asked
    (``math.inf``: the holders it asks stay without that store for the round)."""

    def __init__(self, node, missing: PeerID, times: float = 1):
        self._node, self._missing, self._times, self.misses = node, missing, times, 0

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def get(self, key, latest: bool = False):
        found = await self._node.get(key, latest=latest)
        if self.misses < self._times and found is not None and isinstance(found.value, dict):
            kept = {raw: item for raw, item in found.value.items() if subkey_peer(raw) != self._missing}
            if len(kept) < len(found.value):
                self.misses += 1
                return dataclasses.replace(found, value=kept)
        return found


async def form_groups(matchmakers: dict, settle: dict) -> tuple[dict, dict]:
    """Every node's matchmaker forms a group of 3 (at least 2) at once, each after its ``settle``
    time: the members each ended with, and how long each took."""
    groups, took = {}, {}

    async def form(node) -> None:
        started = trio.current_time()
        match = await matchmakers[node].form_group(
            declaration_of(node), target_group_size=3, min_group_size=2, timeout=10.0, settle_time=settle[node]
        )
        groups[node], took[node] = {member.peer_id for member in match.group.members}, trio.current_time() - started

    async with trio.open_nursery() as nursery:
        for node in matchmakers:
            nursery.start_soon(form, node)
    return groups, took


class CountsReads:
    """A DHT node that counts the reads made through it."""

    def __init__(self, node):
        self._node, self.reads = node, 0

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def get(self, key, latest: bool = False):
        self.reads += 1
        return await self._node.get(key, latest=latest)


class SlowStores:
    """A DHT node whose stores take ``delay`` seconds longer, as across the internet, where a
    store's lookup takes several round trips."""

    def __init__(self, node, delay: float):
        self._node, self.delay = node, delay

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def store(self, *args, **kwargs):
        await trio.sleep(self.delay)
        return await self._node.store(*args, **kwargs)


def declaration_of(node) -> Declaration:
    return Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)


async def test_followers_that_ask_before_their_leader_chose_wait_instead_of_reading_again(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=6), 3) as swarm:
        leader, *followers = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        dhts = {node: CountsReads(node) for node in swarm.nodes}
        settle = {leader: 4.0, followers[0]: 1.5, followers[1]: 1.5}  # the leader reads last
        groups = {}

        async def form(node) -> None:
            match = await Matchmaker(node.host, dhts[node], "views").form_group(
                declaration_of(node), target_group_size=3, min_group_size=2, timeout=10.0, settle_time=settle[node]
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            for node in swarm.nodes:
                nursery.start_soon(form, node)
        assert groups == {node: {n.host.peer_id for n in swarm.nodes} for node in swarm.nodes}
        # one read each (a second one if the first came before the others' declarations landed)
        assert all(dhts[node].reads <= 2 for node in followers), [dhts[node].reads for node in followers]


async def test_a_peer_lets_the_others_declarations_land_as_long_as_its_own_store_took(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=8), 3) as swarm:
        leader, early, late = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        # Stores take 2 s, the late peer's 3.5 s. Reading the default 0.5 s after its own store
        # landed, the leader would see no late peer and close the group once the early one joined.
        dhts = {leader: SlowStores(leader, 2.0), early: SlowStores(early, 2.0), late: SlowStores(late, 3.5)}
        groups = {}

        async def form(node) -> None:
            match = await Matchmaker(node.host, dhts[node], "views").form_group(
                declaration_of(node), target_group_size=3, min_group_size=2, timeout=20.0
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            for node in swarm.nodes:
                nursery.start_soon(form, node)
        assert groups == {node: {n.host.peer_id for n in swarm.nodes} for node in swarm.nodes}


class CensusTimesOut:
    """A DHT node whose lookups of a census's nearest nodes never finish within its deadline, as a
    newcomer's do when churn has left its routing table full of departed peers."""

    def __init__(self, node):
        self._node = node

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def nearest_node_ids(self, target: int, k: int | None = None) -> list[int]:
        await trio.sleep_forever()


@pytest.mark.parametrize("census_comes_in", [True, False])
async def test_a_peer_that_counts_four_times_fewer_cells_than_the_swarm_finds_its_crowd(
    autojump_clock, census_comes_in
):
    """It matchmakes in one cell (the single key), the swarm around it in four: alone in its key,
    it looks at the counts near its own, finds its cell of the swarm's four and averages there;
    also when its census never comes in and it does not know how large the swarm is (waiting for
    a count first, newcomers in a swarm of 128 would gather in the single key until they are no
    sparse cell, and average among themselves for the rest of the run)."""
    async with open_sim_swarm(SimNetwork(seed=9), 12) as swarm:
        layout = Cells("crowd", 4)
        cell_of = {node: layout.cell_of(node.host.peer_id.to_bytes(), 1) for node in swarm.nodes}
        biggest = max(set(cell_of.values()), key=list(cell_of.values()).count)
        loner, *crowd = [node for node in swarm.nodes if cell_of[node] == biggest]
        assert len(crowd) >= 2
        dhts = {node: node for node in swarm.nodes}
        if not census_comes_in:
            dhts[loner] = CensusTimesOut(loner)
        groups = {}

        async def form(node, cells: Cells, settle: float) -> None:
            matchmaker = Matchmaker(node.host, dhts[node], "crowd")
            matchmaker.cells = cells
            match = await matchmaker.form_group(
                declaration_of(node),
                target_group_size=len(crowd) + 1,
                min_group_size=2,
                timeout=20.0,
                settle_time=settle,
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(form, loner, Cells("crowd", 1), 0.5)
            for node in crowd:  # (they read once the loner has looked around)
                nursery.start_soon(form, node, layout, 4.0)
        everyone = {node.host.peer_id for node in [loner, *crowd]}
        assert groups == {node: everyone for node in [loner, *crowd]}


async def test_a_peer_in_a_sparse_cell_of_the_swarms_count_stays_despite_stragglers_in_the_single_key(autojump_clock):
    """Its cell of the swarm's four holds two others; three stragglers still declare in the single
    key (one cell), which its probe reads: more peers than its cell, but a quarter of the swarm's
    cells shows a larger swarm, so it stays and averages with its cell."""
    async with open_sim_swarm(SimNetwork(seed=9), 12) as swarm:
        layout = Cells("crowd", 4)
        cell_of = {node: layout.cell_of(node.host.peer_id.to_bytes(), 1) for node in swarm.nodes}
        biggest = max(set(cell_of.values()), key=list(cell_of.values()).count)
        me, *cell = [node for node in swarm.nodes if cell_of[node] == biggest][:3]
        stragglers = [node for node in swarm.nodes if cell_of[node] != biggest][:3]
        for node in stragglers:
            straggling = Matchmaker(node.host, node, "crowd")
            await straggling.declare(declaration_of(node), 20.0)  # (in the single key)
        groups = {}

        async def form(node, settle: float) -> None:
            matchmaker = Matchmaker(node.host, node, "crowd")
            matchmaker.cells = layout
            match = await matchmaker.form_group(
                declaration_of(node), target_group_size=8, min_group_size=2, timeout=20.0, settle_time=settle
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(form, me, 0.5)
            for node in cell:  # (they read once it has looked around)
                nursery.start_soon(form, node, 4.0)
        everyone = {node.host.peer_id for node in [me, *cell]}
        assert groups == {node: everyone for node in [me, *cell]}


async def test_a_peer_whose_group_cannot_form_reads_less_and_less_often(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=7), 4) as swarm:
        gone, survivor = sorted(swarm.nodes[1:3], key=lambda node: node.host.peer_id.to_bytes())
        await Matchmaker(gone.host, gone, "views").declare(declaration_of(gone), 20.0)
        swarm.leave(swarm.nodes.index(gone))  # its declaration outlives it: elected leader, it never answers
        survivor = CountsReads(survivor)
        with pytest.raises(MatchmakingError):
            await Matchmaker(survivor.host, survivor, "views").form_group(
                declaration_of(survivor), target_group_size=2, min_group_size=2, timeout=12.0, settle_time=0.5
            )
        # pauses of 0.05, 0.1, ... 1 s between reads (each takes a few round trips): 6 here, 14 without them
        assert survivor.reads <= 9, survivor.reads


async def test_a_leader_whose_read_missed_a_member_waits_for_it_when_a_joiner_names_it(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=5), 3) as swarm:
        leader, early, late = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        lagging = MissesReads(leader, late.host.peer_id)
        matchmakers = {
            leader: Matchmaker(leader.host, lagging, "views"),
            early: Matchmaker(early.host, early, "views"),
            late: Matchmaker(late.host, late, "views"),
        }
        # the late peer reads and joins after the early one: before it asks, the leader has a
        # joiner for every member its own view expects
        settle = {leader: 0.5, early: 0.5, late: 1.5}
        groups = {}

        async def form(node) -> None:
            me = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)
            match = await matchmakers[node].form_group(
                me, target_group_size=3, min_group_size=2, timeout=10.0, settle_time=settle[node]
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            for node in matchmakers:
                nursery.start_soon(form, node)
        assert lagging.misses == 1  # the leader's first view lacked the late peer
        everyone = {node.host.peer_id for node in matchmakers}
        assert groups == {node: everyone for node in matchmakers}


def test_members_a_joiner_names_are_claims_the_leader_looks_up_once():
    from averaging.gathering import Gathering

    def declaration(byte: int) -> Declaration:
        return Declaration(PeerID(bytes([byte]) * 20), None, 1.0, AveragingMode.NODE, "s", 1)

    me, honest, made_up = declaration(1), declaration(2), PeerID(bytes([9]) * 20)
    gathering = Gathering(me, {honest.peer_id}, target=4)
    gathering.admit(honest, gives_up_at=10.0, view=[me.peer_id, honest.peer_id, made_up])
    assert gathering.unconfirmed == {made_up} and gathering.complete
    gathering.confirm(set())  # the leader's own read does not find it: not waited for
    assert gathering.unconfirmed == set() and gathering.expected == {honest.peer_id} and gathering.complete
    gathering.withdraw(honest.peer_id)
    gathering.admit(honest, gives_up_at=10.0, view=[made_up])  # named again: not looked up again
    assert gathering.unconfirmed == set()


async def test_a_join_at_a_peer_that_follows_another_is_refused_at_once(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=5), 3) as swarm:
        leader, middle, late = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        # the late peer's first read misses the leader: it asks the middle peer, which follows
        # the leader by then; told at once, it reads again and joins the leader's group
        lagging = MissesReads(late, leader.host.peer_id)
        matchmakers = {
            leader: Matchmaker(leader.host, leader, "views"),
            middle: Matchmaker(middle.host, middle, "views"),
            late: Matchmaker(late.host, lagging, "views"),
        }
        settle = {leader: 0.5, middle: 0.5, late: 0.6}
        groups, took = await form_groups(matchmakers, settle)
        assert lagging.misses == 1
        everyone = {node.host.peer_id for node in matchmakers}
        assert groups == {node: everyone for node in matchmakers}
        # settles as long as its store took, is refused, reads again: not the followers' whole patience (~4.7 s)
        assert max(took.values()) < 2.5, took


async def test_a_peer_whose_reads_miss_the_leader_joins_it_through_the_peer_that_follows_it(autojump_clock):
    """The late peer's view elects the middle peer, which follows the leader: told whom the middle
    peer follows (and where), it asks the leader, which admits it, instead of asking the middle
    peer again and again while the leader waits for it (reading again would not help: its reads
    never hold the leader's declaration)."""
    async with open_sim_swarm(SimNetwork(seed=5), 3) as swarm:
        leader, middle, late = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        matchmakers = {
            leader: Matchmaker(leader.host, leader, "views"),
            middle: Matchmaker(middle.host, middle, "views"),
            late: Matchmaker(late.host, MissesReads(late, leader.host.peer_id, times=math.inf), "views"),
        }
        settle = {leader: 0.5, middle: 0.5, late: 0.6}
        groups, took = await form_groups(matchmakers, settle)
        everyone = {node.host.peer_id for node in matchmakers}
        assert groups == {node: everyone for node in matchmakers}
        assert max(took.values()) < 2.5, took


async def test_joiners_claims_cost_the_leader_at_most_its_confirm_reads_a_round(autojump_clock):
    from averaging.gathering import MAX_CONFIRMS

    async with open_sim_swarm(SimNetwork(seed=8), 3) as swarm:
        leader, follower, liar = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        counted = CountsReads(leader)
        leading = Matchmaker(leader.host, counted, "views")
        await Matchmaker(liar.host, liar, "views").declare(declaration_of(liar), 20.0)
        groups = {}

        async def form(node, matchmaker, settle: float) -> None:
            match = await matchmaker.form_group(
                declaration_of(node), target_group_size=8, min_group_size=2, timeout=10.0, settle_time=settle
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async def lie(number: int) -> None:
            await trio.sleep(0.7 + 0.4 * number)  # after the leader's read, each after the last confirm
            made_up = [PeerID(bytes([number + 1]) * 20).to_bytes()]
            body = {**declaration_of(liar).to_wire(), "patience": 8.0, "view": made_up}
            with trio.move_on_after(9.0):
                await liar.host.call(leader.host.listen_address, "avg.join.views", body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(form, leader, leading, 0.5)
            nursery.start_soon(form, follower, Matchmaker(follower.host, follower, "views"), 3.5)
            for number in range(5):
                nursery.start_soon(lie, number)
        assert groups[leader] == groups[follower] == {node.host.peer_id for node in swarm.nodes}
        # its own read, then the capped confirms: fewer than the five claims (six reads without a cap)
        assert MAX_CONFIRMS < 5 and counted.reads <= 1 + MAX_CONFIRMS, counted.reads


async def test_late_peers_whose_view_elects_a_peer_that_matched_already_form_a_group_of_the_rest(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=9), 4) as swarm:
        first, second, *late = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        groups, took = {}, {}

        async def form(node, target: int) -> None:
            started = trio.current_time()
            match = await Matchmaker(node.host, node, "views").form_group(
                declaration_of(node), target_group_size=target, min_group_size=2, timeout=10.0, settle_time=0.5
            )
            groups[node], took[node] = {member.peer_id for member in match.group.members}, trio.current_time() - started

        async with trio.open_nursery() as nursery:  # the two first peers match each other and are done
            nursery.start_soon(form, first, 2)
            nursery.start_soon(form, second, 2)
        # the late peers read all four declarations: their grid elects the first peer, which
        # declines (it matched), then the second; the late peers form a group of their own
        async with trio.open_nursery() as nursery:
            for node in late:
                nursery.start_soon(form, node, 4)
        assert groups[late[0]] == groups[late[1]] == {node.host.peer_id for node in late}
        assert max(took[node] for node in late) < 2.0, took  # one join per declined leader, no pauses


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_peer_that_declines_every_join_costs_no_one_the_round(autojump_clock, seed):
    async with open_sim_swarm(SimNetwork(seed=seed), 9) as swarm:
        hostile, *honest = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())

        async def decline(request):  # elected leader of the first group, it claims to have matched
            raise NotLeading("this peer has its group for round 1")

        hostile.host.router.add_unary("avg.join.views", decline)
        await Matchmaker(hostile.host, hostile, "views", router=Router()).declare(declaration_of(hostile), 20.0)
        groups = {}

        async def form(node) -> None:
            match = await Matchmaker(node.host, node, "views").form_group(
                declaration_of(node), target_group_size=3, min_group_size=2, timeout=10.0, settle_time=0.5
            )
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            for node in honest:
                nursery.start_soon(form, node)
        assert set(groups) == set(honest)
        assert all(hostile.host.peer_id not in group for group in groups.values())


async def test_a_peer_left_two_rounds_behind_costs_the_others_no_round(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=4), 4) as swarm:
        behind, *current = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        groups, failures = {}, {}

        async def form(node, round_number: int) -> None:
            me = dataclasses.replace(declaration_of(node), round=round_number)
            try:
                match = await Matchmaker(node.host, node, "views").form_group(
                    me, target_group_size=4, min_group_size=2, timeout=10.0, settle_time=0.5
                )
            except MatchmakingError as error:
                failures[node] = error
                return
            groups[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(form, behind, 1)  # ranks first: the others' grid would elect it
            for node in current:
                nursery.start_soon(form, node, 3)
        assert groups == {node: {n.host.peer_id for n in current} for node in current}
        assert list(failures) == [behind] and "too far from our 1" in str(failures[behind])
        assert isinstance(failures[behind], OutOfReach) and failures[behind].swarm_round == 3


async def test_a_bare_averager_left_behind_joins_the_swarms_round_after_one_lost_step(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=4), 4) as swarm:
        nodes = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        averagers = [
            GroupAverager([torch.tensor([float(i)])], node, prefix="views", target_group_size=4, aggregation="mean")
            for i, node in enumerate(nodes)
        ]
        for averager in averagers[1:]:
            averager.round = 5  # the others have averaged five rounds; the first, one
        averagers[0].round = 1
        lost = []

        async def step(averager) -> None:
            try:
                await averager.step(timeout=10.0)
            except OutOfReach:
                lost.append(averager)

        async with trio.open_nursery() as nursery:
            for averager in averagers:
                nursery.start_soon(step, averager)
        assert lost == [averagers[0]] and averagers[0].round == 5
        async with trio.open_nursery() as nursery:  # the next round: all four in one group
            for averager in averagers:
                nursery.start_soon(step, averager)
        assert lost == [averagers[0]]
        assert all(averager.tensors[0].item() == pytest.approx(1.5) for averager in averagers)
        assert {averager.round for averager in averagers} == {7}


async def test_a_follower_across_the_world_hears_its_leaders_answer_in_time(autojump_clock):
    """A leader holding its group open for latecomers answers before its follower's patience runs
    out, counted from when the join reached it: the answer must still cross back before the
    follower stops listening. With 150 ms each way (Sydney to London) a margin of one crossing
    made the follower give up just before the answer came, while the leader formed the group with
    a member that was gone."""
    network = SimNetwork(seed=9, side=1e-3, access_delay=(0.075, 0.075))  # every one-way delay: 0.15 s
    async with open_sim_swarm(network, 2) as swarm:
        averagers = [
            GroupAverager([torch.zeros(4)], node, prefix="far", target_group_size=3, min_group_size=2)
            for node in swarm.nodes
        ]
        groups: dict = {}
        never = trio.Event()  # the leader stays open for latecomers until its follower would give up

        async def match(index: int) -> None:
            groups[index] = await averagers[index].find_group(timeout=10.0, hold_open=never)

        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(match, index)
        assert groups[0].group.group_id == groups[1].group.group_id and len(groups[0].group.members) == 2


async def test_a_declaration_lands_once_most_holders_hold_it_not_when_a_departed_one_times_out(autojump_clock):
    # A holder that left answers nothing. A declaration that waited for every holder waited out
    # that request's deadline, and then let the others' declarations settle as long (in the
    # simulated churning swarm of 32 peers, calm rounds' declarations took 2-8 s and groups formed
    # at the deadline); readers find it on the holders that took it.
    config = DHTConfig()
    async with open_sim_swarm(SimNetwork(seed=9), 12, config=config) as swarm:
        node = swarm.nodes[0]
        matchmaker, me = Matchmaker(node.host, node, "landing"), declaration_of(node)
        await matchmaker.declare(me, timeout=30.0)  # (the key's holders are remembered from here)
        key = pack(matchmaker.key(me.round))
        holders = [index for index in swarm.alive()[1:] if swarm.nodes[index].records.found(key) is not None]
        assert len(holders) >= 8
        swarm.leave(holders[0])
        took = await matchmaker.declare(me, timeout=30.0)
        assert took < config.rpc_timeout / 2, took
        reader = swarm.nodes[holders[1]]
        seen = await Matchmaker(reader.host, reader, "landing").read_candidates(declaration_of(reader))
        assert node.host.peer_id in seen
