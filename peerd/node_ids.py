"""The daemon's price of admission: ``--node-id-difficulty`` and the proof solved once per key.

Every peer of a run checks every hello and DHT contact against one difficulty (``peer/node_id.py``),
so it is a run setting like the run ID: ``--node-id-difficulty N``, ``PEERD_NODE_ID_DIFFICULTY`` or
``node_id_difficulty`` in the config file. Public runs keep the default; ``peerd swarm``, the compose
swarm and the tests use ``LOCAL_DIFFICULTY``. The solution is stored beside the identity file
(``KEY.node-id``), so an existing key pays once, on its first start with this version.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from peer import DEFAULT_DIFFICULTY, LOCAL_DIFFICULTY, Identity, NodeIDProof
from peer.node_id import MAX_DIFFICULTY, check_difficulty, load_or_solve
from peer.node_id_solver import SolveProgress, solve, usable_cores

from .setting_kinds import Setting
from .settings import Settings

__all__ = [
    "NODE_ID_DIFFICULTY",
    "ProgressLog",
    "add_difficulty_argument",
    "node_id_difficulty",
    "node_id_for",
    "solve_estimate",
]

log = logging.getLogger("peerd")

# This solver's rate on one core (peer/node_id.py: ~1.6-1.9 M SHA-256 per second, measured); only
# used to tell the user how long the one-time solve will take.
SOLVER_HASHES_PER_SECOND = 1.7e6
PROGRESS_EVERY_S = 5.0  # a long solve says how far it is this often


def node_id_difficulty(text: str) -> int:
    """An integer in 0..MAX_DIFFICULTY."""
    try:
        return check_difficulty(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"node-ID difficulty must be an integer in 0..{MAX_DIFFICULTY}, got {text!r}"
        ) from None


# A run setting like the run ID, shared by ``join``, ``dht`` and ``serve-experts``.
NODE_ID_DIFFICULTY = Setting(
    name="node_id_difficulty", flag="--node-id-difficulty", variable="NODE_ID_DIFFICULTY", parse=node_id_difficulty,
    default=DEFAULT_DIFFICULTY, metavar="BITS",
    help=f"the run's node-ID puzzle difficulty; every peer of a run uses the same (public runs: {DEFAULT_DIFFICULTY},"
    f" ~10 s once per key; local swarms and tests: {LOCAL_DIFFICULTY})",
    doc="the run's node-ID puzzle (the default: ~10 s of one core once per key, stored beside it as `KEY.node-id`); "
    f"every peer of a run must use the same value (`peerd swarm` and the compose file use {LOCAL_DIFFICULTY})",
)  # fmt: skip


def add_difficulty_argument(parser: argparse.ArgumentParser, settings: Settings | None) -> None:
    """``--node-id-difficulty``, defaulting to ``PEERD_NODE_ID_DIFFICULTY`` / the file, then to
    ``DEFAULT_DIFFICULTY`` (a public run's)."""
    NODE_ID_DIFFICULTY.add_to(parser, settings if settings is not None else Settings())


def solve_estimate(difficulty: int, cores: int = 1) -> str:
    """About how long a solve takes here on ``cores`` cores, for humans: '~10 s'."""
    seconds = 2**difficulty / (SOLVER_HASHES_PER_SECOND * max(1, cores))
    if seconds < 1:
        return "<1 s"
    if seconds < 120:
        return f"~{seconds:.0f} s"
    return f"~{seconds / 60:.0f} min"


class ProgressLog:
    """Log a solve's progress every ``PROGRESS_EVERY_S``: done against expected, rate, time left."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._last = clock()

    def __call__(self, progress: SolveProgress) -> None:
        now = self._clock()
        if now - self._last < PROGRESS_EVERY_S:
            return
        self._last = now
        # the search is memoryless: from any point on, a solve takes 2**d hashes on average
        ahead = f", ~{progress.expected / progress.rate:.0f} s more on average" if progress.rate else ""
        log.info(
            "node-ID puzzle: %.0f%% of the average work done, %.1f M hashes/s on %d cores%s",
            100 * progress.fraction,
            progress.rate / 1e6,
            progress.workers,
            ahead,
        )


def node_id_for(identity: Identity, identity_path: Path | None, difficulty: int) -> NodeIDProof:
    """The proof for ``identity`` at ``difficulty``: read from beside ``identity_path``, or solved
    now on every core (saying so in one log line, then how far it is) and stored there. Without a
    key file it is solved every time."""
    cores = usable_cores()

    def announce(path: Path | None) -> None:
        where = f"stored in {path}" if path is not None else "not stored: no identity file"
        estimate = solve_estimate(difficulty, cores)
        log.info(
            "solving the node-ID puzzle (difficulty %d, %s once on %d cores; %s)", difficulty, estimate, cores, where
        )

    def solver(peer_id, bits: int) -> NodeIDProof:
        return solve(peer_id, bits, workers=cores, on_progress=ProgressLog())

    return load_or_solve(identity_path, identity.peer_id, difficulty, on_solve=announce, solver=solver)
