"""``peerd join --nproc-per-node N``: start the machine's N ranks as torchrun would, watch them, and
end the peer when any of them ends (``machine.py`` says what the ranks do).

Each rank is ``python -m peerd.cli join ...`` with the launcher's own arguments (less
``--nproc-per-node``) and torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); rank 0's stdout and everyone's stderr are the launcher's. The
ranks run in sessions of their own, so a Ctrl-C in the terminal reaches the launcher alone, which
passes SIGINT or SIGTERM on to rank 0 (which tells the others to stop, then stops as any peer
does) and, once rank 0 is done, SIGTERMs any rank left; the kernel SIGKILLs them if the launcher itself is
killed (``peer/parent_death.py``). A launcher rather than torch's elastic agent because the agent
answers a failed rank with a page of its own report, where a user should see one line.

When a follower ends first (it died, or the group broke), rank 0 notices at its next collective
and exits 5 with its own line; the launcher waits ``RANK_GRACE_S`` for that before it stops rank 0
and says which rank ended.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

from peer.parent_death import available as parent_death_available
from peer.parent_death import die_with_parent

from .exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_RANK_FAILED

__all__ = ["NPROC_FLAG", "launch_ranks", "without_nproc_flag"]

NPROC_FLAG = "--nproc-per-node"
# Rank 0 finds a dead follower at its next collective: within one slice, or after the swarm's step
# it is in (a round's deadline). Past this, the launcher stops rank 0 itself.
RANK_GRACE_S = 10.0
STOP_TIMEOUT_S = 5.0  # a peer stops within 2 s of SIGTERM (README); then it is killed


def without_nproc_flag(argv: Iterable[str]) -> list[str]:
    """``argv`` less ``--nproc-per-node N`` (or ``=N``): what each rank runs."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == NPROC_FLAG:
            skip = True
        elif not arg.startswith(NPROC_FLAG + "="):
            kept.append(arg)
    return kept


def _free_port() -> int:
    """A port for rank 0's rendezvous store (torchrun's ``--master-port`` default does the same)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_rank(rank: int, nproc: int, port: int, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
    env.update(LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    env.pop("PEERD_NPROC_PER_NODE", None)
    # gloo's sockets carry no authentication: inside one machine they belong on its loopback
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # N ranks that each ran a thread per core would oversubscribe the CPU N times (torchrun sets 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    parent = os.getpid()
    return subprocess.Popen(
        [sys.executable, "-m", "peerd.cli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=None if rank == 0 else subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        preexec_fn=(lambda: die_with_parent(parent)) if parent_death_available() else None,
    )


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _stop(ranks: list[subprocess.Popen], sig: int | None) -> None:
    """Signal every rank still running (``sig`` None: they were signalled already), wait for all
    within one deadline, SIGKILL the rest."""
    for process in ranks:
        if sig is not None and process.poll() is None:
            process.send_signal(sig)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in ranks:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _first_to_end(ranks: list[subprocess.Popen]) -> subprocess.Popen:
    """Block until a rank ends (without reaping it: ``Popen.poll`` still sees its status)."""
    while True:
        for process in ranks:
            if process.poll() is not None:
                return process
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)


def launch_ranks(argv: list[str], nproc: int) -> int:
    """Run ``peerd <argv>`` as ``nproc`` ranks until rank 0 ends or a rank fails; the exit code is
    rank 0's, or EXIT_RANK_FAILED when another rank ended first."""
    argv = without_nproc_flag(argv)
    port = _free_port()
    ranks: list[subprocess.Popen] = []
    signalled: list[int] = []
    delivered: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # to rank 0 alone: it stops training, tells the others to stop, and exits as a peer does
        signalled.append(signum)
        if ranks and ranks[0].poll() is None:
            ranks[0].send_signal(signum)
            delivered.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ranks.extend(_start_rank(rank, nproc, port, argv) for rank in range(nproc))
        if signalled and not delivered:  # it came while rank 0 was being started: pass it on now
            ranks[0].send_signal(signalled[-1])
        ended = _first_to_end(ranks)
        leader = ranks[0]
        code: int | None = None
        if ended is not leader and not signalled:
            try:
                leader.wait(RANK_GRACE_S)
            except subprocess.TimeoutExpired:
                rank = ranks.index(ended)
                print(f"peerd: rank {rank} of this machine ended ({_describe(ended.returncode)})", file=sys.stderr)
                code = EXIT_RANK_FAILED
        if signalled:
            _stop(ranks[:1], None)
        _stop(ranks, signal.SIGTERM)
        if code is None and leader.returncode < 0 and signalled:  # stopped by the signal we passed on
            code = EXIT_INTERRUPTED if signalled[-1] == signal.SIGINT else EXIT_OK
        if code is None:
            code = leader.returncode if leader.returncode >= 0 else EXIT_RANK_FAILED
        return code
    finally:
        _stop(ranks, signal.SIGKILL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
