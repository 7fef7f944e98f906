"""A leader does not wait for expected members that will not come (``averaging/stragglers.py``):
once half of them joined, or a few seconds passed with fewer, it asks the missing ones, and one
that is gone, or has its group for the round elsewhere, is not waited for."""

from __future__ import annotations

import dataclasses
import types

import pytest
import trio

import averaging.joins
from averaging.gathering import Declaration, Gathering
from averaging.group import AveragingMode
from averaging.matchmaking import Matchmaker
from averaging.stragglers import (
    AGAIN,
    ASK_UNJOINED_AFTER,
    GONE,
    MATCHED,
    MATCHING,
    PROBE_DEADLINE,
    PROBE_SPACING,
    asker,
    here_answer,
    stop_waiting_for_stragglers,
)
from dht.peer_dictionary import subkey_peer
from peer import ConnectError, ConnectionLost, Identity, PeerAddress, PeerID, RemoteError
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
    asked: list[tuple[PeerID, float]] = []
    answers = {gone: [GONE], elsewhere_later: [MATCHING, MATCHED], mute: [None]}

    async def ask(peer: PeerID) -> str | None:
        asked.append((peer, trio.current_time()))
        return answers[peer].pop(0) if peer in answers else MATCHING

    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        nursery.start_soon(stop_waiting_for_stragglers, gathering, ask)
        for peer in coming[:3]:
            gathering.admit(declared(peer), trio.current_time() + 30)
        await trio.sleep(ASK_UNJOINED_AFTER / 2)
        assert asked == []  # three of eight joined: not half yet, nor long enough
        gathering.admit(declared(coming[3]), trio.current_time() + 30)
        await trio.sleep(20)
        nursery.cancel_scope.cancel()  # (as the leader's wait ends it)
    assert gathering.expected == {*coming, still_matching, mute}
    assert {peer for peer, _ in asked} == {gone, elsewhere_later, still_matching, mute}
    assert min(at for _, at in asked) - started == pytest.approx(ASK_UNJOINED_AFTER / 2)  # (at once when half)
    # one still matching is asked again and again, each time twice as late: a few times a round
    times = [at for peer, at in asked if peer == still_matching]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert gaps == pytest.approx([PROBE_SPACING * 2**n for n in range(len(gaps))]) and len(times) == 5
    assert [peer for peer, _ in asked].count(elsewhere_later) == 2
    assert [peer for peer, _ in asked].count(gone) == 1 and [peer for peer, _ in asked].count(mute) == 1


async def test_a_leader_that_fewer_than_half_join_asks_after_a_while(autojump_clock):
    # On one loop with 128 peers, a first round's leaders wait for members that joined other groups:
    # when none of them comes, asking once half joined never asks.
    me, elsewhere, gone, coming = [Identity.generate().peer_id for _ in range(4)]
    gathering = Gathering(declared(me), {elsewhere, gone, coming}, target=4)
    asked: list[tuple[PeerID, float]] = []
    answers = {elsewhere: MATCHED, gone: GONE, coming: MATCHING}

    async def ask(peer: PeerID) -> str | None:
        asked.append((peer, trio.current_time()))
        return answers[peer]

    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        nursery.start_soon(stop_waiting_for_stragglers, gathering, ask)
        await trio.sleep(ASK_UNJOINED_AFTER - 0.1)
        assert asked == []  # (its followers' reads may still be coming back)
        await trio.sleep(0.2)
        assert {peer for peer, _ in asked} == {elsewhere, gone, coming}
        assert all(at - started == pytest.approx(ASK_UNJOINED_AFTER) for _, at in asked)
        nursery.cancel_scope.cancel()
    assert gathering.expected == {coming}


async def test_a_member_expected_while_others_are_being_asked_is_asked_too(autojump_clock):
    # A confirming read adds a member while a question to another is in flight: the change it
    # signals comes before the leader's questions end, and must not be missed.
    me, a, slow, late = [Identity.generate().peer_id for _ in range(4)]
    gathering = Gathering(declared(me), {a, slow}, target=8)
    asked: list[PeerID] = []

    async def ask(peer: PeerID) -> str | None:
        asked.append(peer)
        if peer == slow:
            await trio.sleep(1.0)
            return None  # (it cannot tell us: not asked again)
        return GONE

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_waiting_for_stragglers, gathering, ask)
        gathering.admit(declared(a), 100.0, [late])  # half joined: the missing one is asked
        await trio.sleep(0.5)
        gathering.confirm({late})
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert asked == [slow, late] and gathering.expected == {a, slow}


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


async def test_a_member_a_later_joiner_names_is_asked_too(autojump_clock):
    # The leader's read missed a departed member's declaration, a joiner's view names it, and the
    # leader's confirming read finds it after the first questions were over.
    me, a, b, late = [Identity.generate().peer_id for _ in range(4)]
    gathering = Gathering(declared(me), {a, b}, target=8)
    asked: list[PeerID] = []

    async def ask(peer: PeerID) -> str | None:
        asked.append(peer)
        return GONE

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_waiting_for_stragglers, gathering, ask)
        gathering.admit(declared(a), 100.0)
        gathering.admit(declared(b), 100.0, [late])
        await trio.sleep(5)
        gathering.confirm({late})
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert asked == [late] and gathering.complete


async def form_with_a_leaver(swarm, leaver, prefix: str, dhts: dict | None = None) -> tuple[dict, set, float]:
    """Every node of ``swarm`` forms a group of up to 6 (20-s deadline) while ``leaver``'s machine
    goes off once its declaration is stored; ``dhts``: other nodes' DHTs in place of their own.
    Returns each stayer's (members, when formed), the stayers' peer IDs and when matching began."""
    scopes: dict = {}
    formed: dict = {}

    def leave() -> None:
        swarm.leave(swarm.nodes.index(leaver))
        scopes[leaver].cancel()

    dhts = {**(dhts or {}), leaver: LeavesAfterDeclaring(leaver, leave)}

    async def form(node) -> None:
        with trio.CancelScope() as scopes[node]:
            declaration = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)
            match = await Matchmaker(node.host, dhts.get(node, node), prefix).form_group(
                declaration, target_group_size=6, min_group_size=2, timeout=20.0
            )
            formed[node] = ({member.peer_id for member in match.group.members}, trio.current_time())

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for node in swarm.nodes:
            nursery.start_soon(form, node)
    return formed, {node.host.peer_id for node in swarm.nodes if node is not leaver}, started


async def test_a_leader_does_not_wait_for_a_member_whose_machine_went_off_after_it_declared(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=10), 6) as swarm:
        ranked = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        leaver = ranked[-1]  # (the lowest ID leads: the leaver follows)
        formed, stayers, started = await form_with_a_leaver(swarm, leaver, "stragglers")
        assert {node.host.peer_id for node in formed} == stayers
        assert all(members == stayers for members, _ in formed.values())
        # without the question the leader waited until its followers' patience: ~10 s of the 20
        assert max(at for _, at in formed.values()) - started < 6.0


def test_a_member_found_gone_stays_settled_when_a_later_joiner_names_it():
    # The departed member's declaration outlives it: every later joiner's view still names it.
    me, a, b, c, gone = [Identity.generate().peer_id for _ in range(5)]
    gathering = Gathering(declared(me), {a, b, c, gone}, target=8)
    view = [a, b, c, gone]
    gathering.admit(declared(a), 100.0, view)
    gathering.admit(declared(b), 100.0, view)
    gathering.not_coming(gone)
    gathering.admit(declared(c), 100.0, view)
    assert gathering.unconfirmed == set() and gathering.complete  # no read to confirm it, no wait


class AnsweringHost:
    """A host whose call raises ``error``, or never answers (None)."""

    def __init__(self, error: Exception | str | None):
        self.error, self.calls = error, 0

    async def call(self, address, method, body, timeout=None):
        self.calls += 1
        if self.error is None:
            await trio.sleep_forever()
        if isinstance(self.error, str):  # (an answer)
            return types.SimpleNamespace(body=self.error)
        raise self.error


@pytest.mark.parametrize(
    "relayed, error, verdict, seconds",
    [
        (False, None, GONE, PROBE_DEADLINE),  # silent: its machine is off
        (False, MATCHED, MATCHED, 0.0),  # it has its group for the round elsewhere
        (False, ConnectError("refused", refused=True), GONE, 0.0),  # nothing listens there any more
        (False, ConnectError("the handshake failed"), None, 0.0),  # can't tell: wait as before
        (False, ConnectError("another peer", answered_by=Identity.generate().peer_id), GONE, 0.0),  # not there
        (False, ConnectionLost("lost mid-call"), AGAIN, 0.0),  # asked again later
        (
            False,
            RemoteError("avg.here.p", Identity.generate().peer_id, "UnknownMethod", "no such method"),
            None,
            0.0,
        ),  # a peer that predates the question
        (True, None, None, 0.0),  # behind a relay: not asked (a relay failing the dial says nothing of it)
    ],
)
async def test_what_a_leader_concludes_from_a_member_s_silence_or_refusal(
    autojump_clock, relayed, error, verdict, seconds
):
    member, relay = Identity.generate().peer_id, Identity.generate().peer_id
    address = PeerAddress("203.0.113.7", 4001, member, relay if relayed else None)
    host, matched = AnsweringHost(error), set()
    declarations = {member: Declaration(member, address, 1.0, AveragingMode.NODE, "s", 1)}
    ask = asker(host, "avg.here.p", declarations, 1, matched)
    started = trio.current_time()
    assert await ask(member) == verdict
    assert trio.current_time() - started == pytest.approx(seconds) and host.calls == (0 if relayed else 1)
    assert matched == ({member.to_bytes()} if verdict == MATCHED else set())  # (not expected again this round)


class MissesOnce:
    """A DHT node whose first read of a dictionary misses ``missing``'s entry (its store had not
    reached the holders that read asked)."""

    def __init__(self, node, missing: PeerID):
        self._node, self._missing, self.missed = node, missing, False

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def get(self, key, latest: bool = False):
        found = await self._node.get(key, latest=latest)
        if not self.missed and found is not None and isinstance(found.value, dict):
            kept = {raw: item for raw, item in found.value.items() if subkey_peer(raw) != self._missing}
            if len(kept) < len(found.value):
                self.missed = True
                return dataclasses.replace(found, value=kept)
        return found


async def test_a_member_that_only_a_confirming_read_found_is_asked_too(autojump_clock):
    # The leader's first read misses the leaver's declaration; a joiner's view names it, the
    # leader's confirming read finds it, and the question reaches it at its declared address.
    async with open_sim_swarm(SimNetwork(seed=10), 6) as swarm:
        ranked = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        leader, leaver = ranked[0], ranked[-1]
        dhts = {leader: MissesOnce(leader, leaver.host.peer_id)}
        formed, stayers, started = await form_with_a_leaver(swarm, leaver, "confirmed", dhts)
        assert all(members == stayers for members, _ in formed.values()) and len(formed) == 5
        assert max(at for _, at in formed.values()) - started < 8.0  # (11.3 s when it was not asked)


async def test_latecomers_whose_view_expects_peers_that_matched_form_their_group_without_waiting_for_them(
    autojump_clock,
):
    # Views differ: two peers matched on their own, and the two that declare after them see all
    # four in one group, which the first latecomer leads expecting the matched two as members too.
    # Fewer than half of its members join: it waited for the others until its follower gave up.
    async with open_sim_swarm(SimNetwork(seed=12), 4) as swarm:
        leader, follower, *matched = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        formed: dict = {}

        async def form(node, target: int) -> None:
            declaration = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)
            match = await Matchmaker(node.host, node, "late").form_group(
                declaration, target_group_size=target, min_group_size=2, timeout=20.0
            )
            formed[node] = ({member.peer_id for member in match.group.members}, trio.current_time())

        async with trio.open_nursery() as nursery:
            for node in matched:
                nursery.start_soon(form, node, 2)
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for node in (leader, follower):
                nursery.start_soon(form, node, 4)
    assert formed[leader][0] == formed[follower][0] == {leader.host.peer_id, follower.host.peer_id}
    assert formed[leader][1] - started < ASK_UNJOINED_AFTER + 2.0, formed[leader][1] - started


async def test_members_found_matched_elsewhere_are_not_expected_again_in_the_round(autojump_clock, monkeypatch):
    # The last two matched on their own; the first declares alone and leads a group of the three
    # again and again, which the latecomer joins once it declares. The matched two, found matched
    # by its first question, are expected and asked no more (their places in the grid stay).
    questions: list[object] = []

    def counted(matched_round, body):
        questions.append(body)
        return here_answer(matched_round, body)

    monkeypatch.setattr(averaging.joins, "here_answer", counted)
    async with open_sim_swarm(SimNetwork(seed=13), 4) as swarm:
        leader, latecomer, *matched = sorted(swarm.nodes, key=lambda node: node.host.peer_id.to_bytes())
        formed: dict = {}

        async def form(node, target: int, after: float = 0.0) -> None:
            await trio.sleep(after)
            declaration = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)
            match = await Matchmaker(node.host, node, "again").form_group(
                declaration, target_group_size=target, min_group_size=2, timeout=30.0
            )
            formed[node] = {member.peer_id for member in match.group.members}

        async with trio.open_nursery() as nursery:
            for node in matched:
                nursery.start_soon(form, node, 2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(form, leader, 4)
            nursery.start_soon(form, latecomer, 4, 4 * ASK_UNJOINED_AFTER)
    assert formed[leader] == formed[latecomer] == {leader.host.peer_id, latecomer.host.peer_id}
    assert len(questions) == len(matched), questions  # (once each: it matched elsewhere)
