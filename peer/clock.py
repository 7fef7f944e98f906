"""Where a peer reads the time of day: a clock object, so that a simulated swarm can run on time
that only trio's clock moves.

Timeouts, deadlines and sleeps in peerd already follow trio's clock (``trio.current_time``,
``trio.sleep``, cancel scopes), which ``trio.testing.MockClock`` can run in virtual time. What
does not are readings of the wall clock (DHT record expirations and signing versions) and the
DHT's monotonic bookkeeping (failure backoff): those read a ``Clock``.

``SYSTEM_CLOCK`` (``time.time`` and ``time.monotonic``) is the default everywhere and the only
clock of ``peerd``. ``TrioClock`` follows trio's clock instead: under
``trio.testing.MockClock(autojump_threshold=0)`` an hour of record lifetimes passes in no real
time, and every peer of the run reads the same time of day.
"""

from __future__ import annotations

import time
from typing import Protocol

import trio

__all__ = ["Clock", "SystemClock", "SYSTEM_CLOCK", "TrioClock", "SIMULATED_EPOCH"]

# 2026-01-01T00:00:00Z: a fixed time of day for simulated runs, so that their record versions and
# expirations do not depend on when the run happened.
SIMULATED_EPOCH = 1_767_225_600.0


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch (what record expirations are in)."""
        ...

    def monotonic(self) -> float:
        """Seconds that only go forward, from an arbitrary origin (for intervals and backoff)."""
        ...


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()


class TrioClock:
    """Time as the running trio clock says: ``epoch`` plus ``trio.current_time()`` for the time of
    day. Only inside ``trio.run``; meant for runs under a ``MockClock``, whose time starts at 0."""

    def __init__(self, epoch: float = SIMULATED_EPOCH):
        self.epoch = epoch

    def time(self) -> float:
        return self.epoch + trio.current_time()

    def monotonic(self) -> float:
        return trio.current_time()
