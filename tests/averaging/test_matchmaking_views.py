"""Peers whose reads of the declarations differ still form one group: a leader whose read missed a
member that its followers' reads found looks again instead of closing without it."""

from __future__ import annotations

import dataclasses

import trio

from averaging.group import AveragingMode
from averaging.matchmaking import Declaration, Matchmaker
from dht.peer_dictionary import subkey_peer
from peer import PeerID
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm


class MissesOnFirstRead:
    """A DHT node whose first read of a dictionary misses one writer's entry, as a read does when
    that writer's store has not yet reached the holders this read asked."""

    def __init__(self, node, missing: PeerID):
        self._node, self._missing, self.misses = node, missing, 0

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def get(self, key, latest: bool = False):
        found = await self._node.get(key, latest=latest)
        if self.misses == 0 and found is not None and isinstance(found.value, dict):
            kept = {raw: item for raw, item in found.value.items() if subkey_peer(raw) != self._missing}
            if len(kept) < len(found.value):
                self.misses += 1
                return dataclasses.replace(found, value=kept)
        return found


async def test_a_leader_whose_read_missed_a_member_waits_for_it_when_a_joiner_names_it(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=5), 3) as swarm:
        leader, early, late = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        lagging = MissesOnFirstRead(leader, late.host.peer_id)
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
