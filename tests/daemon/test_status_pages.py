"""The status port of a live 2-peer swarm (real ``peerd join`` processes on 127.0.0.1): the
Prometheus text that ``promtool`` checks, and the dashboard as a real browser renders it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from peerd.status_server import fetch_status
from tests.daemon.test_metrics import promtool_check, value
from tests.support.processes import PeerdProcess, status_of, wait_until

SWARM_TIMEOUT = 90.0
# Virtual time the page gets in headless Chromium: its first poll at load and two more after it
# (virtual time stands still while a fetch is under way, so this is not a race with the peer).
VIRTUAL_TIME_MS = 5000


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


def chromium() -> str:
    """The browser's command; skips where there is none (CI, with PEERD_REQUIRE_TOOLS=1, fails)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    reason = "no Chromium to render the dashboard in (Debian: apt-get install chromium)"
    if os.environ.get("PEERD_REQUIRE_TOOLS") == "1":
        pytest.fail(f"PEERD_REQUIRE_TOOLS=1 but {reason}")
    pytest.skip(reason)


def headless(browser: str, profile: Path, url: str, *output: str) -> subprocess.CompletedProcess:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
    command += [f"--user-data-dir={profile}", "--window-size=1280,1500", f"--virtual-time-budget={VIRTUAL_TIME_MS}"]
    result = subprocess.run([*command, *output, url], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class RenderedDashboard(HTMLParser):
    """From the DOM Chromium dumps: each chart's drawn points, the peer table's peers, the rounds."""

    def __init__(self, html: str):
        super().__init__()
        self.charts: dict[str, int] = {}
        self.peers: list[str] = []
        self.rounds = 0
        self.badge = ""
        self._in_badge = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "svg" and "chart" in (attributes.get("class") or ""):
            self.charts[attributes["id"]] = int(attributes.get("data-points") or 0)
        elif tag == "tr" and attributes.get("data-peer"):
            self.peers.append(attributes["data-peer"])
        elif tag == "tr" and attributes.get("data-epoch"):
            self.rounds += 1
        self._in_badge = attributes.get("id") == "connection"

    def handle_data(self, data: str) -> None:
        if self._in_badge:
            self.badge += data


def test_dashboard_renders_the_swarm_in_a_real_browser(swarm: Swarm, tmp_path: Path, capsys: pytest.CaptureFixture):
    browser = chromium()
    port = swarm.ports[0]
    url = f"http://127.0.0.1:{port}/"
    peer_ids = {status["peer_id"] for status in swarm.statuses() if status}
    assert len(peer_ids) == 2

    # the charts and the peer table fill from what the peer samples every 2 s
    def sampled() -> bool:
        data = json.loads(fetch_status(port, path="/dashboard.json"))
        evaluated = [value for value in data["series"]["accuracy"] if value is not None]
        return len(evaluated) >= 2 and {row["peer_id"] for row in data["peers"]} >= peer_ids

    wait_until(sampled, 30, "two evaluated points and both peers in the first peer's dashboard data")

    page = RenderedDashboard(headless(browser, tmp_path / "profile", url, "--dump-dom").stdout)
    assert page.badge.startswith("live"), page.badge
    assert set(page.charts) == {"chart-loss", "chart-quality", "chart-rate", "chart-traffic"}
    assert all(points >= 2 for points in page.charts.values()), page.charts
    assert set(page.peers) == peer_ids
    assert page.rounds >= 1

    screenshot = tmp_path / "dashboard.png"
    headless(browser, tmp_path / "profile", url, f"--screenshot={screenshot}")
    assert screenshot.stat().st_size > 10_000
    with capsys.disabled():  # shown in every run, not only a failing one
        print(f"\ndashboard screenshot of a 2-peer swarm: {screenshot}")
