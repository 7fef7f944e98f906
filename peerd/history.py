"""What the dashboard draws, kept by the daemon in bounded memory: the peer's figures over time,
its last averaging rounds, and what it has seen of the other peers.

Every structure here has a fixed bound, whatever the run's length or the swarm's size: the time
series thins itself out (``TimeSeries``), the round log is a ring (``RoundLog``), and the peer book
forgets the peers it has not seen for the longest (``PeerBook``). The peers' figures come from
their progress records in the DHT, so they are claims, shown as such, and never used for anything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["TimeSeries", "RoundLog", "PeerBook", "SERIES_FIELDS"]

# One point of the charts; None where the figure is not known yet (no evaluation so far).
SERIES_FIELDS = (
    "t",
    "epoch",
    "loss",
    "accuracy",
    "bits_per_byte",
    "samples_per_s",
    "bytes_sent",
    "bytes_received",
    "peers",
)
# 512 points draw a smooth line in a chart a few hundred pixels wide, and cost ~50 KB of memory
# and of each dashboard poll.
SERIES_CAPACITY = 512
SAMPLE_PERIOD = 2.0  # the dashboard polls every 2 s; a finer series would not show
ROUND_LOG_SIZE = 20  # the last rounds a person reads in a table
# The peer table lists what a person can read; beyond this the longest unseen peers are dropped.
MAX_PEERS = 256


class TimeSeries:
    """Points at least ``period`` seconds apart; when ``capacity`` is reached, every other point
    is dropped and the period doubles, so the series always covers the whole run, at a resolution
    that halves each time it fills up."""

    def __init__(self, capacity: int = SERIES_CAPACITY, period: float = SAMPLE_PERIOD):
        self.capacity = capacity
        self.period = period
        self.points: list[tuple[Any, ...]] = []

    def offer(self, point: dict[str, Any]) -> bool:
        """Keep ``point`` (its ``t`` in seconds) unless it comes less than ``period`` after the
        last one kept; True if it was kept."""
        if self.points and point["t"] - self.points[-1][0] < self.period:
            return False
        self.points.append(tuple(_finite(point.get(name)) for name in SERIES_FIELDS))
        if len(self.points) >= self.capacity:
            self.points = self.points[::2]
            self.period *= 2
        return True

    def columns(self) -> dict[str, list[Any]]:
        """The series as one list per field (compact JSON for the charts)."""
        return {name: [point[i] for point in self.points] for i, name in enumerate(SERIES_FIELDS)}


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a value is unknown (None)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RoundLog:
    """The last ``size`` averaging rounds, newest first when read."""

    def __init__(self, size: int = ROUND_LOG_SIZE):
        self.rounds: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, record: Any, now: float) -> None:
        """``record``: an ``averaging.replica.AveragingRecord``."""
        self.rounds.append(
            {
                "t": now,
                "epoch": record.epoch,
                "averaged": record.averaged,
                "group": record.group,
                "failed": list(record.failed),
                "reason": record.failure,
                "seconds": round(record.seconds, 3),
                "matchmaking_s": None if record.matchmaking_s is None else round(record.matchmaking_s, 3),
                "allreduce_s": None if record.allreduce_s is None else round(record.allreduce_s, 3),
                "bytes": record.bytes,
            }
        )

    def newest_first(self) -> list[dict[str, Any]]:
        return list(reversed(self.rounds))


@dataclass
class PeerEntry:
    epoch: int = 0
    samples: int = 0  # its claim for its current epoch
    samples_per_s: float = 0.0
    rounds: int = 0  # rounds it averaged in with this peer
    failed: int = 0  # rounds in which it failed this peer
    last_seen: float = 0.0  # its progress record last changed, or it last took part in a round


class PeerBook:
    """The other peers as this one has seen them, ``MAX_PEERS`` at most."""

    def __init__(self, max_peers: int = MAX_PEERS):
        self.max_peers = max_peers
        self.peers: dict[str, PeerEntry] = {}

    def _entry(self, peer: str, now: float) -> PeerEntry:
        entry = self.peers.get(peer)
        if entry is None:
            if len(self.peers) >= self.max_peers:
                oldest = min(self.peers, key=lambda p: self.peers[p].last_seen)
                del self.peers[oldest]
            entry = self.peers[peer] = PeerEntry(last_seen=now)
        return entry

    def saw_progress(self, peer: str, epoch: int, samples: int, samples_per_s: float, now: float) -> None:
        """A progress record read from the DHT; a record unchanged since the last read is old news
        (a stopped peer's record outlives it until it expires), so it does not count as a sighting."""
        entry = self._entry(peer, now)
        if (entry.epoch, entry.samples) != (epoch, samples):
            entry.last_seen = now
        entry.epoch, entry.samples, entry.samples_per_s = epoch, samples, samples_per_s

    def saw_round(self, record: Any, now: float) -> None:
        """An averaging round's members: those that took part, and those that failed it."""
        for peer in record.peers:
            entry = self._entry(str(peer), now)
            entry.rounds += 1
            entry.last_seen = now
        for peer in record.failed:
            self._entry(str(peer), now).failed += 1

    def rows(self) -> list[dict[str, Any]]:
        """Most recently seen first."""
        ordered = sorted(self.peers.items(), key=lambda item: -item[1].last_seen)
        return [
            {
                "peer_id": peer,
                "epoch": entry.epoch,
                "samples": entry.samples,
                "samples_per_s": round(entry.samples_per_s, 2),
                "rounds": entry.rounds,
                "failed": entry.failed,
                "last_seen": entry.last_seen,
            }
            for peer, entry in ordered
        ]
