"""Where this process sits in a ``torch.distributed`` job, learnt without loading torch (every
``peerd`` command reads it): torchrun's variables, the error for a machine whose ranks can no longer
work together, and how a follower rank answers the signals that stop it (``machine.py`` is the
rest, with torch).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .exit_codes import EXIT_INTERRUPTED, EXIT_OK
from .stop_signals import Stopped, stop_signals_raise

__all__ = ["RankError", "RankPlace", "follow_signals", "rank_place"]


class RankError(RuntimeError):
    """The machine's ranks can no longer work together: one died, hung past the timeout, or the
    group could not form. The message says what the collective reported."""


@dataclass(frozen=True)
class RankPlace:
    """This process's place in its ``torch.distributed`` job (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int


def rank_place(environ: Mapping[str, str] = os.environ) -> RankPlace | None:
    """This process's place in a job of more than one process (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``), or None when it runs alone; RankError for values that do not make sense."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise RankError(f"RANK={environ['RANK']!r} and WORLD_SIZE={environ['WORLD_SIZE']!r} must be integers") from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise RankError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return RankPlace(rank, world, local)


def follow_signals(follow: Callable[[], int]) -> int:
    """Run a follower rank's ``follow()`` and return its exit code, or, when SIGINT or SIGTERM
    arrives first, 130 or 0 without a word: rank 0 (or the launcher) speaks for the machine, and a
    terminal's Ctrl-C reaches every rank of a torchrun job at once."""
    try:
        with stop_signals_raise():
            return follow()
    except Stopped as stopped:
        return EXIT_INTERRUPTED if stopped.signum == signal.SIGINT else EXIT_OK
