"""Ctrl-C and SIGTERM as users send them, to real processes: ``peerd join`` at every stage of its
start-up, and ``peerd swarm`` whose children must die with it however it dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from peer import LOCAL_DIFFICULTY
from peerd.exit_codes import EXIT_INTERRUPTED
from tests.support.interrupt_tasks import LOADING
from tests.support.processes import PeerdProcess


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live (not zombie) processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue  # it exited while we looked
    return found


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def assert_interrupted_cleanly(process: PeerdProcess, sig: int = signal.SIGINT, code: int = EXIT_INTERRUPTED) -> None:
    start = time.monotonic()
    assert process.stop(sig, timeout=10) == code, process.log()
    assert time.monotonic() - start < 5
    assert "Traceback" not in process.log(), process.log()


def join_args(tmp_path, *extra: str) -> list[str]:
    return ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "id.key"), *extra]


def test_ctrl_c_while_join_loads_its_task(tmp_path):
    args = join_args(tmp_path, "--task", "tests.support.interrupt_tasks:loading_forever")
    with PeerdProcess(args, tmp_path / "join.log") as peer:
        peer.wait_for_log(LOADING, timeout=60)
        assert_interrupted_cleanly(peer)


def test_ctrl_c_while_join_solves_its_node_id_puzzle(tmp_path):
    with PeerdProcess(join_args(tmp_path, "--node-id-difficulty", "40"), tmp_path / "join.log") as peer:
        peer.wait_for_log("solving the node-ID puzzle", timeout=30)
        assert_interrupted_cleanly(peer)


def test_ctrl_c_while_join_bootstraps(tmp_path):
    with socket.socket() as silent:  # accepts connections, never answers: bootstrapping hangs
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        args = join_args(tmp_path, "--node-id-difficulty", str(LOCAL_DIFFICULTY), "--bootstrap-timeout", "60")
        args += ["--initial-peer", f"127.0.0.1:{silent.getsockname()[1]}"]
        with PeerdProcess(args, tmp_path / "join.log") as peer:
            assert peer.read_line(timeout=30).startswith("peerd listening on ")
            assert_interrupted_cleanly(peer)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a live process has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads a process's CPU time from /proc")
def test_sigterm_to_a_training_peer_exits_at_once(tmp_path):
    # Tearing down the interpreter's heap (torch, the data set, the model) object by object cost
    # a lone digits peer ~0.5 s of CPU after SIGTERM: seconds of wall time for peers stopping
    # together on busy cores. CPU time, unlike wall time, says so on a quiet machine too.
    args = join_args(tmp_path, "--node-id-difficulty", str(LOCAL_DIFFICULTY), "--task", "digits")
    with PeerdProcess(args, tmp_path / "join.log") as peer:
        peer.wait_for_log("training task", timeout=60)
        before = cpu_seconds(peer.process.pid)
        start = time.monotonic()
        peer.process.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(peer.process.pid, 0)
        peer.process.returncode = os.waitstatus_to_exitcode(status)
        wall, cpu = time.monotonic() - start, usage.ru_utime + usage.ru_stime - before
        assert peer.process.returncode == 0, peer.log()
        assert "Traceback" not in peer.log(), peer.log()
        assert wall < 2.0 and cpu < 0.25, f"exit took {wall:.2f} s, {cpu:.2f} s of CPU\n{peer.log()}"


@pytest.fixture
def swarm_tmp(tmp_path):
    """tmp_path, with any process still naming it SIGKILLed at teardown: a broken launcher must
    not leave training peers behind after the test."""
    yield tmp_path
    for pid in processes_mentioning(str(tmp_path / "tmp")):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def swarm(tmp_path, peers: int) -> PeerdProcess:
    """``peerd swarm`` whose temporary folder (and so its children's key paths) lies in tmp_path."""
    (tmp_path / "tmp").mkdir()
    args = ["swarm", "--peers", str(peers), "--timeout", "120", "--target-accuracy", "1.01"]
    return PeerdProcess(args, tmp_path / "swarm.log", env={"TMPDIR": str(tmp_path / "tmp")})


def read_until(process: PeerdProcess, prefix: str, timeout: float) -> list[str]:
    lines = []
    deadline = time.monotonic() + timeout
    while not (lines and lines[-1].startswith(prefix)):
        lines.append(process.read_line(timeout=max(0.1, deadline - time.monotonic())).strip())
    return lines


def summary_after_stop(process: PeerdProcess, sig: int, code: int) -> dict:
    process.process.send_signal(sig)
    lines = read_until(process, "{", timeout=20)
    assert process.process.wait(timeout=10) == code, process.log()
    assert "Traceback" not in process.log(), process.log()
    return json.loads(lines[-1])


@pytest.mark.parametrize("stage", ["peerd swarm:", "starting peer 0"])  # loading the task; starting peers
def test_ctrl_c_while_a_swarm_starts_prints_the_summary_and_stops_its_peers(swarm_tmp, stage):
    tmp_path = swarm_tmp
    with swarm(tmp_path, 2) as launcher:
        read_until(launcher, stage, timeout=60)
        if stage == "starting peer 0":
            wait_until(lambda: processes_mentioning(str(tmp_path / "tmp")), 30, "the bootstrap peer's process")
        summary = summary_after_stop(launcher, signal.SIGINT, EXIT_INTERRUPTED)
        assert summary["reached"] is False and summary["stopped_by"] == "SIGINT"
        assert processes_mentioning(str(tmp_path / "tmp")) == []
        assert list((tmp_path / "tmp").glob("peerd-swarm-*")) == []  # the folder with the peers' keys is gone


def test_sigterm_to_a_training_swarm_stops_its_peers(swarm_tmp):
    tmp_path = swarm_tmp
    with swarm(tmp_path, 2) as launcher:
        read_until(launcher, "t=", timeout=90)  # the first table: both peers train
        assert len(processes_mentioning(str(tmp_path / "tmp"))) == 2
        summary = summary_after_stop(launcher, signal.SIGTERM, 128 + signal.SIGTERM)
        assert summary["reached"] is False and summary["stopped_by"] == "SIGTERM"
        assert processes_mentioning(str(tmp_path / "tmp")) == []


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="children die with their parent through Linux prctl")
def test_swarm_peers_die_with_a_sigkilled_launcher(swarm_tmp):
    tmp_path = swarm_tmp
    with swarm(tmp_path, 2) as launcher:
        read_until(launcher, "swarm of 2 peers running", timeout=90)
        assert len(processes_mentioning(str(tmp_path / "tmp"))) == 2
        launcher.process.kill()
        wait_until(lambda: not processes_mentioning(str(tmp_path / "tmp")), 10, "the peers to die with the launcher")
