"""What a user gets wrong on a first run, through the real ``peerd`` command: mistyped or stopped
initial peers fail fast, comma lists work in the flag as in the variable, a folder given as the
identity gets the right advice, and a bad join-only setting breaks ``join`` alone (the address
types of ``peerd/arguments.py``; an unreachable swarm found in an exception group by
``peerd/exception_groups.py``)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import time

import trio

from dht import DHTConfig, DHTNode
from peer import Identity, open_peer_host
from peerd.cli import parse_command_line
from peerd.exit_codes import EXIT_BAD_INPUT, EXIT_UNREACHABLE
from peerd.join_arguments import initial_peers_from_args
from tests.support.processes import PEERD


def dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_peerd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environ = {**os.environ, **(env or {})}
    return subprocess.run(PEERD + list(args), capture_output=True, text=True, timeout=timeout, env=environ)


def test_initial_peers_that_refuse_fail_within_the_grace_not_the_bootstrap_timeout(tmp_path):
    first, second = dead_port(), dead_port()
    start = time.monotonic()
    result = run_peerd(
        "join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "id.key"),
        "--initial-peer", f"127.0.0.1:{first},127.0.0.1:{second}",  # one flag, a comma list
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == EXIT_UNREACHABLE, result.stderr
    lines = result.stderr.splitlines()
    for port in (first, second):
        assert any(line.strip().startswith(f"127.0.0.1:{port}: ") and "refused" in line for line in lines), port
    assert "accepted a connection" in result.stderr
    # the grace (5 s) plus start-up and shutdown, well under the 15 s bootstrap timeout
    assert elapsed < DHTConfig().refused_grace + 6, elapsed


async def test_an_initial_peer_that_starts_listening_late_is_still_reached():
    port = dead_port()
    config = DHTConfig(bootstrap_timeout=15, refused_grace=5)
    async with trio.open_nursery() as nursery:

        async def late_bootstrap() -> None:
            await trio.sleep(1.5)  # refused until then
            async with open_peer_host(Identity.generate(), listen=("127.0.0.1", port)) as host:
                async with DHTNode.open(host=host):
                    await trio.sleep(math.inf)

        nursery.start_soon(late_bootstrap)
        with trio.fail_after(10):
            async with DHTNode.open(initial_peers=[f"127.0.0.1:{port}"], config=config) as node:
                assert node.host.connected_peers
        nursery.cancel_scope.cancel()


def test_initial_peer_flag_takes_comma_lists_and_repeats():
    args = parse_command_line(["join", "--initial-peer", "10.0.0.1:1, 10.0.0.2:2", "--initial-peer", "10.0.0.3:3"])
    assert [str(peer) for peer in initial_peers_from_args(args)] == ["10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3"]


def test_a_blank_initial_peers_variable_means_none(monkeypatch):
    monkeypatch.setenv("PEERD_INITIAL_PEERS", "  ")
    assert initial_peers_from_args(parse_command_line(["join"])) == []


def test_an_identity_path_that_is_a_directory_says_so(tmp_path):
    for command in (["join", "--listen", "127.0.0.1:0"], ["keygen"]):
        result = run_peerd(*command, "--identity", str(tmp_path))
        assert result.returncode == EXIT_BAD_INPUT
        assert f"identity path {tmp_path} is a directory" in result.stderr
        assert f"--identity {tmp_path / 'identity.key'}" in result.stderr
        assert "chmod" not in result.stderr and "already exists" not in result.stderr


def test_a_bad_data_shard_setting_breaks_join_but_not_status(tmp_path):
    bad = {"PEERD_DATA_SHARD": "half"}
    status = run_peerd("status", "--status-port", str(dead_port()), env=bad)
    assert status.returncode == EXIT_UNREACHABLE and "DATA_SHARD" not in status.stderr, status.stderr
    join = run_peerd("join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--task", "digits", env=bad)
    assert join.returncode == EXIT_BAD_INPUT
    assert "PEERD_DATA_SHARD: --data-shard wants I/N" in join.stderr and "or auto" in join.stderr
