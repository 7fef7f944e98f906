"""What ``/metrics`` tells Prometheus about one peer, through ``prometheus-client``.

Each daemon has its own ``CollectorRegistry`` (never the library's global one), so several peers in
one process (tests, scripts) keep apart. Two kinds of figures:

- the peer's state, read from ``Daemon.status()`` at scrape time (epoch, loss, throughput, traffic
  totals...): a collector, so nothing is copied between scrapes;
- what happened per averaging round and per connection (round and matchmaking time, bytes per
  round, failed rounds by reason, peers dropped): histograms and counters fed as rounds land.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # (averaging loads torch, which only peers that train load)
    from averaging.replica import AveragingRecord

__all__ = ["PeerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# averaging.replica.FAILURE_REASONS, spelled out so the metrics do not load torch (a test checks
# the two agree)
FAILURE_REASONS = ("no_group", "leader_failed", "allreduce", "error")

# Rounds take from a fraction of a second (a small model on one machine) to minutes (a large one
# over home links); matchmaking waits up to its deadline (5-30 s by mode).
ROUND_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
MATCHMAKING_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60)
# From a tiny test model (KiB) to a textlm's parameters in float32 several times over (GiB).
ROUND_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(11))  # 1 KiB .. 1 GiB

# (metric name, help, key in Daemon.status())
_GAUGES = (
    ("peerd_epoch", "Epoch (optimizer steps) of this peer", "epoch"),
    ("peerd_samples_per_second", "Training throughput of this peer", "samples_per_s"),
    ("peerd_loss", "Training loss (moving average)", "loss"),
    ("peerd_accuracy", "Held-out accuracy at the last evaluation", "accuracy"),
    ("peerd_bits_per_byte", "Held-out bits per byte (text tasks)", "bits_per_byte"),
    ("peerd_peers_known", "Peers seen in the swarm's progress records", "peers_known"),
    ("peerd_connected_peers", "Open connections to other peers", "connected_peers"),
    ("peerd_uptime_seconds", "Seconds since the peer started", "uptime_s"),
)
_COUNTERS = (
    ("peerd_bytes_sent", "Bytes sent to other peers", "bytes_sent"),
    ("peerd_bytes_received", "Bytes received from peers", "bytes_received"),
)


class _StatusCollector:
    """The peer's state as gauges and counters, read from ``status()`` when scraped."""

    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.status = status

    def describe(self) -> list[Metric]:
        return []  # (the families depend on the status: no eager checks at registration)

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        for name, help_text, key in _GAUGES:
            if isinstance(status.get(key), (int, float)):
                yield GaugeMetricFamily(name, help_text, value=status[key])
        for name, help_text, key in _COUNTERS:
            if isinstance(status.get(key), (int, float)):
                yield CounterMetricFamily(name, help_text, value=status[key])
        group = (status.get("last_averaging") or {}).get("group")
        if isinstance(group, int):
            yield GaugeMetricFamily("peerd_last_round_group_size", "Peers in the last averaging group", value=group)


class PeerMetrics:
    """One daemon's registry: ``observe_round`` and ``connection_dropped`` as things happen,
    ``render()`` for a scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        self.registry.register(_StatusCollector(status))
        registry = self.registry
        self.round_seconds = Histogram(
            "peerd_averaging_round_seconds",
            "All-reduce time of the averaging rounds this peer averaged in (after its group formed)",
            buckets=ROUND_SECONDS_BUCKETS,
            registry=registry,
        )
        self.matchmaking_seconds = Histogram(
            "peerd_matchmaking_seconds",
            "Time from looking for a group to the group formed, for the rounds where one formed",
            buckets=MATCHMAKING_SECONDS_BUCKETS,
            registry=registry,
        )
        self.round_bytes = Histogram(
            "peerd_averaging_round_bytes",
            "Bytes this peer sent and received during each averaging round (all its traffic)",
            buckets=ROUND_BYTES_BUCKETS,
            registry=registry,
        )
        self.failed_rounds = Counter(
            "peerd_averaging_rounds_failed",
            "Averaging rounds that did not average, by reason (the peer went on with its own tensors)",
            ["reason"],
            registry=registry,
        )
        for reason in FAILURE_REASONS:
            self.failed_rounds.labels(reason)  # every reason shows, at 0 until it happens
        self.peers_dropped = Counter(
            "peerd_averaging_peers_dropped",
            "Group members that failed this peer in a round (dropped as senders or reducers)",
            registry=registry,
        )
        self.connections_dropped = Counter(
            "peerd_connections_dropped",
            "Connections to peers that ended other than by this peer closing them (left, died, link broke)",
            registry=registry,
        )

    def observe_round(self, record: AveragingRecord) -> None:
        self.round_bytes.observe(record.bytes)
        if record.matchmaking_s is not None:
            self.matchmaking_seconds.observe(record.matchmaking_s)
        if record.allreduce_s is not None:
            self.round_seconds.observe(record.allreduce_s)
        if not record.averaged:
            self.failed_rounds.labels(record.failure if record.failure in FAILURE_REASONS else "error").inc()
        self.peers_dropped.inc(len(record.failed))

    def connection_dropped(self) -> None:
        self.connections_dropped.inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()
