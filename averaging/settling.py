"""How long a matchmaking peer lets the round's declarations spread before it reads them
(``Matchmaker``, step 2 of ``matchmaking.py``).

A read that comes too early misses declarations that have not yet reached the key's holders, and
peers whose views differ elect different leaders. So a peer waits as long as its own store took to
land on most holders (the others' took about as long), at least a settle time, and at most a
quarter of the deadline: the rest is for joining. It stops waiting sooner when the view is as
complete as the last one was (``view_settled``), or, in a large swarm, when a join waits for its
choice of role (``Joins.asked_to_lead``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from peer import PeerID

from .gathering import Declaration
from .matchmaking_rules import view_settled

__all__ = ["DEFAULT_SETTLE", "EARLY_SETTLE_VIEW", "SETTLE_POLL", "SETTLE_READS", "settle"]

# Declarations need a moment to reach the k nearest DHT peers before anyone reads them: 0.5 s, or as
# long as our own store took if longer (the others' take about as long; across the internet a
# lookup takes several round trips), that at most a quarter of the deadline, the rest for joining.
DEFAULT_SETTLE = 0.5
# While settling, the declarations are read to see whether the last view is complete: at most
# SETTLE_READS times (the first at once), at least SETTLE_POLL apart, and only in swarms whose last
# view had fewer than EARLY_SETTLE_VIEW other peers: there a read is a few small answers, while
# in a large swarm every peer reading many times would multiply the load on the key's holders.
SETTLE_POLL = 0.05
SETTLE_READS = 4
EARLY_SETTLE_VIEW = 16


async def settle(
    me: Declaration,
    read: Callable[[], Awaitable[dict[PeerID, Declaration]]],
    last_view: frozenset[PeerID],
    asked_to_lead: trio.Event,
    *,
    settle_time: float | None,
    timeout: float,
    stored_in: float,
) -> dict[PeerID, Declaration] | None:
    """Let declarations spread as long as our store took (at least the settle time) or until the
    view is as complete as ``last_view`` (``view_settled``): that view, or None after the full time.
    ``read``: one read of the round's declarations; ``settle_time``: the least wait asked for
    (None: ``DEFAULT_SETTLE``); ``timeout``: matchmaking's; ``stored_in``: how long our own store
    took.

    In a large swarm, a join that waits for our choice ends the wait (``asked_to_lead``): its peer
    has read the declarations, ours among them, so theirs have spread; waiting on would spend its
    patience (a peer whose round began late leads a group whose members read long ago). A joiner
    can end it early at most once a round, and a view it leaves short is what the leader's
    confirming read is for."""
    least = settle_time if settle_time is not None else min(DEFAULT_SETTLE, timeout / 4)
    wait = max(least, min(stored_in, timeout / 4))
    if not last_view or len(last_view) >= EARLY_SETTLE_VIEW:
        with trio.move_on_after(wait):
            await asked_to_lead.wait()
        return None
    with trio.move_on_after(wait):
        for _ in range(SETTLE_READS):
            candidates = await read()
            if view_settled(last_view, candidates, me.round):
                return candidates
            await trio.sleep(max(SETTLE_POLL, wait / SETTLE_READS))
        await trio.sleep(wait)  # (the rest of it)
    return None
