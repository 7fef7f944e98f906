"""Where peerd runs blocking work (tensor arithmetic, hashing, model steps): in a worker thread, so
the event loop keeps serving its connections while it runs, or, in a simulated run, on the loop.

Under ``trio.testing.MockClock(autojump_threshold=0)`` a task that waits for a worker thread is
blocked as far as trio can tell, so the clock jumps ahead to the next timer while the thread works:
the simulated swarm lives through seconds of deadlines in the real milliseconds a thread takes, and
a loaded machine fails rounds that a quiet one passes. A simulation promises that CPU spent costs no
simulated time, so it runs the same work inline (``inline_blocking_work``), where the clock cannot
move until it is done. The choice is a context variable: it holds for the tasks that the block
starts and their children, and for nothing else in the process.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TypeVar

import trio

__all__ = ["inline_blocking_work", "run_blocking", "runs_inline"]

T = TypeVar("T")

_INLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("peerd_inline_blocking_work", default=False)


async def run_blocking(fn: Callable[..., T], *args, limiter: trio.CapacityLimiter | None = None) -> T:
    """``fn(*args)`` in a worker thread under ``limiter`` (trio's default limiter when None), or on
    the event loop inside ``inline_blocking_work``. Cancellation behaves as ``trio.to_thread``'s:
    the caller waits for the thread to finish."""
    if _INLINE.get():
        await trio.lowlevel.checkpoint()
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)


def runs_inline() -> bool:
    """Whether ``run_blocking`` runs on the event loop here."""
    return _INLINE.get()


@contextlib.contextmanager
def inline_blocking_work() -> Iterator[None]:
    """Within the block (and the tasks started from it), ``run_blocking`` runs on the event loop:
    for runs under a ``MockClock``, never for a real peer."""
    token = _INLINE.set(True)
    try:
        yield
    finally:
        _INLINE.reset(token)
