"""``/metrics`` through prometheus-client: the peer's state at scrape time, histograms and counters
fed per round, each daemon in its own registry, and text that ``promtool check metrics`` accepts."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from averaging.replica import FAILURE_REASONS, AveragingRecord
from peerd import metrics as metrics_module
from peerd.metrics import PeerMetrics

STATUS = {"epoch": 7, "loss": 0.25, "accuracy": None, "bytes_sent": 1000, "bytes_received": 2000, "uptime_s": 3.5}


def promtool_check(text: str) -> None:
    """Fails the test if promtool rejects ``text``; skips where promtool is not installed (CI,
    with PEERD_REQUIRE_TOOLS=1, fails instead)."""
    if shutil.which("promtool") is None:
        reason = "promtool is not installed (Debian package prometheus)"
        if os.environ.get("PEERD_REQUIRE_TOOLS") == "1":
            pytest.fail(f"PEERD_REQUIRE_TOOLS=1 but {reason}")
        pytest.skip(reason)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def value(text: str, series: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(series + " ")]
    assert len(lines) == 1, f"{series} in:\n{text}"
    return float(lines[0].split()[-1])


def test_rounds_feed_histograms_and_counters_and_promtool_accepts_it():
    metrics = PeerMetrics(lambda: STATUS)
    metrics.observe_round(
        AveragingRecord(3, averaged=True, group=3, failed=("p2",), matchmaking_s=0.3, allreduce_s=1.5, bytes=5 << 20)
    )
    metrics.observe_round(AveragingRecord(4, seconds=5.0, bytes=100, failure="no_group"))
    metrics.observe_round(AveragingRecord(5, failure="allreduce"))
    metrics.connection_dropped()
    text = metrics.render()

    assert value(text, "peerd_epoch") == 7 and value(text, "peerd_loss") == 0.25
    assert "peerd_accuracy" not in text  # no evaluation yet: no series, rather than a made-up 0
    assert value(text, "peerd_bytes_sent_total") == 1000 and value(text, "peerd_bytes_received_total") == 2000
    assert value(text, "peerd_averaging_round_seconds_count") == 1
    assert value(text, 'peerd_averaging_round_seconds_bucket{le="2.5"}') == 1
    assert value(text, 'peerd_averaging_round_seconds_bucket{le="1.0"}') == 0
    assert value(text, "peerd_matchmaking_seconds_sum") == pytest.approx(0.3)
    assert value(text, "peerd_averaging_round_bytes_count") == 3
    assert value(text, 'peerd_averaging_rounds_failed_total{reason="no_group"}') == 1
    assert value(text, 'peerd_averaging_rounds_failed_total{reason="allreduce"}') == 1
    assert value(text, 'peerd_averaging_rounds_failed_total{reason="leader_failed"}') == 0
    assert value(text, "peerd_averaging_peers_dropped_total") == 1
    assert value(text, "peerd_connections_dropped_total") == 1
    promtool_check(text)


def test_each_daemon_has_its_own_registry():
    first, second = PeerMetrics(lambda: {"epoch": 1}), PeerMetrics(lambda: {"epoch": 2})
    first.connection_dropped()
    assert value(first.render(), "peerd_connections_dropped_total") == 1
    assert value(second.render(), "peerd_connections_dropped_total") == 0
    assert value(second.render(), "peerd_epoch") == 2


def test_failure_reasons_agree_with_the_averaging_layer():
    assert metrics_module.FAILURE_REASONS == FAILURE_REASONS
