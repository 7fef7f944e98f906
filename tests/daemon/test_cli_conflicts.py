"""Two things on one machine that want the same resource: a port already in use (listen, status,
experts), and two processes on one identity file. Each is refused at once, in one line that says
what to change, with its own exit code and no traceback (``peerd/ports.py``,
``peerd/identity_lock.py``)."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from peer import LOCAL_DIFFICULTY
from peerd.exit_codes import EXIT_IN_USE, EXIT_UNREACHABLE
from tests.support.processes import PEERD, PeerdProcess


def run_peerd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(PEERD + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def busy_port():
    """A port that a listening socket holds for the test's duration."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def assert_one_clear_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("peerd: ")]
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.parametrize("which", ["listen", "status"])
def test_join_on_a_port_in_use_names_the_port_and_the_flag(tmp_path, busy_port, which):
    listen = f"127.0.0.1:{busy_port}" if which == "listen" else "127.0.0.1:0"
    args = ["join", "--listen", listen, "--identity", str(tmp_path / "id.key")]
    args += ["--node-id-difficulty", str(LOCAL_DIFFICULTY)]
    if which == "status":
        args += ["--status-port", str(busy_port)]
    result = run_peerd(*args)
    assert result.returncode == EXIT_IN_USE != EXIT_UNREACHABLE, result.stderr
    flag = "--listen" if which == "listen" else "--status-port"
    assert_one_clear_line(result, f"{which} port 127.0.0.1:{busy_port} is already in use", flag)


@pytest.mark.parametrize("which", ["listen", "status"])
def test_a_port_in_use_is_refused_before_the_node_id_puzzle(tmp_path, busy_port, which):
    """A fresh key at a difficulty that takes minutes to solve: the busy port is named at once,
    not after the puzzle."""
    listen = f"127.0.0.1:{busy_port}" if which == "listen" else "127.0.0.1:0"
    args = ["join", "--listen", listen, "--identity", str(tmp_path / "id.key"), "--node-id-difficulty", "30"]
    if which == "status":
        args += ["--status-port", str(busy_port)]
    started = time.monotonic()
    result = run_peerd(*args, timeout=60)
    assert result.returncode == EXIT_IN_USE, result.stderr
    assert_one_clear_line(result, f"{which} port 127.0.0.1:{busy_port} is already in use")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "id.key.node-id").exists()  # no puzzle was solved


def test_serve_experts_on_a_port_in_use_names_the_port(busy_port):
    args = ["serve-experts", "--experts", "ffn.[0:1]", "--hidden-dim", "8", "--device", "cpu"]
    args += ["--listen", f"127.0.0.1:{busy_port}", "--node-id-difficulty", str(LOCAL_DIFFICULTY)]
    result = run_peerd(*args)
    assert result.returncode == EXIT_IN_USE, result.stderr
    assert_one_clear_line(result, f"experts port 127.0.0.1:{busy_port} is already in use", "--listen")


def test_a_second_process_on_one_identity_file_fails_at_once(tmp_path):
    key = tmp_path / "id.key"
    args = ["join", "--listen", "127.0.0.1:0", "--identity", str(key), "--node-id-difficulty", str(LOCAL_DIFFICULTY)]
    with PeerdProcess(args, tmp_path / "first.log") as first:
        assert first.read_line(timeout=30).startswith("peerd listening on ")
        second = run_peerd(*args, timeout=30)
        assert second.returncode == EXIT_IN_USE, second.stderr
        assert_one_clear_line(second, f"identity file {key} is in use", f"pid {first.process.pid}", "--identity")
        assert first.process.poll() is None  # the first peer is untouched
    # The lock dies with its process, however it ends (here SIGKILL): the key is usable again.
    with PeerdProcess(args, tmp_path / "third.log") as third:
        assert third.read_line(timeout=30).startswith("peerd listening on ")
