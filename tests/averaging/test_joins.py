"""The leader's side of ``avg.join`` (``averaging/joins.py``) without sockets: a join that comes
while we choose our role waits for the choice, within bounds a remote peer cannot stretch."""

from __future__ import annotations

import dataclasses
import types

import pytest
import trio
import trio.testing

from averaging.gathering import ANSWER_MARGIN, Declaration, Gathering
from averaging.group import AveragingMode
from averaging.joins import MAX_WAITING_JOINS, MIN_PATIENCE_LEFT, Following, Joins, NotLeading
from averaging.leading import gather
from peer import PeerAddress, PeerID


def declaration(number: int, schema: str = "s", round_number: int = 1) -> Declaration:
    peer = PeerID(number.to_bytes(2, "big") * 10)
    address = PeerAddress("127.0.0.1", 10000 + number, peer)
    return Declaration(peer, address, 1.0, AveragingMode.NODE, schema, round_number)


def request(joiner: Declaration, patience: float):
    return types.SimpleNamespace(peer=joiner.peer_id, body={**joiner.to_wire(), "patience": patience})


async def outcome(joins: Joins, joiner: Declaration, patience: float, into: dict) -> None:
    try:
        into[joiner.peer_id] = ("admitted", len((await joins.handle(request(joiner, patience)))["members"]))
    except (ValueError, NotLeading, Following) as error:
        into[joiner.peer_id] = ("refused", str(error), trio.current_time())


async def test_a_join_waits_for_our_choice_and_is_admitted_when_we_lead(autojump_clock):
    me, joiner = declaration(1), declaration(2)
    joins, outcomes = Joins(lambda peer: False), {}
    joins.choosing(me)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, joiner, 5.0, outcomes)
        await trio.sleep(1.0)
        joins.choosing(dataclasses.replace(me, round=2))  # caught up meanwhile: still choosing
        await trio.sleep(1.0)
        assert outcomes == {}
        gathering = Gathering(me, {joiner.peer_id}, target=2)
        joins.open(gathering)
        await trio.sleep(0.1)
        assert joiner.peer_id in gathering.joined  # (a group of 2 is full: the leader closes it)
        gathering.formed = types.SimpleNamespace(member=lambda peer: peer, to_wire=lambda: {"members": [1, 2]})
        gathering.closed.set()
    assert outcomes == {joiner.peer_id: ("admitted", 2)}


async def test_a_join_is_refused_once_we_follow_or_when_its_patience_ran_out_waiting(autojump_clock):
    me, follower, impatient = declaration(1), declaration(2), declaration(3)
    joins, outcomes = Joins(lambda peer: False), {}
    joins.choosing(me)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, follower, 5.0, outcomes)
        nursery.start_soon(outcome, joins, impatient, 2.0, outcomes)
        await trio.sleep(0.5)
        joins.choosing(None)  # we follow another leader: the waiting join is told at once
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes[follower.peer_id][:2] == ("refused", "not gathering a group now")
        assert outcomes[follower.peer_id][2] == pytest.approx(0.5)
        joins.choosing(me)  # that attempt failed: choosing again
        nursery.start_soon(outcome, joins, impatient, 2.0, outcomes)
        await trio.sleep(2.0 - MIN_PATIENCE_LEFT / 2)
        joins.open(Gathering(me, {impatient.peer_id}, target=4))  # too late to form a group for it
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()  # (an admitted join would wait for the group to form)
    assert outcomes[impatient.peer_id][:2] == ("refused", "the join's patience ran out while this peer chose its role")
    assert outcomes[impatient.peer_id][2] == pytest.approx(2.5 - MIN_PATIENCE_LEFT)


async def test_only_joins_we_could_admit_wait_and_no_more_than_a_group_of_them(autojump_clock):
    me = declaration(1)
    joins, outcomes = Joins(lambda peer: False), {}
    joins.choosing(me)
    async with trio.open_nursery() as nursery:
        for joiner in [declaration(2, schema="other"), declaration(3, round_number=2)]:
            nursery.start_soon(outcome, joins, joiner, 5.0, outcomes)
        await trio.sleep(0.1)
        # another schema, or a round ahead of ours: refused at once
        assert {result[0] for result in outcomes.values()} == {"refused"} and len(outcomes) == 2
        outcomes.clear()
        waiting = [declaration(10 + number) for number in range(MAX_WAITING_JOINS)]
        for joiner in waiting:
            nursery.start_soon(outcome, joins, joiner, 5.0, outcomes)
        await trio.sleep(0.1)
        assert outcomes == {}
        nursery.start_soon(outcome, joins, declaration(99), 5.0, outcomes)  # one too many
        nursery.start_soon(outcome, joins, waiting[0], 5.0, outcomes)  # the same peer twice
        await trio.sleep(0.1)
        too_many = "too many joins wait on this peer"
        assert [result[1] for result in outcomes.values()] == [too_many] * 2
        joins.choosing(None)
    assert len(outcomes) == MAX_WAITING_JOINS + 1


async def test_only_a_join_for_a_round_we_matched_is_declined_for_good(autojump_clock):
    me = declaration(1)
    joins, outcomes = Joins(lambda peer: False), {}
    joins.matched(1)
    with pytest.raises(NotLeading, match="has its group for round 1"):
        await joins.handle(request(declaration(2, round_number=1), 5.0))
    # a round we have not matched: we may yet lead it, so the refusal is one to retry
    with pytest.raises(ValueError, match="not gathering a group now"):
        await joins.handle(request(declaration(3, round_number=2), 5.0))
    joins.choosing(dataclasses.replace(me, round=2))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, declaration(3, round_number=2), 5.0, outcomes)
        await trio.sleep(0.5)
        assert outcomes == {}  # waits for our choice
        joins.matched(2)
    assert outcomes[declaration(3).peer_id][:2] == ("refused", "this peer has its group for round 2")


async def test_a_join_while_we_follow_is_told_whom_we_follow_and_where_until_we_choose_again(autojump_clock):
    me, leader, joiner = declaration(1), declaration(2), declaration(3)
    joins, outcomes = Joins(lambda peer: False), {}
    joins.choosing(me)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, joiner, 5.0, outcomes)
        await trio.sleep(0.5)
        joins.following(leader.peer_id, leader.address, 1)  # the join that waited is told at once
        await trio.testing.wait_all_tasks_blocked()
    assert outcomes[joiner.peer_id][:2] == ("refused", str(leader.address))
    assert PeerAddress.parse(outcomes[joiner.peer_id][1]).peer_id == leader.peer_id
    # a join for a round ahead of the one we follow for is not ours to redirect
    with pytest.raises(ValueError, match="not gathering a group now"):
        await joins.handle(request(declaration(4, round_number=2), 5.0))
    joins.choosing(me)  # that follow failed: choosing again, so joins wait for the choice
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, declaration(5), 5.0, outcomes)
        await trio.sleep(0.5)
        assert declaration(5).peer_id not in outcomes
        joins.matched(1)
    assert outcomes[declaration(5).peer_id][:2] == ("refused", "this peer has its group for round 1")


async def test_joins_for_the_next_round_from_two_known_peers_end_the_wait_for_members_that_matched_elsewhere(
    autojump_clock,
):
    me, member, missing = declaration(1), declaration(2), declaration(3)
    ahead = [declaration(number, round_number=2) for number in (4, 5)]
    stranger, far = declaration(6, round_number=2), declaration(7, round_number=3)
    known = frozenset(d.peer_id for d in [member, missing, *ahead, far])  # (the read that made us lead)
    joins, outcomes = Joins(lambda peer: False), {}
    gathering = Gathering(me, {member.peer_id, missing.peer_id}, target=8, known=known)
    joins.open(gathering)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, member, 5.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert member.peer_id in gathering.joined and not gathering.complete
        # one peer however often it asks, one our read did not find, one of another schema, one two
        # rounds ahead (no honest reader elects a leader that far behind): claims, not the swarm
        for joiner in [ahead[0], ahead[0], stranger, declaration(8, schema="other", round_number=2), far]:
            nursery.start_soon(outcome, joins, joiner, 5.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert not gathering.overtaken and not gathering.complete
        assert outcomes[ahead[0].peer_id][:2] == ("refused", "the joiner is a round ahead of this group")
        nursery.start_soon(outcome, joins, ahead[1], 5.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        # the swarm has moved on: the group forms with whoever joined, not waiting for the missing
        assert gathering.overtaken and gathering.complete
        assert outcomes[ahead[1].peer_id][:2] == ("refused", "the joiner is a round ahead of this group")
        nursery.cancel_scope.cancel()


def test_a_newcomer_leading_round_0_is_never_overtaken():
    """Established peers of any round elect a newcomer's round-0 declaration (``in_reach``): their
    joins say nothing about whether the newcomers it leads are still coming."""
    newcomer = declaration(1, round_number=0)
    established = [declaration(number, round_number=1) for number in (2, 3)]
    gathering = Gathering(newcomer, {declaration(4).peer_id}, target=8, known=frozenset(d.peer_id for d in established))
    for peer in established:
        gathering.passed_by(peer.peer_id, 1)
    assert not gathering.overtaken and not gathering.complete


async def test_a_joiner_we_do_not_expect_hurries_the_group_no_sooner_than_halfway_and_is_refused_in_time(
    autojump_clock,
):
    """A join's patience is a claim: one peer joining every leader with a tiny patience would
    close every group at once, without the members each leader waits for."""
    me, member, stranger = declaration(1), declaration(2), declaration(3)
    joins, outcomes = Joins(lambda peer: False), {}
    hurry_from = trio.current_time() + 4.0
    gathering = Gathering(me, {member.peer_id}, target=8, hurry_from=hurry_from)
    joins.open(gathering)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, stranger, 1.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert stranger.peer_id in gathering.joined
        assert gathering.answer_by == hurry_from - ANSWER_MARGIN  # (not its patience: 1.0)
        await trio.sleep(1.0)
        # refused just before it gives up, so it reads again rather than passing us over
        assert outcomes[stranger.peer_id][:2] == ("refused", "the group did not form within the joiner's patience")
        assert outcomes[stranger.peer_id][2] == pytest.approx(1.0 - ANSWER_MARGIN)  # (as early as an answer)
        assert stranger.peer_id not in gathering.joined and not gathering.closed.is_set()
        nursery.start_soon(outcome, joins, member, 2.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        # a member we expect is counted: we answer before it gives up
        assert gathering.answer_by == pytest.approx(trio.current_time() + 2.0 - ANSWER_MARGIN)
        assert gathering.complete
        nursery.cancel_scope.cancel()


async def test_a_joins_patience_ends_no_later_than_its_call_deadline(autojump_clock):
    """The joiner counts its patience before it dials; the call's deadline, which its handler
    runs under, says how much of it the dial left."""
    me, member = declaration(1), declaration(2)
    joins = Joins(lambda peer: False)
    gathering = Gathering(me, {member.peer_id, declaration(3).peer_id}, target=8)
    joins.open(gathering)

    async def handle_under_the_call_deadline() -> None:
        with trio.CancelScope(deadline=trio.current_time() + 1.5):  # (as ``peer.rpc`` serves a call)
            await joins.handle(request(member, 10.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(handle_under_the_call_deadline)
        await trio.testing.wait_all_tasks_blocked()
        assert gathering.patience[member.peer_id] == pytest.approx(trio.current_time() + 1.5 - ANSWER_MARGIN)
        nursery.cancel_scope.cancel()


async def test_until_halfway_joiners_we_do_not_expect_wait_for_places_no_expected_member_needs(autojump_clock):
    """A place is a claim too: strangers (any identity) filling the group would close it at once
    (``full``) without the members it is for."""
    me, first, second = declaration(1), declaration(2), declaration(3)
    strangers = [declaration(number) for number in (7, 8, 9)]
    joins, outcomes = Joins(lambda peer: False), {}
    hurry_from = trio.current_time() + 4.0
    gathering = Gathering(me, {first.peer_id, second.peer_id}, target=4, hurry_from=hurry_from)
    joins.open(gathering)
    async with trio.open_nursery() as nursery:
        for stranger in strangers:
            nursery.start_soon(outcome, joins, stranger, 9.0, outcomes)
            await trio.testing.wait_all_tasks_blocked()
        assert set(gathering.joined) == {strangers[0].peer_id}  # the one place the expected leave
        nursery.start_soon(outcome, joins, first, 9.0, outcomes)
        await trio.sleep(1.0)
        assert set(gathering.joined) == {strangers[0].peer_id, first.peer_id} and not gathering.full
        gathering.not_coming(second.peer_id)  # (it has its group elsewhere: its place is free)
        await trio.testing.wait_all_tasks_blocked()
        assert gathering.full and len(gathering.joined.keys() & {s.peer_id for s in strangers[1:]}) == 1
        late = next(s for s in strangers[1:] if s.peer_id not in gathering.joined)
        assert outcomes[late.peer_id][:2] == ("refused", "group is already full or formed")
        nursery.cancel_scope.cancel()


async def test_from_halfway_a_joiner_our_read_found_takes_a_missing_members_place(autojump_clock):
    me, first, second = declaration(1), declaration(2), declaration(3)
    declared, unknown, impatient = declaration(7), declaration(8), declaration(9)
    joins, outcomes = Joins(lambda peer: False), {}
    hurry_from = trio.current_time() + 4.0
    expected, known = {first.peer_id, second.peer_id}, frozenset({declared.peer_id})
    gathering = Gathering(me, expected, target=3, known=known, hurry_from=hurry_from)
    joins.open(gathering)
    async with trio.open_nursery() as nursery:
        for joiner, patience in [(impatient, 3.0), (unknown, 9.0), (declared, 9.0)]:
            nursery.start_soon(outcome, joins, joiner, patience, outcomes)
        await trio.sleep(3.9)
        assert not gathering.joined
        kept = "the group's places left are kept for the members it expects"
        # (refused before it gives up, it reads again)
        assert outcomes == {impatient.peer_id: ("refused", kept, 3.0 - MIN_PATIENCE_LEFT)}
        await trio.sleep(0.2)
        # an identity our read did not find never takes a member's place
        assert set(gathering.joined) == {declared.peer_id}
        assert outcomes[unknown.peer_id] == ("refused", kept, 4.0)
        nursery.cancel_scope.cancel()


async def test_joins_waiting_for_a_place_leave_when_the_leader_gives_up(autojump_clock):
    """A join must not hold its place in the line (or be admitted) once the gathering is over."""
    me, member = declaration(1), declaration(2)
    strangers = [declaration(100 + number) for number in range(MAX_WAITING_JOINS)]
    joins, outcomes = Joins(lambda peer: False), {}
    gathering = Gathering(me, {member.peer_id}, target=2, hurry_from=trio.current_time() + 30.0)
    joins.open(gathering)
    async with trio.open_nursery() as nursery:
        for stranger in strangers:
            nursery.start_soon(outcome, joins, stranger, 60.0, outcomes)
        await trio.sleep(1.0)
        joins.close()  # the leader gave up (as ``leading.gather`` does)
        gathering.close()
        await trio.testing.wait_all_tasks_blocked()
        assert {outcomes[s.peer_id][1:] for s in strangers} == {("not gathering a group now", 1.0)}
        joins.choosing(me)  # it reads again and chooses anew: an honest join waits for the choice
        nursery.start_soon(outcome, joins, member, 10.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert member.peer_id not in outcomes and not gathering.joined
        nursery.cancel_scope.cancel()


async def test_a_joined_stranger_that_a_confirming_read_comes_to_expect_is_answered_in_time(autojump_clock):
    me, namer, named, other = declaration(1), declaration(2), declaration(3), declaration(4)
    joins, outcomes, result = Joins(lambda peer: False), {}, {}
    gathering = Gathering(me, {namer.peer_id, other.peer_id}, target=8, hurry_from=trio.current_time() + 10.0)

    async def confirm() -> set:
        await trio.sleep(0.2)  # (a read of the declarations)
        return {named.peer_id}

    async def join(joiner, patience, view) -> None:
        body = {**joiner.to_wire(), "patience": patience, "view": [peer.to_bytes() for peer in view]}
        try:
            reply = await joins.handle(types.SimpleNamespace(peer=joiner.peer_id, body=body))
            outcomes[joiner.peer_id] = ("admitted", len(reply["members"]))
        except ValueError as error:
            outcomes[joiner.peer_id] = ("refused", str(error))

    async def lead() -> None:
        result["group"] = await gather(joins, gathering, 2, trio.current_time() + 20.0, confirm=confirm)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lead)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(join, namer, 9.0, [named.peer_id])  # its view names a member we missed
        await trio.sleep(0.1)  # (while the leader confirms, the named member joins)
        nursery.start_soon(join, named, 1.0, [])
    # once expected, its patience counts: the group forms in time for it
    assert outcomes == {namer.peer_id: ("admitted", 3), named.peer_id: ("admitted", 3)}


def test_a_joiner_named_for_a_confirming_read_counts_its_own_kept_place():
    me, first, second, named = declaration(1), declaration(2), declaration(3), declaration(9)
    gathering = Gathering(me, {first.peer_id, second.peer_id}, target=4, hurry_from=10.0**9)
    gathering.admit(first, 10.0, [me.peer_id, first.peer_id, second.peer_id, named.peer_id])
    assert gathering.unconfirmed == {named.peer_id} and gathering.has_place(named.peer_id)
    assert not gathering.has_place(declaration(10).peer_id)  # (its place is kept for the named)


async def test_names_no_read_will_settle_hold_no_places(autojump_clock):
    """A joiner's view may name made-up members; a leader that cannot confirm them (no read to
    take) must not keep places for them."""
    me, first, second, stranger = declaration(1), declaration(2), declaration(3), declaration(7)
    made_up = [declaration(100 + number).peer_id for number in range(10)]
    joins, outcomes = Joins(lambda peer: False), {}
    gathering = Gathering(me, {first.peer_id, second.peer_id}, target=4, hurry_from=trio.current_time() + 10.0)

    async def join_naming(joiner, view) -> None:
        body = {**joiner.to_wire(), "patience": 9.0, "view": [peer.to_bytes() for peer in view]}
        await joins.handle(types.SimpleNamespace(peer=joiner.peer_id, body=body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gather, joins, gathering, 2, trio.current_time() + 20.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(join_naming, first, made_up)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(outcome, joins, stranger, 9.0, outcomes)
        await trio.testing.wait_all_tasks_blocked()
        assert not gathering.unconfirmed and set(gathering.joined) == {first.peer_id, stranger.peer_id}
        nursery.cancel_scope.cancel()


async def test_a_join_that_waits_for_our_choice_says_we_are_asked_to_lead(autojump_clock):
    """Its peer has read the declarations, ours among them: the matchmaker stops letting them
    spread (``settling.settle``) rather than spend the joiner's patience."""
    me, joiner, behind = declaration(1, round_number=2), declaration(2, round_number=2), declaration(3)
    joins = Joins(lambda peer: False)
    joins.choosing(me)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outcome, joins, behind, 5.0, {})  # (it read round 1's declarations)
        await trio.testing.wait_all_tasks_blocked()
        assert not joins.asked_to_lead.is_set()
        nursery.start_soon(outcome, joins, joiner, 5.0, {})
        await trio.testing.wait_all_tasks_blocked()
        assert joins.asked_to_lead.is_set()
        joins.choosing(dataclasses.replace(me, round=3))  # a newer round: nobody asked for it yet
        assert not joins.asked_to_lead.is_set()
        nursery.cancel_scope.cancel()


def test_once_no_expected_member_is_missing_a_latecomers_patience_counts():
    """A group held open for latecomers (matching ahead) answers each before it gives up: the
    floor on a stranger's patience protects missing members, and none is missing."""
    me, member, latecomer = declaration(1), declaration(2), declaration(7)
    gathering = Gathering(me, {member.peer_id}, target=4, hurry_from=100.0)
    gathering.admit(latecomer, 5.0)
    assert gathering.answer_by == 100.0 - ANSWER_MARGIN  # (its member is still missing)
    gathering.admit(member, 50.0)
    assert gathering.answer_by == 5.0 - ANSWER_MARGIN
    assert gathering.waits_until(latecomer.peer_id) == 5.0 - ANSWER_MARGIN / 2
