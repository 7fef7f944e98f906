"""Steps in a rhythm: an averager stepped by a training loop forms its next group before the next
step is called, so that step starts its all-reduce at once instead of after a DHT read, a settle
time and the joins.

A script calls ``step`` every so often (its period: the time from one step's start to the next,
training included, less the time the earlier step spent finding its group, which a group formed
ahead saves: the first step's matchmaking reads and settles in full, later ones may not). Once a
step's group is known, the next step may come as soon as the shortest of the last
``RHYTHM_STEPS`` periods (a loop's intervals vary: an evaluation every few steps, a slow batch),
and the next round's matchmaking is planned to begin ``lead`` seconds before that (at once if
that period is shorter than the lead: while this step's all-reduce runs), though no sooner than
the last period less matchmaking's deadline, which it would otherwise run out before a step that
comes as the last one did; a step that formed no group adds no period (a loop may retry it at
once). As a leader, the group stays open to latecomers until our step comes (``find_group``'s
``hold_open``), as the collaborative optimizer's groups formed ahead do (``match_ahead.py``).
What the next step finds:

* the group, formed: it averages with it at once;
* matchmaking under way: it waits for it (bounded by matchmaking's own deadline);
* matchmaking not begun yet (the step came sooner than any recent period): it is dropped, and
  the step matches itself;
* nothing (the first steps, before there is a period; matchmaking ahead failed): the step matches.

A group formed ahead is used however long ago it formed. A step that dropped an old group would
match its round again, and that round is matched: its leaders refuse joins for it (``joins.py``),
so peers that step late together (a pause in every peer's training) would split into smaller
groups, one left alone until matchmaking's deadline (in the lab's interleaved steps,
``benchmarks/wan.py``, a rule on a group's age lost 2 of 8 steps). A member that steps later than
the others wait for it (``allreduce.ROUND_WAIT``) has its parts refused at once
(``allreduce_protocol.RoundOver``), which also tells its own shard that they send it none: its
step ends within a round trip, those members failed and its values its own.

The first two steps match at the step, as does a step that comes sooner than any recent period;
the others save matchmaking's time. Nothing is formed ahead unless a step is about to come, so a
script that stops stepping leaves a declaration that lives out its short lifetime, as a peer that
leaves does.
"""

from __future__ import annotations

import collections
import functools
import logging

import trio

from .averager import AveragingRound, FormedGroup, GroupAverager
from .later import Later, TaskSpawner
from .match_ahead import JOIN_ALLOWANCE, wait_for_group
from .settling import DEFAULT_SETTLE

__all__ = ["StepAhead", "RHYTHM_STEPS"]

log = logging.getLogger("peerd.averaging")

# The periods the next step's soonest time is taken from (the shortest of them): a group that
# forms too early waits for its step, used whatever its age; one planned too late is dropped.
RHYTHM_STEPS = 4


class _Ahead:
    """The next round's matchmaking: planned, then under way, then done."""

    def __init__(self, round_number: int) -> None:
        self.round = round_number
        self.begun = trio.Event()  # find_group was called
        self.due = trio.Event()  # our step came: a leader stops holding the group open
        self.formed: Later[FormedGroup | None] | None = None


class StepAhead:
    """``averager``'s steps, each forming the next round's group ahead (tasks run in ``tasks``)."""

    def __init__(self, averager: GroupAverager, tasks: TaskSpawner):
        self.averager = averager
        self.tasks = tasks
        settle = averager.settings.settle_time
        self.lead = (settle if settle is not None else DEFAULT_SETTLE) + JOIN_ALLOWANCE
        self.period: float | None = None  # between the last two steps' starts, less finding a group
        self._periods: collections.deque[float] = collections.deque(maxlen=RHYTHM_STEPS)
        self.last_wait_s = 0.0  # how long the last step waited for its group formed ahead
        self._last_start: float | None = None
        self._grouped_in: float | None = None  # how long the last step took to know its group
        self._last_failed = False  # the last step formed no group
        self._ahead: _Ahead | None = None

    async def step(self, weight: float = 1.0, timeout: float | None = None) -> AveragingRound:
        """``GroupAverager.step``, with the group formed ahead when there is one to use."""
        started = trio.current_time()
        if self._last_start is not None:
            self.period = max(0.0, started - self._last_start - (self._grouped_in or 0.0))
            if not self._last_failed:  # (a retry at once after a failed step is no interval of the loop)
                self._periods.append(self.period)
        self._last_start, self._grouped_in, self._last_failed = started, None, False
        group = await self._collect()
        try:
            return await self.averager.step(
                weight, timeout, group=group, on_group=functools.partial(self._plan, started=started)
            )
        finally:
            if self._grouped_in is None:  # no group formed: the whole step went into looking for one
                self._grouped_in = trio.current_time() - started
                self._last_failed = True

    async def close(self) -> None:
        """Drop any matchmaking ahead and wait until it is out (before leaving the swarm)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.formed is not None:
            ahead.formed.cancel()
            await ahead.formed.wait()

    def _plan(self, group: FormedGroup, *, started: float) -> None:
        now = trio.current_time()
        self._grouped_in = now - started
        if not self._periods:
            return  # no rhythm yet
        ahead = self._ahead = _Ahead(group.round + 1)
        # by the soonest recent interval, but late enough that matchmaking, which gives up after its
        # deadline, still runs when the last interval says the step comes
        latest_useful = self.period - self.averager.settings.matchmaking_timeout + self.lead
        begin = now + max(min(self._periods) - self.lead, latest_useful)
        ahead.formed = Later(self.tasks, functools.partial(self._match, ahead, begin))

    async def _match(self, ahead: _Ahead, begin: float) -> FormedGroup | None:
        await trio.sleep_until(begin)
        ahead.begun.set()
        try:
            return await self.averager.find_group(ahead.round, hold_open=ahead.due)
        except Exception as error:  # a background task: whatever failed, the step matches itself
            log.info("matchmaking ahead of round %d failed (%s); matching at the step", ahead.round, error)
            return None

    async def _collect(self) -> FormedGroup | None:
        """The group formed ahead for this step, or None (the step matches itself)."""
        self.last_wait_s = 0.0
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.formed is None:
            return None
        if not ahead.begun.is_set() or ahead.round != self.averager.round:
            ahead.formed.cancel()  # not begun: the step came early; or our round moved meanwhile
            await ahead.formed.wait()
            return None
        group, self.last_wait_s = await wait_for_group(ahead.formed, ahead.due)
        return group
