"""The dashboard's data stays bounded however long the run and however many peers claim to be in
it, and the page it feeds fetches nothing from the network."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from averaging.replica import AveragingRecord
from peerd.history import PeerBook, RoundLog, TimeSeries
from peerd.status_pages import StatusPages, dashboard_url


def test_time_series_thins_out_and_keeps_covering_the_whole_run():
    series = TimeSeries(capacity=64, period=2.0)
    for second in range(0, 100_000, 2):
        series.offer({"t": float(second), "loss": 1.0 / (1 + second), "accuracy": float("nan")})
    columns = series.columns()
    assert len(columns["t"]) < 64
    assert columns["t"][0] == 0.0 and columns["t"][-1] > 90_000  # the start and the recent past
    assert all(value is None for value in columns["accuracy"])  # NaN is not JSON: unknown
    assert not series.offer({"t": columns["t"][-1] + 1.0})  # closer than the (doubled) period


def test_round_log_is_a_ring_newest_first():
    log = RoundLog(size=3)
    for epoch in range(10):
        log.add(AveragingRecord(epoch, failure="no_group", seconds=1.0), now=float(epoch))
    assert [r["epoch"] for r in log.newest_first()] == [9, 8, 7]
    assert log.newest_first()[0]["reason"] == "no_group" and log.newest_first()[0]["averaged"] is False


def test_peer_book_forgets_the_longest_unseen_and_stale_records_are_no_sighting():
    book = PeerBook(max_peers=10)
    for index in range(1000):  # a flood of made-up peers in the DHT
        book.saw_progress(f"fake{index}", 1, 1, 1.0, now=float(index))
    assert len(book.peers) == 10 and "fake999" in book.peers and "fake0" not in book.peers
    book.saw_progress("real", 3, 100, 50.0, now=2000.0)
    book.saw_progress("real", 3, 100, 50.0, now=3000.0)  # the same record again: old news
    assert book.peers["real"].last_seen == 2000.0
    book.saw_round(AveragingRecord(3, averaged=True, group=3, peers=("real",), failed=("gone",)), now=3001.0)
    rows = {row["peer_id"]: row for row in book.rows()}
    assert rows["real"]["rounds"] == 1 and rows["real"]["last_seen"] == 3001.0
    assert rows["gone"]["failed"] == 1
    assert book.rows()[0]["peer_id"] == "real"  # most recently seen first


def test_pages_are_served_from_the_package_and_fetch_nothing_else():
    pages = StatusPages(lambda: {"peer_id": "me", "epoch": 0}).routes()
    assert {"/", "/dashboard.js", "/dashboard.css", "/dashboard.json", "/status", "/metrics"} <= set(pages)
    html = pages["/"]().body.decode()
    assert 'src="dashboard.js"' in html and 'href="dashboard.css"' in html
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        text = resources.files("peerd").joinpath("dashboard", name).read_text()
        # the one URL in them is the SVG namespace, an identifier that is never fetched
        assert set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+", text)) <= {"http://www.w3.org"}, name
        assert "@import" not in text and "url(" not in text


def test_dashboard_url_is_one_a_local_browser_can_open():
    assert dashboard_url("0.0.0.0", 8080) == "http://127.0.0.1:8080/"
    assert dashboard_url("::", 8080) == "http://[::1]:8080/"
    assert dashboard_url("10.0.0.5", 1) == "http://10.0.0.5:1/"


def test_json_pages_are_strict_json_when_training_diverged():
    """A diverged run (an infinite loss, NaN bits per byte) must not turn the dashboard's data into
    text a browser's JSON.parse refuses: JSON has no NaN or Infinity, such a figure is unknown."""
    status = {"peer_id": "me", "loss": float("inf"), "bits_per_byte": float("nan"), "nested": [float("-inf"), 1.5]}
    pages = StatusPages(lambda: dict(status)).routes()
    for path in ("/dashboard.json", "/status"):
        text = pages[path]().body.decode()
        decoded = json.loads(text, parse_constant=lambda name, path=path: pytest.fail(f"{path} has {name}"))
        body = decoded["status"] if path == "/dashboard.json" else decoded
        assert body["loss"] is None and body["bits_per_byte"] is None and body["nested"] == [None, 1.5]
