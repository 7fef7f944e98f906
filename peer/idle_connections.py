"""Which connections have been idle long enough to retire, sans I/O.

A DHT node calls whomever its lookups lead to, and every answer leaves a connection behind: after
joining, a node of a 256-node swarm held ~128 connections (half the swarm), each with its buffers,
cipher states and two tasks (~30 KB), so a node's memory grew with the swarm, and a node of a
5,000-node DHT would hold thousands. A connection that carried nothing for ``IDLE_RETIRE_S`` is
retired (GOAWAY, ``rpc_protocol.py``: no call in flight is lost); the next call dials again, which
costs a handshake, seldom, against memory held for good. A swarm's working set (the averaging
group, the holders of the keys a peer reads each round) stays connected, since it is never idle
that long; a relay's reservation is renewed every ~20 s, so its connection stays too.

The host looks every ``IDLE_CHECK_S``; a connection counts as idle from the first look that finds
it with no call open and no byte moved since the look before, so it is retired between
``IDLE_RETIRE_S`` and ``IDLE_RETIRE_S`` + ``IDLE_CHECK_S`` after its last activity.

Rounds further apart than that would cut the working set every round: in the simulated swarm of
128 peers (rounds ~2 minutes apart) each peer retired ~24 connections a round and dialled them
again the next, a Noise handshake each (12 once recurring peers kept theirs). So
a peer whose connection was retired and who is called again within ``IDLE_RETIRE_MAX`` showed that
its quiet was a rhythm, not the end (``RecurringPeers``): its connections may stay idle for
``RECUR_MARGIN`` times the quiet it came back from, up to ``IDLE_RETIRE_MAX``. Peers met once
(a lookup's path) still go after ``IDLE_RETIRE_S``, so a node's connections stay its working set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

__all__ = ["IDLE_CHECK_S", "IDLE_RETIRE_MAX", "IDLE_RETIRE_S", "IdleConnections", "RecurringPeers"]

# Longer than a volunteer swarm's rounds are apart (the same group's peers call each other within a
# round, every few seconds), as long as HTTP servers keep idle keep-alive connections (60-90 s).
IDLE_RETIRE_S = 90.0
IDLE_CHECK_S = 15.0
# A peer called again after its connection was retired may stay idle this much longer than the
# quiet it came back from, up to ten minutes (an outer round of local updates, a slow collaborative
# step); RecurringPeers remembers at most MAX_RECURRING such peers (the least recently met go).
RECUR_MARGIN = 1.5
IDLE_RETIRE_MAX = 600.0
MAX_RECURRING = 1024

# What a look sees of a connection: (bytes delivered, bytes arrived) and how many calls are open.
Activity = tuple[tuple[int, int], int]


class IdleConnections:
    """Remembers, per connection, what it looked like and since when it has looked so."""

    def __init__(self, retire_after: float = IDLE_RETIRE_S):
        if retire_after <= 0:
            raise ValueError("connections retire after a positive idle time")
        self.retire_after = retire_after
        self._seen: dict[Hashable, tuple[Activity, float]] = {}
        # Connections given an allowance, until ``forget``: it and since when the looks have found
        # each quiet, kept after the looks stop seeing it (retiring), for what its close teaches.
        self._allowed: dict[Hashable, float] = {}
        self._quiet_since: dict[Hashable, float] = {}

    def allow(self, key: Hashable, seconds: float) -> None:
        """Connection ``key`` retires after ``seconds`` idle (at least ``retire_after``); it is
        remembered until ``forget(key)``."""
        self._allowed[key] = max(seconds, self.retire_after)

    def allowance(self, key: Hashable) -> float:
        return self._allowed.get(key, self.retire_after)

    def forget(self, key: Hashable) -> float | None:
        """Connection ``key`` is gone: forget it; since when the looks had found it quiet (None if
        none had)."""
        self._allowed.pop(key, None)
        return self._quiet_since.pop(key, None)

    def look(self, connections: Iterable[tuple[Hashable, Activity]], now: float) -> list[Hashable]:
        """The connections (of those given: the live ones) idle for their allowance by now.
        What they looked like is forgotten for connections not given (their allowances are not)."""
        seen, idle = {}, []
        for key, activity in connections:
            before = self._seen.get(key)
            if activity[1] or before is None or before[0] != activity:
                seen[key] = (activity, now)  # busy, new, or moved: idle from now at the earliest
                continue
            seen[key] = before
            if key in self._allowed:
                self._quiet_since[key] = before[1]
            if now - before[1] >= self.allowance(key):
                idle.append(key)
        self._seen = seen
        return idle


class RecurringPeers:
    """Peers whose connection we retired and who came back: how long their connections may idle.

    Sans I/O: the pool says when it retires a peer's connection (after what idle allowance) and
    when a peer connects again; it asks what idle allowance the new connection gets."""

    def __init__(self, base: float = IDLE_RETIRE_S, maximum: float = IDLE_RETIRE_MAX, remembered: int = MAX_RECURRING):
        self.base, self.maximum, self.remembered = base, maximum, remembered
        self._retired: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # -> (when, after idle)
        self._allowance: OrderedDict[Hashable, float] = OrderedDict()

    def retired(self, peer: Hashable, now: float, idle_for: float) -> None:
        """We retired ``peer``'s connection at ``now``, after it had been idle ``idle_for`` seconds."""
        self._retired[peer] = (now, idle_for)
        self._retired.move_to_end(peer)
        self._trim(self._retired)

    def connected(self, peer: Hashable, now: float) -> float:
        """``peer`` has a new connection at ``now``: the idle allowance it gets."""
        retired = self._retired.pop(peer, None)
        if retired is not None and now - retired[0] <= self.maximum:
            quiet = now - retired[0] + retired[1]
            self._allowance[peer] = min(self.maximum, max(self.base, RECUR_MARGIN * quiet))
        elif retired is not None:  # back too late to be a rhythm: met once again
            self._allowance.pop(peer, None)
        allowance = self._allowance.get(peer, self.base)
        if peer in self._allowance:
            self._allowance.move_to_end(peer)
            self._trim(self._allowance)
        return allowance

    def _trim(self, entries: OrderedDict) -> None:
        while len(entries) > self.remembered:
            entries.popitem(last=False)
