"""Running a command that joins the swarm as a trio program, with the exit codes users see."""

from __future__ import annotations

import gc
import sys
from typing import Any

import trio

from dht import DHTBootstrapError

from .exception_groups import find_exception

__all__ = ["run_joining", "EXIT_UNREACHABLE"]

EXIT_UNREACHABLE = 2  # no initial peer answered: the README gives this code for "swarm unreachable"


def run_joining(async_fn: Any, *args: Any) -> int:
    """``trio.run`` a command that joins the swarm: 0 when it returns, ``EXIT_UNREACHABLE`` (with the
    reason for each initial peer on stderr) when no initial peer answered."""
    # What is loaded by now (torch, the task, ~250k objects) lives as long as the process. Without
    # this, every full garbage collection walks all of it: ~0.1 s with the event loop stopped,
    # long enough to miss network deadlines; after it, a full collection takes ~1 ms.
    gc.collect()
    gc.freeze()
    try:
        trio.run(async_fn, *args)
    except Exception as error:
        unreachable = find_exception(error, DHTBootstrapError)
        if unreachable is None:
            raise
        print(f"peerd: {unreachable}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0
