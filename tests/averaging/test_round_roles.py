"""The trio roles of one round (``averaging/round_roles.py``): a sender's streams take turns part
by part (``PartPacer``), and a reducer role's lifecycle is one state (reducing -> closed, or
reducing -> cancelled)."""

from __future__ import annotations

import torch
import trio
import trio.testing

from averaging.compression import get_codec
from averaging.link_speed import DeadlineRules
from averaging.part_buffers import PartBuffers
from averaging.reducer_shard import ReducerShard
from averaging.round_links import RoundLinks
from averaging.round_roles import PartPacer, ReducerRole, RoleState
from peer import PeerID

ME, OTHER = PeerID(b"m" * 20), PeerID(b"o" * 20)


async def test_a_senders_streams_take_turns_until_one_is_stuck():
    pacer = PartPacer(window=1)
    for key in (0, 1):
        pacer.join(key)
    for _ in range(2):
        await pacer.turn(0, patience=10)
        pacer.sent(0)
    with trio.move_on_after(0.05) as blocked:  # two parts ahead of stream 1: its turn must wait
        await pacer.turn(0, patience=10)
    assert blocked.cancelled_caught
    pacer.sent(1)
    await pacer.turn(0, patience=10)  # stream 1 caught up by one
    pacer.sent(0)
    start = trio.current_time()
    await pacer.turn(0, patience=0.05)  # stream 1 stays stuck: it stops pacing stream 0
    assert trio.current_time() - start >= 0.05
    await pacer.turn(0, patience=0.05)
    pacer.sent(0)


async def test_a_stuck_stream_released_by_one_waiter_is_not_followed_by_a_healthy_one():
    """Two fast streams time out waiting for the same stuck one: only stuck streams stop pacing."""
    pacer = PartPacer(window=1)
    for key in (0, 1, 2):
        pacer.join(key)
    for key in (0, 1):
        for _ in range(2):
            pacer.sent(key)  # streams 0 and 1 are two parts ahead of stuck stream 2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.turn, 0, 0.05)
        nursery.start_soon(pacer.turn, 1, 0.05)
    pacer.sent(1)  # stream 1 is still paced against stream 0, which was not let go
    with trio.move_on_after(0.05) as blocked:
        await pacer.turn(1, patience=10)
    assert not blocked.cancelled_caught  # 3 vs 2: within the window of stream 0
    pacer.sent(1)
    with trio.move_on_after(0.05) as blocked:
        await pacer.turn(1, patience=10)
    assert blocked.cancelled_caught  # 4 vs 2: stream 0 still paces it


def role_for(senders, lease) -> ReducerRole:
    shard = ReducerShard([2, 2], list(senders), None)
    return ReducerRole(shard, lease, 4, get_codec("none"), RoundLinks(None, [s for s in senders if s != ME]))


async def test_a_reducer_role_closes_once_its_replies_are_made_and_a_late_cancel_changes_nothing():
    with PartBuffers().lease() as lease:
        role = role_for([ME], lease)  # we are the only sender: our own values are all it takes
        assert role.state is RoleState.REDUCING
        await role.reduce(ME, torch.arange(4.0), 1.0, DeadlineRules())
        assert role.state is RoleState.CLOSED and len(role.shard.replies) == 2
        role.cancel()  # (the round always cancels its role as it ends)
        assert role.state is RoleState.CLOSED


async def test_a_reducer_role_cancelled_while_it_waits_for_a_sender_stays_cancelled():
    with PartBuffers().lease() as lease:
        role = role_for([ME, OTHER], lease)  # OTHER never sends
        async with trio.open_nursery() as nursery:
            nursery.start_soon(role.reduce, ME, torch.arange(4.0), 1.0, DeadlineRules())
            await trio.testing.wait_all_tasks_blocked()
            assert role.state is RoleState.REDUCING and not role.shard.replies  # part 0 waits for OTHER
            role.cancel()
            assert role.state is RoleState.CANCELLED
            nursery.cancel_scope.cancel()  # what the round does to its roles next
        assert role.state is RoleState.CANCELLED
