"""The node-ID puzzle on every core (``peer/node_id_solver.py``): a pool's answer is a real proof,
the caller hears how far the search is, and small puzzles stay in the process."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer import Identity
from peer.node_id import NodeIDProof, search_range
from peer.node_id_solver import CHUNK, SERIAL_BELOW, SolveProgress, solve
from peerd.node_ids import ProgressLog
from tests.support.processes import process_state

ROOT = Path(__file__).resolve().parents[2]


def test_two_workers_find_a_proof_and_report_progress_on_the_way():
    peer_id = Identity.generate().peer_id
    seen: list[SolveProgress] = []
    proof = solve(peer_id, 20, workers=2, on_progress=seen.append)
    assert proof.peer_id == peer_id and proof.satisfies(20)
    hashes = [progress.hashes for progress in seen]
    assert hashes == sorted(hashes) and all(h % CHUNK == 0 for h in hashes)
    if seen:  # (a lucky key is solved within the first ranges, before any report)
        assert seen[-1].rate > 0 and seen[-1].workers == 2 and seen[-1].expected == 1 << 20


def test_a_small_puzzle_is_solved_here_as_the_serial_solver_would():
    peer_id = Identity.generate().peer_id
    proof = solve(peer_id, SERIAL_BELOW - 1, workers=4, on_progress=lambda progress: pytest.fail("no pool"))
    assert proof.nonce == NodeIDProof.solve(peer_id, SERIAL_BELOW - 1).nonce


def test_a_range_holds_the_first_solution_in_it_or_none():
    raw = Identity.generate().peer_id.to_bytes()
    first = int.from_bytes(search_range(raw, 8, 0, 1 << 16), "little")
    assert search_range(raw, 8, 0, first) is None
    assert int.from_bytes(search_range(raw, 8, first, 1), "little") == first


def test_bad_difficulties_are_refused_before_any_work():
    with pytest.raises(ValueError):
        solve(Identity.generate().peer_id, 41, workers=2)


def test_progress_is_logged_at_most_every_few_seconds_with_the_time_left(caplog):
    now = [0.0]
    report = ProgressLog(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="peerd"):
        report(SolveProgress(hashes=1 << 22, difficulty=24, seconds=1.0, workers=4))  # too soon
        now[0] = 6.0
        report(SolveProgress(hashes=1 << 22, difficulty=24, seconds=2.0, workers=4))
        now[0] = 12.0
        report(SolveProgress(hashes=1 << 25, difficulty=24, seconds=9.0, workers=4))
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "25% of the average work done, 2.1 M hashes/s on 4 cores, ~8 s more on average" in lines[0]
    assert "200% of the average work" in lines[1] and "~4 s more on average" in lines[1]


def test_where_workers_cannot_start_the_puzzle_is_solved_in_the_process():
    # a main module read from stdin is one that spawned workers cannot load: each dies at start
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from peer import Identity\n"
        "from peer.node_id_solver import solve\n"
        "print('proof', solve(Identity.generate().peer_id, 19, workers=2).satisfies(19))\n"
    )
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "proof True" in done.stdout and "in this process: its workers could not run" in done.stdout, done.stdout


def spawned_children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                if b"spawn_main" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue  # it exited while we looked
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dying with the parent is Linux's prctl")
def test_workers_die_with_a_killed_parent(tmp_path):
    """Each worker asks the kernel to kill it with its parent (``peer/parent_death.py``)."""
    script = tmp_path / "solver_child.py"
    script.write_text(
        "from peer import Identity\n"
        "from peer.node_id_solver import solve\n"
        "if __name__ == '__main__':\n"
        "    solve(Identity.generate().peer_id, 36, workers=2)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while len(workers := spawned_children(parent.pid)) < 2:
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        time.sleep(3)  # past their start-up (which ends by itself with its parent): searching now
        parent.kill()  # SIGKILL: none of the parent's own code runs
        parent.wait()
        deadline = time.monotonic() + 10
        while any(process_state(worker) not in (None, "Z") for worker in workers):
            assert time.monotonic() < deadline, "a worker outlived its parent"
            time.sleep(0.1)
    finally:
        parent.kill()
