"""A leader does not wait for expected members that will not come (``averaging/stragglers.py``):
once half of them joined it asks the missing ones, and one that is gone, or has its group for the
round elsewhere, is not waited for."""

from __future__ import annotations

import pytest
import trio

from averaging.gathering import Declaration, Gathering
from averaging.group import AveragingMode
from averaging.matchmaking import Matchmaker
from averaging.stragglers import GONE, MATCHED, MATCHING, PROBES, here_answer, stop_waiting_for_stragglers
from peer import Identity, PeerID
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm


def test_a_member_answers_matched_for_a_round_it_has_its_group_for():
    assert here_answer(None, {"round": 3}) == MATCHING
    assert here_answer(3, {"round": 3}) == MATCHED
    assert here_answer(3, {"round": 2}) == MATCHED
    assert here_answer(3, {"round": 4}) == MATCHING
    for malformed in (None, {}, {"round": -1}, {"round": "3"}, [3]):
        with pytest.raises(ValueError):
            here_answer(3, malformed)


def declared(peer: PeerID) -> Declaration:
    return Declaration(peer, None, 1.0, AveragingMode.NODE, "s", 1)


async def test_the_missing_are_asked_once_half_joined_and_those_gone_or_matched_are_not_waited_for(autojump_clock):
    me, *others = [Identity.generate().peer_id for _ in range(9)]
    coming, (gone, elsewhere_later, still_matching, mute) = others[:4], others[4:]
    gathering = Gathering(declared(me), set(others), target=9)
    asked: list[PeerID] = []
    answers = {gone: [GONE], elsewhere_later: [MATCHING, MATCHED], still_matching: [MATCHING] * PROBES, mute: [None]}

    async def ask(peer: PeerID) -> str | None:
        asked.append(peer)
        return answers[peer].pop(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_waiting_for_stragglers, gathering, ask)
        await trio.sleep(5)
        assert asked == []  # none joined yet: nobody is asked
        for peer in coming[:3]:
            gathering.admit(declared(peer), trio.current_time() + 30)
        await trio.sleep(5)
        assert asked == []  # three of eight joined: not half yet
        gathering.admit(declared(coming[3]), trio.current_time() + 30)
        await trio.sleep(10)
    assert gathering.expected == {*coming, still_matching, mute}
    assert asked.count(still_matching) == PROBES and asked.count(elsewhere_later) == 2
    assert asked.count(gone) == 1 and asked.count(mute) == 1  # (one that cannot tell us is not asked again)


class LeavesAfterDeclaring:
    """A DHT node whose machine goes off once its declaration is stored."""

    def __init__(self, node, leave):
        self._node, self._leave = node, leave

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def store(self, *args, **kwargs):
        stored = await self._node.store(*args, **kwargs)
        self._leave()
        return stored


async def test_a_leader_does_not_wait_for_a_member_whose_machine_went_off_after_it_declared(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=10), 6) as swarm:
        ranked = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        leaver = ranked[-1]  # (the lowest ID leads: the leaver follows)
        scopes: dict = {}
        formed: dict = {}

        def leave() -> None:
            swarm.leave(swarm.nodes.index(leaver))
            scopes[leaver].cancel()

        async def form(node) -> None:
            dht = LeavesAfterDeclaring(node, leave) if node is leaver else node
            with trio.CancelScope() as scopes[node]:
                declaration = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)
                match = await Matchmaker(node.host, dht, "stragglers").form_group(
                    declaration, target_group_size=6, min_group_size=2, timeout=20.0
                )
                formed[node] = ({member.peer_id for member in match.group.members}, trio.current_time())

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for node in swarm.nodes:
                nursery.start_soon(form, node)
        stayers = {node.host.peer_id for node in swarm.nodes if node is not leaver}
        assert {node.host.peer_id for node in formed} == stayers
        assert all(members == stayers for members, _ in formed.values())
        # without the question the leader waited until its followers' patience: ~10 s of the 20
        assert max(at for _, at in formed.values()) - started < 6.0
