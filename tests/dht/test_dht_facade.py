"""The synchronous facade, the shared background loop, and ``peerd dht store|get``."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import pytest
import trio

from dht import DHT, DHTBootstrapError
from peer.background import BackgroundLoop, get_loop
from peerd.dht_commands import EXIT_NOT_FOUND, EXIT_UNREACHABLE, add_dht_commands, run_dht_command


def test_background_loop_runs_submits_and_cancels():
    loop = BackgroundLoop(name="test-loop")
    try:

        async def add(a: int, b: int) -> int:
            await trio.sleep(0)
            return a + b

        assert loop.run(add, 2, 3) == 5

        async def fail() -> None:
            raise KeyError("boom")

        with pytest.raises(KeyError):
            loop.run(fail)
        started, cancelled = trio.Event(), trio.Event()

        async def forever() -> None:
            started.set()
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()

        future = loop.submit(forever)
        loop.run(started.wait)
        assert future.cancel()  # a running task can be cancelled through its future
        loop.run(cancelled.wait)
        assert future.cancelled()
        assert loop.run(add, 1, 1) == 2  # still serving after a failure and a cancellation

        async def reenter() -> None:
            loop.run(add, 1, 1)

        with pytest.raises(RuntimeError, match="inside the background trio loop"):
            loop.run(reenter)
    finally:
        loop.stop()
    assert not loop.is_running


def test_facade_store_get_and_shared_loop():
    with DHT(start=True) as first:
        second = DHT(initial_peers=[first.address], start=True)
        client = DHT(initial_peers=[str(second.address)], client_mode=True, start=True)
        try:
            assert first.node.host is not second.node.host
            assert get_loop().is_running  # one loop for all three
            assert client.store("sync-key", [1, 2, 3], time.time() + 30)
            found = first.get("sync-key")
            assert found is not None and found.value == [1, 2, 3]
            future = second.get("sync-key", latest=True, return_future=True)
            assert isinstance(future, concurrent.futures.Future)
            assert future.result(timeout=10).value == [1, 2, 3]
            assert client.get("missing") is None
        finally:
            client.shutdown()
            second.shutdown()
    assert not first.is_alive


def test_facade_unreachable_initial_peer_raises():
    with DHT(start=True) as doomed:
        address = doomed.address
    with pytest.raises(DHTBootstrapError, match="could not reach"):
        DHT(initial_peers=[address], start=True, config=__import__("dht").DHTConfig(bootstrap_timeout=0.5))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="peerd")
    add_dht_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_store_and_get(capsys):
    with DHT(start=True) as member, DHT(initial_peers=[member.address], start=True):
        peer = str(member.address)
        assert run_dht_command(parse(["dht", "store", "greeting", '{"hello": 1}', "--initial-peer", peer])) == 0
        stored = json.loads(capsys.readouterr().out)
        assert stored["stored"] is True
        assert run_dht_command(parse(["dht", "get", "greeting", "--latest", "--initial-peer", peer])) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["found"] is True and got["value"] == {"hello": 1}
        args = ["dht", "store", "group", "me", "--subkey", "peer1", "--ttl", "60", "--initial-peer", peer]
        assert run_dht_command(parse(args)) == 0
        capsys.readouterr()
        assert run_dht_command(parse(["dht", "get", "group", "--initial-peer", peer])) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["value"]["peer1"]["value"] == "me"
        assert run_dht_command(parse(["dht", "get", "nothing-here", "--initial-peer", peer])) == EXIT_NOT_FOUND
        assert json.loads(capsys.readouterr().out)["found"] is False
        dead = str(member.address)
    start = time.monotonic()
    assert run_dht_command(parse(["dht", "get", "x", "--initial-peer", dead, "--timeout", "0.5"])) == EXIT_UNREACHABLE
    assert "could not reach any initial DHT peer" in capsys.readouterr().err
    # The joining deadline (--timeout 0.5) bounds how long an unreachable peer keeps the command
    # waiting; the other 2.5 s are margin for starting a node on a loaded machine.
    assert time.monotonic() - start < 3
