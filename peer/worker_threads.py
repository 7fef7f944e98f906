"""Where peerd runs blocking work (tensor arithmetic, hashing, model steps): in a worker thread, so
the event loop keeps serving its connections while it runs, or, in a simulated run, on the loop.

Under ``trio.testing.MockClock(autojump_threshold=0)`` a task that waits for a worker thread is
blocked as far as trio can tell, so the clock jumps ahead to the next timer while the thread works:
the simulated swarm lives through seconds of deadlines in the real milliseconds a thread takes, and
a loaded machine fails rounds that a quiet one passes. A simulation promises that CPU spent costs no
simulated time, so it runs the same work inline (``inline_blocking_work``), where the clock cannot
move until it is done. The choice is a context variable: it holds for the tasks that the block
starts and their children, and for nothing else in the process.

A component whose tensor work should all run on one thread (``ComputeThread``: why) hands it to
its own compute thread instead; the same context variable runs that work inline in a simulation.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import trio

__all__ = ["ComputeThread", "COMPUTE_THREAD_IDLE_S", "inline_blocking_work", "run_blocking", "runs_inline"]

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


# A compute thread with nothing to do for this long ends (the next piece of work starts another),
# as trio's own cached worker threads do.
COMPUTE_THREAD_IDLE_S = 10.0


class ComputeThread:
    """One OS thread that runs a component's tensor work, every piece in turn.

    PyTorch runs its CPU kernels on OpenMP, and libgomp keeps a team of helper threads for each OS
    thread that starts parallel work, for as long as that thread lives. Once the teams' threads
    outnumber the cores, libgomp stops letting the helpers spin between parallel regions, and every
    region waits for them to wake in the kernel (as ``OMP_WAIT_POLICY=PASSIVE`` would). Measured
    on 2 cores: a ``textlm`` training step on a worker thread took 148 ms once the main thread had
    started parallel work once, against 123 ms; in an expert server that checked requests on its
    loop and computed batches in trio's worker threads, Adam's step took 3.9-4.2 ms against
    1.7-2.1 ms here, and a one-sample forward on the loop ~0.6 ms against ~0.3. So a component does
    all its tensor work here, and on its loop only what starts no parallel work (byte handling;
    ``tensors.all_finite_serial`` for the checks it makes there). A round trip to an idle thread
    costs ~25 us.

    ``run`` behaves as ``trio.to_thread.run_sync`` (inline inside ``inline_blocking_work``): the
    work of a caller cancelled before it is handed over never starts, and one cancelled while it
    runs waits for it and gets its outcome, the cancellation coming at its next checkpoint. The
    thread starts with the first piece of work and ends after ``COMPUTE_THREAD_IDLE_S`` without
    any, so an object that owns one needs no closing."""

    def __init__(self, name: str, idle_s: float = COMPUTE_THREAD_IDLE_S):
        self.name = name
        self._idle_s = idle_s
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[bool, Any], None]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this thread (after the work handed over before it)."""
        if _INLINE.get():
            await trio.lowlevel.checkpoint()
            return fn(*args)
        await trio.lowlevel.checkpoint_if_cancelled()  # (a cancelled caller's work never starts)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[tuple[bool, Any]] = []  # (whether it returned, its value or exception)

        def deliver(returned: bool, value: Any) -> None:
            result.append((returned, value))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:  # (nobody waits any more)
                pass

        with self._lock:
            self._queue.put((lambda: fn(*args), deliver))
            if self._thread is None:
                thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                try:
                    thread.start()
                except BaseException:
                    if thread.ident is None:  # (it never ran: ours is the only work queued, take it back)
                        self._queue.get_nowait()
                    else:  # (interrupted once it ran: it takes the work)
                        self._thread = thread
                    raise
                self._thread = thread
        # The work runs to its end either way: wait for it, and leave a cancellation to the
        # caller's next checkpoint, with the outcome in hand (as ``trio.to_thread`` does).
        with trio.CancelScope(shield=True):
            await done.wait()
        returned, value = result.pop()
        if not returned:
            raise value
        return value

    @property
    def alive(self) -> bool:
        """Whether the thread is running now (it ends when idle)."""
        return self._thread is not None

    def _work(self) -> None:
        while True:
            try:
                work, deliver = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:  # (``run`` hands work over under the lock: none is lost)
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                value, returned = work(), True
            except BaseException as error:  # (raised again in the caller's task)
                value, returned = error, False
            deliver(returned, value)
            del work, deliver, value  # (the last work's arguments are not kept alive while idle)
