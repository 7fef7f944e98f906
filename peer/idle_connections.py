"""Which connections have been idle long enough to retire, sans I/O.

A DHT node calls whomever its lookups lead to, and every answer leaves a connection behind: after
joining, a node of a 256-node swarm held ~128 connections (half the swarm), each with its buffers,
cipher states and two tasks (~30 KB), so a node's memory grew with the swarm, and a node of a
5,000-node DHT would hold thousands. A connection that carried nothing for ``IDLE_RETIRE_S`` is
retired (GOAWAY, ``rpc_protocol.py``: no call in flight is lost); the next call dials again, which
costs a handshake, seldom, against memory held for good. A swarm's working set (the averaging
group, the holders of the keys a peer reads each round) stays connected, since it is never idle
that long; a relay's reservation is renewed every ~40 s, so its connection stays too.

The host looks every ``IDLE_CHECK_S``; a connection counts as idle from the first look that finds
it with no call open and no byte moved since the look before, so it is retired between
``IDLE_RETIRE_S`` and ``IDLE_RETIRE_S + IDLE_CHECK_S`` after its last activity.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["IDLE_CHECK_S", "IDLE_RETIRE_S", "IdleConnections"]

# Longer than a volunteer swarm's rounds are apart (the same group's peers call each other within a
# round, every few seconds), as long as HTTP servers keep idle keep-alive connections (60-90 s).
IDLE_RETIRE_S = 90.0
IDLE_CHECK_S = 15.0

# What a look sees of a connection: (bytes delivered, bytes arrived) and how many calls are open.
Activity = tuple[tuple[int, int], int]


class IdleConnections:
    """Remembers, per connection, what it looked like and since when it has looked so."""

    def __init__(self, retire_after: float = IDLE_RETIRE_S):
        if retire_after <= 0:
            raise ValueError("connections retire after a positive idle time")
        self.retire_after = retire_after
        self._seen: dict[Hashable, tuple[Activity, float]] = {}

    def look(self, connections: Iterable[tuple[Hashable, Activity]], now: float) -> list[Hashable]:
        """The connections (of those given: the live ones) idle for ``retire_after`` by now.
        Connections not given are forgotten."""
        seen, idle = {}, []
        for key, activity in connections:
            before = self._seen.get(key)
            if activity[1] or before is None or before[0] != activity:
                seen[key] = (activity, now)  # busy, new, or moved: idle from now at the earliest
                continue
            seen[key] = before
            if now - before[1] >= self.retire_after:
                idle.append(key)
        self._seen = seen
        return idle
