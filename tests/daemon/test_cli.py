"""The ``peerd`` command as a user runs it: real processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from peer import PeerAddress, __version__
from tests.support.processes import PEERD, PeerdProcess


def run_peerd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(PEERD + list(args), capture_output=True, text=True, timeout=timeout)


def test_version():
    result = run_peerd("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"peerd {__version__}"


def test_keygen_prints_only_the_peer_id_and_refuses_to_overwrite(tmp_path):
    key = tmp_path / "id.key"
    result = run_peerd("keygen", "--identity", str(key))
    assert result.returncode == 0
    [line] = result.stdout.splitlines()
    assert len(line) >= 20 and line.isalnum()
    assert os.stat(key).st_mode & 0o777 == 0o600
    again = run_peerd("keygen", "--identity", str(key))
    assert again.returncode == 1 and "already exists" in again.stderr


def test_join_refuses_a_key_readable_by_others(tmp_path):
    key = tmp_path / "id.key"
    run_peerd("keygen", "--identity", str(key))
    os.chmod(key, 0o644)
    result = run_peerd("join", "--listen", "127.0.0.1:0", "--identity", str(key))
    assert result.returncode == 1
    assert f"chmod 600 {key}" in result.stderr


def test_two_peers_meet_and_stop_cleanly_on_signals(tmp_path):
    with PeerdProcess(
        ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "a.key")], tmp_path / "a.log"
    ) as a:
        line = a.read_line(timeout=20)
        assert line.startswith("peerd listening on 127.0.0.1:")
        address_a = PeerAddress.parse(line.removeprefix("peerd listening on "))
        args_b = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "b.key")]
        with PeerdProcess(args_b + ["--initial-peer", str(address_a)], tmp_path / "b.log") as b:
            address_b = PeerAddress.parse(b.read_line(timeout=20).removeprefix("peerd listening on "))
            b.wait_for_log(f"met peer {address_a.peer_id}", timeout=15)
            a.wait_for_log(f"peer {address_b.peer_id} connected", timeout=15)
            start = time.monotonic()
            assert b.stop(signal.SIGINT) == 130  # Ctrl-C: 128 + SIGINT, as shells report it
            assert time.monotonic() - start < 2
            a.wait_for_log(f"peer {address_b.peer_id} dropped", timeout=5)
        start = time.monotonic()
        assert a.stop(signal.SIGTERM) == 0
        assert time.monotonic() - start < 2


def test_dead_initial_peer_exits_2_within_the_bootstrap_timeout(tmp_path):
    # A port that was just free: nothing listens there.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    start = time.monotonic()
    result = run_peerd(
        "join",
        "--listen",
        "127.0.0.1:0",
        "--identity",
        str(tmp_path / "c.key"),
        "--initial-peer",
        f"127.0.0.1:{dead_port}",
        "--bootstrap-timeout",
        "2",
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert f"127.0.0.1:{dead_port}: " in result.stderr and "refused" in result.stderr
    assert elapsed < 2 + 5  # the timeout plus interpreter start-up and shutdown


async def test_join_can_host_experts_that_the_swarm_finds_and_calls(tmp_path):
    import torch
    import trio

    from dht.node import DHTNode
    from moe.announce import get_expert_addresses
    from moe.client import call_forward

    args = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "e.key"), "--device", "cpu"]
    args += ["--serve-experts", "ffn.[0:2]", "--hidden-dim", "16", "--heartbeat-period", "1"]
    with PeerdProcess(args, tmp_path / "e.log") as peer:
        address = PeerAddress.parse(peer.read_line(timeout=60).removeprefix("peerd listening on "))
        async with DHTNode.open(initial_peers=[address], client_mode=True) as client:
            with trio.fail_after(30):
                while None in (found := await get_expert_addresses(client, ["ffn.0", "ffn.1"])).values():
                    await trio.sleep(0.2)  # the peer announces right after it starts serving
            assert set(found.values()) == {address}
            outputs = await call_forward(client.host, address, "ffn.1", torch.randn(3, 16))
            assert outputs.shape == (3, 16) and torch.isfinite(outputs).all()
