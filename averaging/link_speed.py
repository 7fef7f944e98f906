"""How long to wait for a peer, and how fast this peer's own link is, sans I/O.

Both follow the bytes that move, not the clock alone:

* ``ProgressDeadline``: how long a reducer waits for one sender's contribution, or a sender for a
  reducer's reply. One fixed number of seconds is wrong both ways: it drops a live peer on a slow
  link whose share takes longer, and it makes everyone wait the whole of it for a peer that has
  stopped. Here a peer that keeps delivering bytes keeps its place, one that delivers nothing for
  ``stall`` seconds is given up, and a cap (the bytes it could owe at a floor rate, plus slack for
  the round to start) bounds a peer that trickles just enough to look alive. A peer whose
  connection is lost is given up at once (``gone``).
* ``ThroughputMeter`` and ``BandwidthEstimate``: the rate this peer's link achieved in a round
  (the slower direction), kept as a moving average over rounds. A peer declares that in
  matchmaking, so that its share of the reduction follows its link (``partition.py``).

The caller feeds in ``(now, bytes so far)`` observations (trio time, the socket counters of
``Connection.link_progress``) and reads the answers; nothing here sleeps or touches a socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = [
    "BandwidthEstimate",
    "DeadlineRules",
    "MIN_RATE",
    "ProgressDeadline",
    "ThroughputMeter",
    "UNMEASURED_BANDWIDTH",
]

# The slowest link worth averaging over, in bytes/s: 1 Mbit/s, a poor ADSL uplink. A peer that
# cannot move its bytes at least this fast makes everyone in its group wait longer than averaging
# with it is worth; a peer at or above it is waited for, however long its share takes.
MIN_RATE = 125_000.0
# No byte for this long from a peer that owes us bytes: it has stopped (frozen, cut off, or
# trickling less than one TCP segment per second). Progress is counted at the socket, so a live
# link delivers something every few milliseconds, except when a flow loses the same segment again
# and again: on a congested slow uplink shared by several flows (the lab's 5 Mbit/s peer), one of
# them was seen waiting over 2 s on retransmissions whose timeout doubles each time (~0.3, 0.6,
# 1.2, 2.4 s); 5 s outlasts four in a row. A peer whose process died is not waited for at all:
# its connection is lost or refused, and that gives it up at once.
STALL = 5.0
# Time a round may take to get going before the first byte is owed: the announcement reaching
# every member, flattening the tensors, a dial and a handshake (three round trips) on a loaded
# machine and a congested link. Also added to the cap.
SLACK = 5.0
# Until its first round has measured it, a peer declares the floor rate: it reduces a small share,
# so a newcomer on a slow link never holds its first group up, and its next declaration is measured.
UNMEASURED_BANDWIDTH = MIN_RATE


@dataclass(frozen=True)
class DeadlineRules:
    """``stall``, ``min_rate`` and ``slack`` as above; ``cap``: a caller's fixed upper bound in
    seconds from the start (None: only the byte-driven deadline)."""

    stall: float = STALL
    min_rate: float = MIN_RATE
    slack: float = SLACK
    cap: float | None = None

    def limit(self, owed_bytes: int) -> float:
        """Seconds from the start after which a peer owing ``owed_bytes`` is given up regardless."""
        seconds = self.slack + owed_bytes / self.min_rate
        return seconds if self.cap is None else min(seconds, self.cap)


class ProgressDeadline:
    """When to give up on one peer: ``stall`` seconds after its last progress (or ``slack`` after
    the start, before any), never later than the rules' cap for ``owed_bytes``.

    ``observe(now, total)`` takes a running byte count of the peer's traffic to or from us (any
    change counts as progress, so a count that restarts on a new connection is progress too).
    While ``quiet`` is set the peer owes nothing yet (a reducer waiting for other senders before it
    answers) and only the cap applies."""

    def __init__(self, rules: DeadlineRules, owed_bytes: int, now: float):
        self.rules = rules
        self.start = now
        self.cap_at = now + rules.limit(owed_bytes)
        self._first_due = now + rules.slack
        self._last_progress: float | None = None
        self._seen: int | None = None
        self.quiet = False
        self.lost: str | None = None

    def observe(self, now: float, total: int) -> None:
        if self._seen is None:
            self._seen = total  # the count before we started watching: no progress yet
        elif total != self._seen:
            self._seen = total
            self._last_progress = now

    @classmethod
    def for_replies(cls, rules: DeadlineRules, owed_bytes: int, now: float) -> ProgressDeadline:
        """A sender's deadline for a reducer's answers: a stall interval past the usual cap. The
        reducer answers once every sender still in the round has delivered, and gives up on a
        silent one only at its own deadline for it, counted from when it heard of the round
        (perhaps a round trip or more after us); capped at the same slack, the members that heard
        of the round first would give up on every reducer of a round whose member vanished."""
        deadline = cls(rules, owed_bytes, now)
        deadline.cap_at = now + replace(rules, slack=rules.slack + rules.stall).limit(owed_bytes)
        return deadline

    def resume(self, now: float) -> None:
        """The quiet spell is over: bytes are owed again from ``now``."""
        self.quiet = False
        self._last_progress = now

    def gone(self, reason: str) -> None:
        """The peer's connection is lost: it is given up at once."""
        self.lost = reason

    @property
    def deadline(self) -> float:
        if self.lost is not None:
            return -math.inf
        if self.quiet:
            return self.cap_at
        stall_at = self._first_due if self._last_progress is None else self._last_progress + self.rules.stall
        return min(stall_at, self.cap_at)

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def reason(self, now: float) -> str:
        """Why the peer was given up (for logs and the round's result)."""
        if self.lost is not None:
            return self.lost
        if now >= self.cap_at:
            return f"not done within {self.cap_at - self.start:.1f} s (the cap for its bytes at the floor rate)"
        if self._last_progress is None:
            return f"no byte within {self.rules.slack:g} s of the start"
        return f"no byte for {self.rules.stall:g} s"


# A token-bucket shaper (tbf in the lab, an ISP's elsewhere) lets a burst through at line rate
# after a quiet spell; and a window of a few polls would take that burst for the link's rate.
# Counting this many bytes of every window as free makes the measure a lower bound of the rate of
# any link whose bucket holds up to 256 KiB, while a transfer of a few of them still measures close
# to its rate.
BURST_ALLOWANCE = 256 * 1024
# Fewer bytes than this in a direction in a round say nothing about the link: such a round keeps
# the estimate as it was.
MIN_MEASURED_BYTES = 4 * BURST_ALLOWANCE
# The meter keeps at most this many observations per direction (a long round is thinned out).
MAX_SAMPLES = 128


class ThroughputMeter:
    """The best sustained rate of one direction of a round's traffic: the largest
    ``(bytes - BURST_ALLOWANCE) / seconds`` between any two observations of the running count.

    The peak rather than the round's average: a fast peer's transfers finish early and then it
    waits for slower ones, and an average over the round would charge it with their slowness."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, int]] = []
        self._base: int | None = None

    def observe(self, now: float, total: int) -> None:
        if self._base is None:
            self._base = total
        samples = self._samples
        if samples and samples[-1][1] == total - self._base and len(samples) > 1 and samples[-2][1] == samples[-1][1]:
            samples[-1] = (now, total - self._base)  # idle: keep only the spell's first and last
        else:
            samples.append((now, total - self._base))
        if len(samples) > MAX_SAMPLES:
            del samples[1:-1:2]

    @property
    def bytes(self) -> int:
        return self._samples[-1][1] if self._samples else 0

    @property
    def observations_kept(self) -> int:
        """How many observations the meter holds: at most ``MAX_SAMPLES``, and an idle spell two."""
        return len(self._samples)

    def rate(self) -> float | None:
        """Bytes per second, or None when too few bytes moved to tell."""
        if self.bytes < MIN_MEASURED_BYTES:
            return None
        best = 0.0
        samples = self._samples
        for i, (t0, b0) in enumerate(samples):
            for t1, b1 in samples[i + 1 :]:
                if t1 > t0 and b1 - b0 > BURST_ALLOWANCE:
                    best = max(best, (b1 - b0 - BURST_ALLOWANCE) / (t1 - t0))
        return best or None


def link_rate(upload: ThroughputMeter, download: ThroughputMeter) -> float | None:
    """The slower of the two directions that moved enough bytes to measure (None if neither did)."""
    rates = [rate for rate in (upload.rate(), download.rate()) if rate is not None]
    return min(rates) if rates else None


class BandwidthEstimate:
    """This peer's link rate as a moving average over rounds (bytes/s), starting at ``prior``.

    The first measurement replaces the prior; later ones move the estimate by ``weight`` of the
    difference, so one round disturbed by other traffic does not swing a peer's share. ``fixed``:
    a figure the caller states instead, which is what a peer declares whatever it measures."""

    def __init__(self, prior: float = UNMEASURED_BANDWIDTH, weight: float = 0.5, fixed: float | None = None):
        self.value = prior
        self.weight = weight
        self.measured = False
        self.fixed = fixed

    def update(self, rate: float | None) -> float:
        if rate is not None and math.isfinite(rate) and rate > 0:
            self.value = rate if not self.measured else self.value + self.weight * (rate - self.value)
            self.measured = True
        return self.value
