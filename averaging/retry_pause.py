"""How long a matchmaking peer waits before it reads the declarations again after a failed attempt:
``FIRST_RETRY_PAUSE``, twice as long after each further failure, at most ``MAX_RETRY_PAUSE``, so
that a peer whose group cannot form (its members beyond a partition) does not read many times a
second, while one whose first attempt failed by a hair tries again at once."""

from __future__ import annotations

import trio

__all__ = ["FIRST_RETRY_PAUSE", "MAX_RETRY_PAUSE", "back_off"]

FIRST_RETRY_PAUSE = 0.05
MAX_RETRY_PAUSE = 1.0


async def back_off(pause: float, deadline: float, least: float = 0.0) -> float:
    """Wait ``pause`` (at least ``least``) within the deadline; returns the next, twice as long."""
    await trio.sleep(min(max(pause, least), max(0.0, deadline - trio.current_time())))
    return min(2 * pause, MAX_RETRY_PAUSE)
