"""The round's state table (``averaging/round_state.py``), driven by events alone: no sockets, no
trio. Each shard goes pending -> averaged | local, an averaged one -> checked | banned | left out; senders go
in -> dropped; the result is written once, from the table."""

from __future__ import annotations

import os

import pytest
import torch

from averaging.group import AveragingMode, GroupInfo, GroupMember
from averaging.partition import AllReducePlan
from averaging.reduction import ReductionOutcome
from averaging.round_state import AllReduceRound, RoundPhase, RoundStateError, SenderState, ShardState
from peer import PeerAddress, PeerID

A, B, C, D = (PeerID(bytes([i]) * 20) for i in (1, 2, 3, 4))
ADDRESS = PeerAddress("127.0.0.1", 1)


def group_of(*modes: AveragingMode) -> GroupInfo:
    peers = (A, B, C, D)[: len(modes)]
    members = tuple(
        GroupMember(p, ADDRESS, 0.0 if m is AveragingMode.CLIENT else 1.0, m) for p, m in zip(peers, modes, strict=True)
    )
    return GroupInfo(os.urandom(16), members)


NODES = (AveragingMode.NODE,) * 3


def round_of(group: GroupInfo, total: int = 12, me: PeerID = A, *, sends: bool = True, part_size: int = 2):
    plan = AllReducePlan.build(total, [m.bandwidth for m in group.reducers], part_size)
    return AllReduceRound(group, plan, me, sends=sends), plan


def parts_of(plan: AllReducePlan, shard: int, value: float) -> list[tuple[int, torch.Tensor]]:
    return [(start, torch.full((end - start,), value)) for start, end in plan.parts(shard)]


def outcome_of(plan: AllReducePlan, shard: int, contributors, dropped=None) -> ReductionOutcome:
    parts = plan.num_parts(shard)
    averaged = torch.zeros(plan.shard_sizes[shard])
    return ReductionOutcome(averaged, list(contributors), dict(dropped or {}), [list(contributors)] * parts)


def finish_exchanges(round_, plan) -> None:
    """Our own shard (0: A reduces it) averaged by everyone, then the review starts."""
    average = torch.zeros(plan.shard_sizes[0])
    round_.own_shard_reduced(outcome_of(plan, 0, [A, B, C]), None, average)
    round_.exchanges_over()


def test_a_clean_round_averages_every_shard_and_names_everyone():
    round_, plan = round_of(group_of(*NODES))
    assert round_.my_shard == 0 and round_.exchanges() == [1, 2]
    for shard, value in ((1, 1.0), (2, 2.0)):
        round_.shard_averaged(shard, [[A, B, C]] * plan.num_parts(shard), parts_of(plan, shard, value))
    finish_exchanges(round_, plan)
    round_.screen(set(), lambda peer: "")
    assert round_.in_state(ShardState.AVERAGED) == [0, 1, 2]
    # our own shard's average as one piece, the others part by part
    expected = [0] + [start for s in (1, 2) for start, _ in plan.parts(s)]
    assert sorted(offset for offset, _ in round_.averages()) == expected
    result = round_.finish(link_rate=5.0, seconds=1.5)
    assert result.succeeded and result.link_rate == 5.0 and result.seconds == 1.5
    assert result.contributors == {0: [A, B, C], 1: [A, B, C], 2: [A, B, C]}
    assert result.plan is plan and result.my_shard == 0 and round_.phase is RoundPhase.DONE


def test_a_sender_left_out_midway_is_dropped_and_stays_in_the_parts_before():
    round_, plan = round_of(group_of(*NODES))
    parts = plan.num_parts(1)
    named = [[A, B, C]] + [[A, B]] * (parts - 1)  # C was dropped after the first part
    round_.shard_averaged(1, named, parts_of(plan, 1, 1.0))
    round_.shard_averaged(2, [[A, B, C]] * plan.num_parts(2), parts_of(plan, 2, 2.0))
    finish_exchanges(round_, plan)
    round_.screen(set(), lambda peer: "")
    assert round_.senders[C].state is SenderState.DROPPED and round_.senders[C].dropped_by == B
    result = round_.finish()
    assert result.failed_peers == {C} and result.contributors[1] == [A, B]
    assert result.part_contributors[1] == named and not result.local_shards  # its average is used


def test_a_reducer_that_leaves_only_us_out_fails_nobody():
    round_, plan = round_of(group_of(*NODES))
    round_.shard_averaged(1, [[B, C]] * plan.num_parts(1), parts_of(plan, 1, 1.0))
    assert round_.senders[A].state is SenderState.IN


def test_a_failed_reducer_keeps_our_values_for_its_shard_with_the_reason():
    round_, plan = round_of(group_of(*NODES))
    round_.shard_failed(1, "gave up: stalled")
    round_.shard_averaged(2, [[A, B, C]] * plan.num_parts(2), parts_of(plan, 2, 2.0))
    finish_exchanges(round_, plan)
    round_.screen(set(), lambda peer: "")
    start, end = plan.shard_bounds(1)
    assert all(not start <= offset < end for offset, _ in round_.averages())
    result = round_.finish()
    assert result.local_shards == {1: "gave up: stalled"} and result.failed_peers == {B}
    assert 1 not in result.contributors


def test_our_own_shard_without_a_contribution_stays_local_and_blames_nobody():
    round_, plan = round_of(group_of(*NODES))
    empty = ReductionOutcome(None, [], {B: "finished with 2 parts missing"}, [])
    round_.own_shard_reduced(empty)
    round_.shard_failed(1, "x")
    round_.shard_failed(2, "y")
    round_.exchanges_over()
    result = round_.finish()
    assert result.local_shards[0] == "no contribution arrived"
    assert result.failed_peers == {B, C}  # B as a dropped sender, C as a failed reducer; never us


def test_bans_and_checks_judge_averaged_shards_only():
    round_, plan = round_of(group_of(*NODES))
    for shard in (1, 2):
        round_.shard_averaged(shard, [[A, B, C]] * plan.num_parts(shard), parts_of(plan, shard, 1.0))
    finish_exchanges(round_, plan)
    round_.screen({B, A}, lambda peer: "lied before")  # (our own shard is never screened)
    assert round_.shards[1].state is ShardState.BANNED and round_.shards[0].state is ShardState.AVERAGED
    assert [offset for offset, _ in round_.received()] == [start for start, _ in plan.parts(2)]
    round_.checked(2, C, "its reply is 3 away from the aggregate of its own inputs")
    result = round_.finish()
    assert result.local_shards == {
        1: "reducer banned: lied before",
        2: "reducer failed its check: its reply is 3 away from the aggregate of its own inputs",
    }
    verdict = "its reply is 3 away from the aggregate of its own inputs"
    assert result.failed_peers == {B, C} and result.reducer_checks == {2: (C, verdict)}


def test_a_check_that_holds_keeps_the_average():
    round_, plan = round_of(group_of(*NODES))
    for shard in (1, 2):
        round_.shard_averaged(shard, [[A, B, C]] * plan.num_parts(shard), parts_of(plan, shard, 1.0))
    finish_exchanges(round_, plan)
    round_.checked(1, B, None)
    assert round_.shards[1].state is ShardState.CHECKED
    assert len(round_.averages()) == 1 + plan.num_parts(1) + plan.num_parts(2)
    assert round_.finish().reducer_checks == {1: (B, None)}


def test_empty_shards_start_averaged_and_a_peer_that_sends_nothing_writes_nothing():
    # three values over three reducers in parts of two: every shard is tiny, some are empty
    group = group_of(AveragingMode.NODE, AveragingMode.NODE, AveragingMode.AUX)
    round_, plan = round_of(group, total=1, me=C, sends=False)
    empty = [i for i, size in enumerate(plan.shard_sizes) if not size and i != round_.my_shard]
    assert empty and all(round_.shards[i].state is ShardState.AVERAGED for i in empty)
    assert round_.exchanges() == [] and round_.my_shard is not None
    round_.own_shard_reduced(outcome_of(plan, round_.my_shard, [A, B]))
    round_.exchanges_over()
    round_.screen({A, B}, lambda peer: "banned")  # nothing of ours to protect
    result = round_.finish()
    assert not result.local_shards and all(result.contributors[i] == [A, B] for i in empty)


@pytest.mark.parametrize(
    "misstep",
    [
        lambda r, plan: r.shard_averaged(1, [[A, B, C]], parts_of(plan, 1, 1.0)),  # twice
        lambda r, plan: r.shard_failed(1, "late"),  # after its average came
        lambda r, plan: r.checked(1, B, None),  # during the exchanges
        lambda r, plan: r.finish(),  # before the exchanges are over
        lambda r, plan: r.shard_failed(7, "no such shard"),
    ],
)
def test_an_event_the_table_does_not_allow_breaks_the_round_for_good(misstep):
    round_, plan = round_of(group_of(*NODES))
    round_.shard_averaged(1, [[A, B, C]] * plan.num_parts(1), parts_of(plan, 1, 1.0))
    with pytest.raises(RoundStateError):
        misstep(round_, plan)
    with pytest.raises(RoundStateError):  # sticky: no later event is taken
        round_.shard_failed(2, "anything")
    assert round_.broken is not None


def test_a_check_of_the_wrong_reducer_is_refused():
    round_, plan = round_of(group_of(*NODES))
    for shard in (1, 2):
        round_.shard_averaged(shard, [[A, B, C]] * plan.num_parts(shard), parts_of(plan, shard, 1.0))
    finish_exchanges(round_, plan)
    with pytest.raises(RoundStateError, match="not reduced by"):
        round_.checked(1, C, None)


def exclusions_round(named_by: dict[int, list[PeerID]], modes=NODES, me: PeerID = C):
    """Shard ``i``'s average names ``named_by[i]`` after its first part (everyone before); our
    own reduction took everyone in."""
    group = group_of(*modes)
    everyone = [m.peer_id for m in group.senders]
    round_, plan = round_of(group, me=me)
    for shard, named in named_by.items():
        round_.shard_averaged(shard, [everyone] + [named] * (plan.num_parts(shard) - 1), parts_of(plan, shard, 1.0))
    assert round_.my_shard is not None
    round_.own_shard_reduced(
        outcome_of(plan, round_.my_shard, everyone), None, torch.zeros(plan.shard_sizes[round_.my_shard])
    )
    round_.exchanges_over()
    round_.screen(set(), lambda peer: "")
    return round_, plan


def test_an_average_that_left_us_out_while_the_others_took_us_in_keeps_our_own_values():
    # B left us out while A took us in whole: B's average is not ours, and B is named
    round_, plan = exclusions_round({0: [A, B, C], 1: [A, B]})
    assert round_.unjust_exclusions() == [B] and round_.took_us_in() == [A]
    assert round_.in_state(ShardState.AVERAGED) == [0, 2] and round_.in_state(ShardState.LEFT_OUT) == [1]
    assert plan.shard_bounds(1) in round_.unaveraged()
    result = round_.finish()
    assert "left out us" in result.local_shards[1] and B in result.failed_peers and C not in result.failed_peers
    # a pair: nothing to compare, so an average that left us out is not ours either
    round_, plan = exclusions_round({0: [A]}, modes=NODES[:2], me=B)
    assert round_.unjust_exclusions() == [A] and round_.in_state(ShardState.LEFT_OUT) == [0]


def test_one_other_sender_left_out_unjustly_does_not_discard_an_average_and_a_quarter_does():
    """Any sender can get itself dropped by a reducer on purpose (a stream ended early): alone it
    must not make that reducer's average unused for everyone. Two such, a quarter of a group of 4
    or more, do: a censor could hand CenteredClip's majority to the rest that way."""
    round_, plan = exclusions_round({0: [A, B, C], 1: [B, C]})  # B left A out; our shard took A in
    assert round_.unjust_exclusions() == [] and round_.in_state(ShardState.LEFT_OUT) == []
    four = (AveragingMode.NODE,) * 4
    round_, plan = exclusions_round({0: [A, B, C, D], 1: [B, C], 3: [A, B, C, D]}, modes=four)
    assert round_.unjust_exclusions() == [] and round_.in_state(ShardState.LEFT_OUT) == [1]
    assert "2 senders" in round_.finish().local_shards[1]


def test_averages_that_left_out_a_sender_late_for_most_reducers_are_used():
    """We were late: both other reducers left us out (our own reduction holding us says nothing
    of it). Their averages are used, and checked as any, so we stay with the swarm; rounds that
    left us out forgive nobody."""
    round_, plan = exclusions_round({0: [A, B], 1: [A, B]})
    assert round_.unjust_exclusions() == [] and round_.took_us_in() == []
    assert round_.in_state(ShardState.AVERAGED) == [0, 1, 2]


def test_only_reducers_that_send_testify_to_who_was_late():
    """B reduces but sends nothing (an identity that costs an attacker less): its word that we
    were late does not count, so A's average that left us out is not ours (nothing else to
    compare: as in a pair)."""
    modes = (AveragingMode.NODE, AveragingMode.AUX, AveragingMode.NODE)
    round_, plan = exclusions_round({0: [A], 1: [A]}, modes=modes)
    assert round_.unjust_exclusions() == [A] and round_.in_state(ShardState.LEFT_OUT) == [0]
