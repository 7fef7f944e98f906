"""A follower sent on by a leader that follows another (``averaging/following.py``): it asks the
named leader as that peer only, a bounded number of hops and foreign dials, and blames the leader
it elected for nothing the named one does."""

from __future__ import annotations

import pytest
import trio

from averaging.following import MAX_NAMED_DIALS, MAX_REDIRECTS, follow
from averaging.group import AveragingMode
from averaging.joins import Following
from averaging.matchmaking import Declaration
from averaging.matchmaking_errors import LeaderFailed, LeaderFollows, MatchmakingError
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm

METHOD = "avg.join.follow-test"


def declaration_of(node) -> Declaration:
    return Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 1)


def never(peer) -> bool:
    return False


def refusing_with(named: str, asked: list):
    """An ``avg.join`` handler that answers every join with ``Following`` ``named``."""

    async def handle(request):
        asked.append(request.peer)
        raise Following(named)

    return handle


async def test_a_leader_named_at_a_foreign_address_is_dialled_as_itself_once_and_blames_no_one(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=3), 4) as swarm:
        me, liar, victim, named = swarm.nodes
        # the liar names a peer (not in our view) at the victim's address: the handshake there
        # answers as the victim, so we never ask it anything as the named peer
        lie = str(victim.host.listen_address.with_peer_id(named.host.peer_id))
        asked, victim_asked = [], []
        liar.host.router.add_unary(METHOD, refusing_with(lie, asked))
        victim.host.router.add_unary(METHOD, refusing_with(lie, victim_asked))
        leader = declaration_of(liar)
        view, dials = {leader.peer_id: leader}, set()

        async def attempt(at_word: set[str]) -> None:
            await follow(
                me.host, METHOD, declaration_of(me), leader, trio.current_time() + 10, (), view, never, set(), at_word
            )

        with pytest.raises(MatchmakingError) as caught:
            await attempt(dials)
        assert not isinstance(caught.value, (LeaderFailed, LeaderFollows))  # the elected leader is not passed over
        assert len(asked) == 1 and victim_asked == [] and dials == {victim.host.listen_address.endpoint}
        # named again in the round: not dialled again; nor is any endpoint past MAX_NAMED_DIALS
        with pytest.raises(LeaderFollows):
            await attempt(dials)
        full = {f"10.0.0.{index}:1" for index in range(MAX_NAMED_DIALS)}
        with pytest.raises(LeaderFollows):
            await attempt(full)
        assert len(asked) == 3 and len(dials) == 1 and len(full) == MAX_NAMED_DIALS and victim_asked == []


async def test_leaders_that_name_each_other_cost_one_ask_each_and_hops_are_bounded(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=4), 3 + MAX_REDIRECTS + 2) as swarm:
        me, first, second, *chain = swarm.nodes
        view = {node.host.peer_id: declaration_of(node) for node in swarm.nodes[1:]}

        async def attempt(elected) -> None:
            leader = view[elected.host.peer_id]
            await follow(
                me.host, METHOD, declaration_of(me), leader, trio.current_time() + 10, (), view, never, set(), set()
            )

        # two leaders that say they follow each other: each is asked once
        pair_asked: list = []
        first.host.router.add_unary(METHOD, refusing_with(str(second.host.listen_address), pair_asked))
        second.host.router.add_unary(METHOD, refusing_with(str(first.host.listen_address), pair_asked))
        with pytest.raises(LeaderFollows):
            await attempt(first)
        assert pair_asked == [me.host.peer_id] * 2
        # each of a chain names the next: the elected leader and MAX_REDIRECTS more are asked
        chain_asked: list = []
        for node, onward in zip(chain, chain[1:], strict=False):
            node.host.router.add_unary(METHOD, refusing_with(str(onward.host.listen_address), chain_asked))
        with pytest.raises(LeaderFollows):
            await attempt(chain[0])
        assert len(chain_asked) == 1 + MAX_REDIRECTS


async def test_no_word_sends_us_to_a_leader_passed_over_or_an_endpoint_we_may_not_dial(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=5), 5) as swarm:
        me, elected, passed, named, liar = swarm.nodes
        view = {node.host.peer_id: declaration_of(node) for node in (elected, passed, liar)}
        asked, passed_asked, liar_asked = [], [], []
        elected.host.router.add_unary(METHOD, refusing_with(str(passed.host.listen_address), asked))
        passed.host.router.add_unary(METHOD, refusing_with(str(named.host.listen_address), passed_asked))
        # a link-local address (a cloud's metadata service) for a leader our view lacks
        liar.host.router.add_unary(METHOD, refusing_with(f"169.254.169.254:80/{named.host.peer_id}", liar_asked))

        async def attempt(start, passed_over: set[bytes], dials: set[str]) -> None:
            leader = view[start.host.peer_id]
            await follow(
                me.host,
                METHOD,
                declaration_of(me),
                leader,
                trio.current_time() + 10,
                (),
                view,
                never,
                passed_over,
                dials,
            )

        with pytest.raises(LeaderFollows):  # the leader it names failed us this round: not asked again
            await attempt(elected, {passed.host.peer_id.to_bytes()}, set())
        assert len(asked) == 1 and passed_asked == []
        dials: set[str] = set()
        with pytest.raises(LeaderFollows):
            await attempt(liar, set(), dials)
        assert len(liar_asked) == 1 and dials == set()
