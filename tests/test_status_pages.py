"""The status port of a live 2-peer swarm (real ``peerd join`` processes on 127.0.0.1): the
Prometheus text that ``promtool`` checks, and the dashboard as a real browser renders it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from peer.daemon.status_server import fetch_status

from .processes import PeerdProcess
from .test_metrics import promtool_check, value

SWARM_TIMEOUT = 90.0


def status_of(port: int) -> dict | None:
    try:
        return json.loads(fetch_status(port, timeout=2))
    except OSError:
        return None


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


class Swarm:
    def __init__(self, peers: list[PeerdProcess], ports: list[int]):
        self.peers, self.ports = peers, ports

    def statuses(self) -> list[dict | None]:
        return [status_of(port) for port in self.ports]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """Two peers training digits, once both have stepped a few epochs and averaged a round."""
    directory = tmp_path_factory.mktemp("swarm")
    peers: list[PeerdProcess] = []
    ports: list[int] = []
    try:
        for index in range(2):
            args = ["join", "--listen", "127.0.0.1:0", "--identity", str(directory / f"p{index}.key")]
            args += ["--run-id", "dash", "--task", "digits", "--data-shard", f"{index}/2", "--status-port", "0"]
            if peers:
                args += ["--initial-peer", status_of(ports[0])["address"]]
            peer = PeerdProcess(args, directory / f"p{index}.log")
            peers.append(peer)
            peer.read_line(timeout=60)  # listening
            ports.append(int(peer.read_line(timeout=60).rsplit(":", 1)[1].split("/")[0]))
        swarm = Swarm(peers, ports)

        def ready() -> bool:
            statuses = swarm.statuses()
            return all((s or {}).get("epoch", 0) >= 3 for s in statuses) and any(
                ((s or {}).get("last_averaging") or {}).get("averaged") for s in statuses
            )

        wait_until(ready, SWARM_TIMEOUT, "two peers at epoch 3 with an averaged round")
        yield swarm
    finally:
        for peer in peers:
            peer.stop()


def test_live_metrics_pass_promtool_and_count_rounds(swarm: Swarm):
    port = next(p for p, s in zip(swarm.ports, swarm.statuses(), strict=True) if (s or {}).get("last_averaging"))
    text = fetch_status(port, path="/metrics")
    promtool_check(text)
    assert value(text, "peerd_epoch") >= 3
    assert value(text, "peerd_bytes_sent_total") > 0
    rounds = value(text, "peerd_averaging_round_bytes_count")
    assert rounds >= 1
    assert value(text, "peerd_averaging_round_seconds_count") + sum(
        value(text, f'peerd_averaging_rounds_failed_total{{reason="{reason}"}}')
        for reason in ("no_group", "leader_failed", "allreduce", "error")
    ) == pytest.approx(rounds)
