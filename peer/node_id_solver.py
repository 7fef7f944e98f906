"""The node-ID puzzle (``peer/node_id.py``) solved on every core, saying how far it is.

A public run's puzzle is ~2**24 hashes: ~10 s of one core of this Python solver, minutes on a slow
or loaded machine, which a user waits out once per key before the peer starts. The work splits
without coordination: nonces are searched in ranges of ``CHUNK``, each range a task for a pool of
worker processes (hashlib holds the GIL on inputs this small, so threads would not run in parallel),
and the first range that holds a solution ends the search. The caller learns after every range how
many hashes are done against the 2**difficulty expected, and at what rate.

Workers ignore SIGINT: Ctrl-C reaches the whole process group, and the parent, which owns the pool,
is the one that stops: it terminates the workers at once (as it does once a range holds a solution)
and tells the user.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from .identity import PeerID
from .node_id import NodeIDProof, check_difficulty, search_range
from .parent_death import die_with_parent

__all__ = ["CHUNK", "SERIAL_BELOW", "SolveProgress", "solve"]

log = logging.getLogger("peerd")

CHUNK = 1 << 19  # nonces per task: ~0.3 s of one core, so progress comes often and Ctrl-C is quick
# Below this many bits a solve takes well under a second on one core: less than starting the workers.
SERIAL_BELOW = 18


@dataclass(frozen=True)
class SolveProgress:
    hashes: int  # tried so far
    difficulty: int
    seconds: float  # since the search started
    workers: int

    @property
    def expected(self) -> int:
        """Hashes a solve takes on average (each try succeeds with probability 2**-difficulty)."""
        return 1 << self.difficulty

    @property
    def rate(self) -> float:
        """Hashes per second over all workers."""
        return self.hashes / self.seconds if self.seconds > 0 else 0.0

    @property
    def fraction(self) -> float:
        """Hashes done ÷ the expected number (past 1.0 on an unlucky key: the search is memoryless)."""
        return self.hashes / self.expected


MAX_WORKERS = 16  # past this, each worker's start-up (~0.5 s, ~45 MB) outweighs its share of the search


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _worker_start(parent_pid: int) -> None:
    """In each worker: die with the parent (a SIGTERM or SIGKILL to it must not leave a search
    running), and ignore Ctrl-C, which the parent handles (it started the worker with SIGINT
    blocked, so one that came during the start is dropped here, not raised mid-import)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def solve(
    peer_id: PeerID,
    difficulty: int,
    *,
    workers: int | None = None,
    on_progress: Callable[[SolveProgress], None] | None = None,
) -> NodeIDProof:
    """A proof for ``peer_id`` at ``difficulty``, searched by ``workers`` processes (default: every
    core; in this process below ``SERIAL_BELOW`` bits or with one worker). ``on_progress`` runs in
    this process after each range of nonces."""
    check_difficulty(difficulty)
    workers = max(1, min(MAX_WORKERS, workers if workers is not None else usable_cores()))
    if difficulty < SERIAL_BELOW or workers == 1:
        return NodeIDProof.solve(peer_id, difficulty)
    try:
        return _solve_in_pool(peer_id, difficulty, workers, on_progress)
    except (BrokenProcessPool, OSError) as error:  # no processes here (a sandbox, a main module spawn cannot load)
        log.info("solving the node-ID puzzle in this process: its workers could not run (%s)", error)
        return NodeIDProof.solve(peer_id, difficulty)


def _solve_in_pool(
    peer_id: PeerID, difficulty: int, workers: int, on_progress: Callable[[SolveProgress], None] | None
) -> NodeIDProof:
    raw = peer_id.to_bytes()
    started = time.monotonic()
    hashes, next_start = 0, 0
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_start,
        initargs=(os.getpid(),),
    )
    pending: set[Future] = set()
    try:
        # the workers start during these submits, and inherit SIGINT blocked (a Ctrl-C now reaches
        # this process once they are up)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for _ in range(2 * workers):  # one range running and one queued per worker
                pending.add(pool.submit(search_range, raw, difficulty, next_start, CHUNK))
                next_start += CHUNK
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        while True:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            found = None
            for future in done:
                hashes += CHUNK
                found = found or future.result()
            if found is not None:
                return NodeIDProof(peer_id, found)
            for _ in done:
                pending.add(pool.submit(search_range, raw, difficulty, next_start, CHUNK))
                next_start += CHUNK
            if on_progress is not None:
                on_progress(SolveProgress(hashes, difficulty, time.monotonic() - started, workers))
    finally:
        _stop_at_once(pool)


def _stop_at_once(pool: ProcessPoolExecutor) -> None:
    """End the workers now, not after their ranges: a solution found or a Ctrl-C makes the rest of
    the search useless, and on a loaded machine a range can take seconds. (Python 3.14 has this as
    ``terminate_workers``; before it the pool's processes are only reachable through ``_processes``.)"""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=5)
