"""The elected leader's wait for its group (``Matchmaker.lead``): joins are admitted to its open
invitation (``Gathering``, served by ``Joins``) until every expected member asked, the group is
full, the swarm has moved on (``Gathering.overtaken``), or the time left to answer the followers
runs out; then the group forms with whoever joined, ordered by peer ID, under a fresh group ID.

The wait never runs to the whole deadline: the followers need time to receive the answer and the
all-reduce time to start (``Gathering.answer_by``). Joiners that name members the leader did not
expect make it read the declarations again (``confirm``), and members still missing are asked
whether they still come (``ask``, ``stragglers.py``)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import trio

from peer import PeerID

from .gathering import ANSWER_MARGIN, Gathering
from .group import GroupInfo
from .joins import Joins
from .matchmaking_errors import MatchmakingError
from .stragglers import stop_waiting_for_stragglers

__all__ = ["gather"]


async def gather(
    joins: Joins,
    gathering: Gathering,
    min_size: int,
    deadline: float,
    hold_open: trio.Event | None = None,
    confirm: Callable[[], Awaitable[set[PeerID]]] | None = None,
    ask: Callable[[PeerID], Awaitable[str | None]] | None = None,
) -> GroupInfo:
    """Lead ``gathering`` (opened on ``joins``) until it completes or the time to answer runs out;
    a group of fewer than ``min_size`` raises MatchmakingError. Held open (``hold_open``), the
    wait ends no sooner than the event is set."""
    joins.open(gathering)
    try:
        async with trio.open_nursery() as waking:
            if hold_open is not None:
                waking.start_soon(gathering.changed_when(hold_open))
            if ask is not None:
                waking.start_soon(stop_waiting_for_stragglers, gathering, ask)
            while not gathering.full:
                answer_by = min(deadline - ANSWER_MARGIN, gathering.answer_by)
                if gathering.unconfirmed:  # (settled by a read, or unread: the places they hold free up)
                    found: set[PeerID] = set()
                    if confirm is not None and not gathering.overtaken:
                        with trio.move_on_at(answer_by):
                            found = await confirm()
                    gathering.confirm(found)
                    continue
                if gathering.complete and (hold_open is None or hold_open.is_set()):
                    break
                with trio.move_on_at(answer_by) as scope:
                    await gathering.changed.wait()
                if scope.cancelled_caught:
                    break
            waking.cancel_scope.cancel()
        members = [gathering.me, *sorted(gathering.joined.values(), key=lambda d: d.peer_id.to_bytes())]
        if len(members) < min_size:
            ahead = ", and the next round's peers ask for us" if gathering.overtaken else ""
            raise MatchmakingError(f"only {len(members)} peer(s) joined (need {min_size}){ahead}")
        gathering.formed = GroupInfo(os.urandom(16), tuple(d.member() for d in members))
        return gathering.formed
    finally:
        joins.close()
        gathering.close()
