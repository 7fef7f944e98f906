"""Running a command that joins the swarm as a trio program, with the exit codes users see.

``run_joining`` turns the failures a user can act on into one line on stderr and an exit code
(``exit_codes.py``); ``until_stopped`` runs a long-lived command until SIGINT or SIGTERM and says
which one stopped it (Ctrl-C exits 130 as shells expect; SIGTERM is a service manager's ordinary
stop and exits 0); ``exit_process`` ends the process once a command returned, without the
interpreter's teardown of its heap.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import trio

from dht import DHTBootstrapError

from .exception_groups import find_exception
from .exit_codes import EXIT_IN_USE, EXIT_INTERRUPTED, EXIT_OK, EXIT_RANK_FAILED, EXIT_UNREACHABLE
from .ports import PortInUseError
from .ranks import RankError

__all__ = ["exit_process", "run_joining", "until_stopped", "EXIT_UNREACHABLE"]

log = logging.getLogger("peerd")


def run_joining(async_fn: Callable[..., Awaitable[int | None]], *args: Any) -> int:
    """``trio.run`` a command that joins the swarm; returns its exit code: what ``async_fn``
    returns (None: 0), ``EXIT_UNREACHABLE`` (with the reason for each initial peer on stderr) when
    no initial peer answered, ``EXIT_IN_USE`` when a port to bind is taken, ``EXIT_RANK_FAILED``
    when another rank of this machine's job failed, ``EXIT_INTERRUPTED``
    on a KeyboardInterrupt that no signal receiver caught."""
    # What is loaded by now (torch, the task, ~250k objects) lives as long as the process. Without
    # this, every full garbage collection walks all of it: ~0.1 s with the event loop stopped,
    # long enough to miss network deadlines; after it, a full collection takes ~1 ms.
    gc.collect()
    gc.freeze()
    try:
        code = trio.run(async_fn, *args)
    except BaseException as error:
        if find_exception(error, KeyboardInterrupt) is not None:
            print("peerd: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        known = (
            find_exception(error, DHTBootstrapError)
            or find_exception(error, PortInUseError)
            or find_exception(error, RankError)
        )
        if known is None:
            raise
        print(f"peerd: {known}", file=sys.stderr)
        if isinstance(known, RankError):
            return EXIT_RANK_FAILED
        return EXIT_UNREACHABLE if isinstance(known, DHTBootstrapError) else EXIT_IN_USE
    return EXIT_OK if code is None else code


async def until_stopped(main: Callable[[], Awaitable[object]]) -> int:
    """Run ``main()`` until it returns or SIGINT/SIGTERM arrives, whichever is first, from its
    very first instant (start-up and bootstrapping included); returns ``EXIT_INTERRUPTED`` after
    SIGINT, else ``EXIT_OK``."""
    stopped_by: int | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                nonlocal stopped_by
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    stopped_by = signum
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            await main()
            nursery.cancel_scope.cancel()
    return EXIT_INTERRUPTED if stopped_by == signal.SIGINT else EXIT_OK


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` once its command returned: run the ``atexit`` callbacks, flush
    the logs and stdio, then ``os._exit``.

    What this skips is the interpreter's finalization: it garbage-collects and frees, object by
    object, everything torch, the data set and the model left behind (what ``gc.freeze`` keeps out
    of collections while the peer runs it still walks at exit). That took 0.5-2 s for a lone
    digits peer and 3-5 s for four stopping together on two busy cores, past the ~2 s stop the
    README promises, for memory the OS takes back at once. The command itself has stopped every
    task and thread it started by then (worker threads are daemon threads)."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
                pass
    finally:
        os._exit(code)
