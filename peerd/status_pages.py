"""The pages of the status port, by path, and the figures behind them.

    /                 the dashboard (peerd/dashboard/: HTML, JS and CSS shipped in the package,
    /dashboard.js     no network fetch), which polls /dashboard.json every 2 s
    /dashboard.css
    /dashboard.json   status, the figures over time, the last rounds, the peers seen
    /status           this peer now (JSON; `peerd status`, `peerd swarm`, the tests and benchmarks)
    /metrics          Prometheus text (peerd/metrics.py)

``StatusPages`` keeps the dashboard's history (peerd/history.py, all bounded): the daemon
runs ``keep_history`` in its nursery and hands it each averaging round as the trainer sees it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import trio

from .history import SAMPLE_PERIOD, PeerBook, RoundLog, TimeSeries
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import PeerMetrics
from .status_server import Page, Route

__all__ = ["StatusPages", "dashboard_url"]

_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def dashboard_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the dashboard of a status port bound to ``host``."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _json(value: Any) -> Page:
    """Strict JSON (a browser's ``JSON.parse`` refuses NaN and Infinity, which a diverged run's
    loss can be): a non-finite number is unknown, null."""
    return Page.text("application/json", json.dumps(_finite(value), default=str, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


class StatusPages:
    """Everything the status port shows of one peer. ``status()`` is the daemon's snapshot;
    ``swarm()`` the optimizer's last view of the swarm's progress (None while not training)."""

    def __init__(self, status: Callable[[], dict[str, Any]], swarm: Callable[[], Any] | None = None):
        self.status = status
        self.swarm = swarm or (lambda: None)
        self.metrics = PeerMetrics(status)
        self.series = TimeSeries()
        self.rounds = RoundLog()
        self.peers = PeerBook()
        folder = resources.files(__package__).joinpath("dashboard")
        self.assets = {
            path: Page(content_type, folder.joinpath(name).read_bytes(), cache=True)
            for path, (name, content_type) in _ASSETS.items()
        }

    def routes(self) -> dict[str, Route]:
        pages: dict[str, Route] = {path: (lambda page=page: page) for path, page in self.assets.items()}
        pages["/dashboard.json"] = lambda: _json(self.dashboard())
        pages["/status"] = lambda: _json(self.status())
        pages["/metrics"] = lambda: Page.text(METRICS_CONTENT_TYPE, self.metrics.render())
        return pages

    def observe_round(self, record: Any) -> None:
        """An averaging round landed (``averaging.replica.AveragingRecord``)."""
        now = time.time()
        self.metrics.observe_round(record)
        self.rounds.add(record, now)
        self.peers.saw_round(record, now)

    def sample(self) -> None:
        """One point of the charts, and the swarm's progress records into the peer book."""
        now = time.time()
        status = self.status()
        self.series.offer(
            {
                **status,
                "t": now,
                "peers": status.get("peers_known"),
            }
        )
        swarm = self.swarm()
        if swarm is not None:
            for peer, progress in list(swarm.peers.items()):
                self.peers.saw_progress(str(peer), progress.epoch, progress.samples, progress.samples_per_s, now)

    async def keep_history(self) -> None:
        """Sample every ``SAMPLE_PERIOD`` until cancelled."""
        while True:
            self.sample()
            await trio.sleep(SAMPLE_PERIOD)

    def dashboard(self) -> dict[str, Any]:
        return {
            "now": time.time(),
            "status": self.status(),
            "series": self.series.columns(),
            "rounds": self.rounds.newest_first(),
            "peers": self.peers.rows(),
        }
