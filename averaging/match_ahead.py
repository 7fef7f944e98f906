"""Matchmaking ahead of the step: a collaborative peer looks for its group while it still
accumulates the epoch, so that when the swarm reaches the target batch the all-reduce starts at
once instead of after a DHT round, a settle time and the joins.

As Hivemind schedules it: once the swarm's predicted time to the target batch (the samples still
missing over the swarm's samples per second) is within the time matchmaking takes (``lead``), the
peer declares itself for the epoch's round and forms the group in the background. A group holds
no tensors and no weights; those go in at the step, which runs the group's all-reduce. The swarm's
rate is the sum of the peers' claims: an overstated one only starts matchmaking earlier, which
costs nothing but an older group (one that a member may have left by the step).

What can happen to a group formed ahead, and what the step does:

* a peer starts matching a little after the others (it saw the swarm's progress later): a leader
  matching ahead keeps admitting latecomers until its group is full or its own step comes, so
  one that declared after the leader read the declarations still joins;
* our epoch ends before the group formed: the step waits for it, bounded by the matchmaking
  deadline (still less than starting matchmaking then);
* a member's epoch ends later than ours: peers see the target reached within a progress refresh
  (plus a local batch) of each other, and a reducer waits ``allreduce.ROUND_WAIT`` for a member's
  round to start, which covers that skew;
* a member leaves, or never steps (it loaded state instead): the all-reduce drops it as it drops a
  member that dies after matchmaking, and the others average without it;
* matchmaking ahead failed, or the group is for another epoch (we loaded state and moved on): it
  is dropped, and the step matches then as it would without matching ahead.

Whether groups form ahead is the caller's choice of schedule (``CollaborativeOptimizer``'s
``matching``): ``MatchAhead(nursery)``, which gives each of the optimizer's averagers a
``GroupAhead`` running in that nursery, or ``MatchAtStep()``, whose ``NoGroupAhead`` forms nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from .averager import FormedGroup, GroupAverager
from .later import Later
from .progress import SwarmProgress
from .settling import DEFAULT_SETTLE

__all__ = [
    "wait_for_group",
    "GroupAhead",
    "GroupSource",
    "MatchAhead",
    "MatchAtStep",
    "Matching",
    "NoGroupAhead",
    "matchmaking_due",
]

log = logging.getLogger("peerd.training")

# What a group formation takes beyond the settle time and a progress refresh: a DHT read and the
# joins, a few round trips (well under a second on the WANs peers train over). Formation times
# are not measured to set the lead: a leader held open until its step (``hold_open``) would measure
# the lead itself, and every epoch would start matchmaking earlier than the last.
JOIN_ALLOWANCE = 0.5


def matchmaking_due(view: SwarmProgress, epoch: int, target_batch_size: int, lead: float) -> bool:
    """The swarm is predicted to reach ``target_batch_size`` for ``epoch`` within ``lead`` seconds."""
    missing = target_batch_size - view.samples_at(epoch)
    if missing <= 0:
        return True
    rate = view.samples_per_s
    return rate > 0 and missing <= rate * lead


async def wait_for_group(formed: Later[FormedGroup | None], due: trio.Event) -> tuple[FormedGroup | None, float]:
    """The step came: tell a matchmaking formed ahead (``due``: a leader stops holding its group
    open) and wait for its group (bounded: matchmaking gives up at its own deadline). Returns the
    group (None if none formed) and how long the step waited. A step cancelled meanwhile cancels
    the matchmaking: nobody will average in its group."""
    began = trio.current_time()
    due.set()
    try:
        group = await formed.wait()
    except BaseException:
        formed.cancel()
        raise
    return group, trio.current_time() - began


class GroupSource(Protocol):
    """Where an optimizer's averager gets the group of its next round: formed ahead, or none
    (the round then matches at the step). ``key``: the epoch of the step that will use it."""

    lead: float  # how long before the predicted end of the epoch matchmaking starts
    last_wait_s: float  # how long the last step waited for its group once its epoch ended

    def start(self, key: int, round_number: int | None = None) -> Later[FormedGroup | None] | None: ...

    async def take(self, key: int) -> FormedGroup | None: ...

    def hand_over(self, key: int) -> Callable[[], Awaitable[FormedGroup | None]]: ...

    async def cancel(self) -> None: ...


class Matching(Protocol):
    """How an optimizer's groups form, as its caller chooses: ``MatchAtStep()`` or ``MatchAhead(nursery)``."""

    def for_averager(self, averager: GroupAverager, *, refresh_interval: float) -> GroupSource: ...


class NoGroupAhead:
    """Nothing is formed ahead: every round matches at its step."""

    lead = 0.0
    last_wait_s = 0.0

    def start(self, key: int, round_number: int | None = None) -> None:
        return None

    async def take(self, key: int) -> FormedGroup | None:
        return None

    def hand_over(self, key: int) -> Callable[[], Awaitable[FormedGroup | None]]:
        return _no_group

    async def cancel(self) -> None:
        """Nothing is ever in flight."""


async def _no_group() -> FormedGroup | None:
    return None


class MatchAtStep:
    """Each round forms its group at the step: nothing runs in the background."""

    def for_averager(self, averager: GroupAverager, *, refresh_interval: float) -> NoGroupAhead:
        return NoGroupAhead()


class MatchAhead:
    """Groups form in ``nursery`` while the epoch still accumulates (the daemon's choice)."""

    def __init__(self, nursery: trio.Nursery):
        self.nursery = nursery

    def for_averager(self, averager: GroupAverager, *, refresh_interval: float) -> GroupAhead:
        return GroupAhead(averager, self.nursery, refresh_interval=refresh_interval)


@dataclass
class _Matching:
    key: int  # the epoch of the step that will use the group
    formed: Later[FormedGroup | None]
    due: trio.Event = field(default_factory=trio.Event)  # the step came: stop waiting for latecomers


class GroupAhead:
    """Forms the group of ``averager``'s next round in ``nursery`` ahead of the step; at most one
    matchmaking in flight."""

    def __init__(self, averager: GroupAverager, nursery: trio.Nursery, *, refresh_interval: float):
        self.averager = averager
        self.nursery = nursery
        settle = averager.settings.settle_time
        self.lead = (settle if settle is not None else DEFAULT_SETTLE) + refresh_interval + JOIN_ALLOWANCE
        self.last_wait_s = 0.0
        self._matching: _Matching | None = None

    def start(self, key: int, round_number: int | None = None) -> Later[FormedGroup | None]:
        """Start forming the group for the round the step at epoch ``key`` will average in (declared
        at ``round_number``; None: the averager's own round), unless that is under way already;
        returns the matchmaking, which ends with the group (or None if none formed)."""
        matching = self._matching
        if matching is not None and matching.key == key:
            return matching.formed
        if matching is not None:  # for an epoch we left: its group is of no use
            matching.formed.cancel()
        due = trio.Event()
        formed = Later(self.nursery, functools.partial(self._match, key, round_number, due))
        self._matching = _Matching(key, formed, due)
        return formed

    async def take(self, key: int) -> FormedGroup | None:
        """The group formed ahead for the step at epoch ``key`` (waiting while it forms), or None:
        none was looked for, matchmaking failed, or it was for another epoch."""
        return await self.hand_over(key)()

    def hand_over(self, key: int) -> Callable[[], Awaitable[FormedGroup | None]]:
        """``take`` in two halves: the matchmaking for ``key`` is detached from this object now (a
        ``start`` for the next epoch no longer touches it), and the returned function waits for its
        group, as ``take`` does, wherever it is awaited (a round running in the background)."""
        matching, self._matching = self._matching, None
        return functools.partial(self._collect, key, matching)

    async def _collect(self, key: int, matching: _Matching | None) -> FormedGroup | None:
        self.last_wait_s = 0.0
        if matching is None:
            return None
        if matching.key != key:
            matching.formed.cancel()
            await matching.formed.wait()
            return None
        formed, self.last_wait_s = await wait_for_group(matching.formed, matching.due)
        return formed

    async def cancel(self) -> None:
        """Drop any matchmaking in flight and wait until it is out."""
        matching, self._matching = self._matching, None
        if matching is not None:
            matching.formed.cancel()
            await matching.formed.wait()

    async def _match(self, key: int, round_number: int | None, due: trio.Event) -> FormedGroup | None:
        try:
            return await self.averager.find_group(round_number, hold_open=due)
        except Exception as error:  # a background task: whatever failed, the step matches itself
            log.info("matchmaking ahead of epoch %d failed (%s); matching at the step", key, error)
            return None
