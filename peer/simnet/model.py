"""The simulated internet as a plain object: hosts, their latencies and bandwidths, link state, and
when a segment sent now arrives. No I/O and no clock of its own: callers pass ``now``.

Latency: every host has a seeded position in a square (coordinates in milliseconds of one-way
propagation) and an access delay (its last mile). The one-way delay between two hosts is their
distance plus both access delays, so delays form a metric (triangles are consistent: going through
a third host is never faster) and RTTs lie in ``[4 * min access, 2 * (side * sqrt(2) + 2 * max
access)]``: 10-300 ms with the defaults.

Bandwidth: every host has an uplink and a downlink rate (one of ``BANDWIDTH_MIXES``), each a
queue shared by all of its connections: a segment leaves the sender's uplink when the segments
queued before it have (its rate in bytes per second is the token rate; nothing bursts above it),
propagates, and is delivered once the receiver's downlink has taken it in. A lone transfer of N
bytes therefore takes the one-way delay plus N over the smaller of the two rates. Several
transfers through one uplink share it in the order their segments were sent; a downlink takes
segments in the order they reach it: each occupies it for its size over the downlink's rate, from
when it reaches the receiver's edge or the first free stretch after that. The model fixes a
segment's arrival when it is sent, so one sent later from a nearer host goes ahead of those booked
before it where it fits in before them, and after them where it does not.

Modelled payload sizes: a simulation of a model too large for one process runs tiny real tensors
and says each bulk write stands for ``bulk_scale`` times its bytes (``bulk_size``: a write of
more than this many bytes is bulk; requests, replies and small messages keep their real size). A
1B-parameter model's averaging then takes as long as its real bytes would, while the DHT's and
matchmaking's messages take their own time.

Links: a cut between two hosts, a partition of the hosts into sides, or a host that left makes
the link dead as a pulled cable does: nothing sent across it arrives until it is healed (the
streams hold it, as TCP retransmits it), senders stall, dials get no answer. Connections are not
closed by the network; the peers at their ends find a dead link by their own deadlines.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["HostProfile", "NetworkModel", "Segment", "BANDWIDTH_MIXES", "BULK_BYTES", "MBIT"]

MBIT = 1e6 / 8  # bytes per second in one Mbit/s

# (uplink, downlink) in Mbit/s: DSL-like, cable-like and fibre/datacentre-like volunteers.
BANDWIDTH_MIXES: tuple[tuple[float, float], ...] = ((10.0, 50.0), (20.0, 200.0), (100.0, 1000.0))

# Coordinates: a square of 90 ms of one-way propagation a side (its diagonal, ~127 ms, is about
# half the earth's circumference in fibre); access delays 2.5-10 ms one-way (fibre to DSL).
SIDE_S = 0.090

# Writes larger than this are bulk (tensor payloads). Measured in billion_sim's swarms (8 peers,
# 1/100 of a 1B model's values): 95% of the writes of the DHT's, matchmaking's and the all-reduce's
# control messages are under 0.5 KiB, ~2.5% of them 1-4 KiB; the tensor parts' writes are 1-2 KiB
# (sparse, a quarter of the model), 4-64 KiB (sparse) and 8-512 KiB (int8). So a few control
# messages count as bulk: what a simulation measures with it is an upper bound, a close one.
BULK_BYTES = 1024
ACCESS_DELAY_S = (0.0025, 0.010)


@dataclass(frozen=True)
class HostProfile:
    """One simulated host: its address and what its connections see of the network."""

    address: str
    position: tuple[float, float]  # seconds of one-way propagation from the square's corner
    access_delay: float  # seconds one-way, paid at both ends of every path to or from it
    uplink: float  # bytes per second
    downlink: float  # bytes per second


@dataclass(frozen=True)
class Segment:
    """When a segment given to the network leaves its sender's uplink and when it is delivered."""

    sent_at: float
    arrives_at: float


class NetworkModel:
    """Hosts, link state and the timing of every segment, all drawn from one seed."""

    def __init__(
        self,
        seed: int,
        *,
        side: float = SIDE_S,
        access_delay: tuple[float, float] = ACCESS_DELAY_S,
        mixes: Sequence[tuple[float, float]] = BANDWIDTH_MIXES,
        bulk_scale: float = 1.0,
        bulk_size: int = BULK_BYTES,
    ):
        self._random = random.Random(seed)
        self.bulk_scale, self.bulk_size = bulk_scale, bulk_size
        self._side, self._access, self._mixes = side, access_delay, tuple(mixes)
        self.hosts: dict[str, HostProfile] = {}
        self._count = 0
        self._uplink_free: dict[str, float] = {}  # when each host's uplink has sent what it was given
        # per host: the stretches (start, end) its downlink is booked for, in order, not overlapping
        self._downlink_busy: dict[str, list[tuple[float, float]]] = {}
        self._cuts: set[frozenset[str]] = set()
        self._side_of: dict[str, int] | None = None  # the partition in force, if any
        self.bytes_sent_total = 0  # every host's, for reports: what the swarm put on the wire
        self.segments_sent_total = 0

    # ------------------------------------------------------------------ hosts
    def add_host(self) -> HostProfile:
        """A new host with the next address and seeded position, access delay and bandwidths."""
        self._count += 1
        number = self._count
        address = f"10.{(number >> 16) & 255}.{(number >> 8) & 255}.{number & 255}"
        draw = self._random
        position = (draw.uniform(0.0, self._side), draw.uniform(0.0, self._side))
        up, down = draw.choice(self._mixes)
        host = HostProfile(address, position, draw.uniform(*self._access), up * MBIT, down * MBIT)
        self.hosts[address] = host
        self._uplink_free[address] = 0.0
        self._downlink_busy[address] = []
        return host

    def remove_host(self, address: str) -> None:
        """The host left (switched off, unplugged): every link to it is dead from now on."""
        self.hosts.pop(address, None)

    # ------------------------------------------------------------------ latency
    def one_way_delay(self, source: str, destination: str) -> float:
        a, b = self.hosts[source], self.hosts[destination]
        distance = math.dist(a.position, b.position)
        return distance + (a.access_delay + b.access_delay)  # (grouped: the same sum either way)

    def rtt(self, source: str, destination: str) -> float:
        return 2.0 * self.one_way_delay(source, destination)

    # ------------------------------------------------------------------ links
    def linked(self, source: str, destination: str) -> bool:
        """Whether bytes get from ``source`` to ``destination`` now (both present, no cut, one side)."""
        if source not in self.hosts or destination not in self.hosts:
            return False
        if frozenset((source, destination)) in self._cuts:
            return False
        sides = self._side_of
        return sides is None or sides.get(source, -1) == sides.get(destination, -1)

    def cut(self, a: str, b: str) -> None:
        self._cuts.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        self._cuts.discard(frozenset((a, b)))

    def partition(self, sides: Iterable[Iterable[str]]) -> None:
        """Split the network: hosts reach only hosts on their own side; hosts named on no side
        (those joining later too) are together on one more side."""
        self._side_of = {address: number for number, side in enumerate(sides) for address in side}

    def heal_partition(self) -> None:
        self._side_of = None

    # ------------------------------------------------------------------ bytes
    def write_scale(self, write: int) -> float:
        """How many bytes on the links each byte of a write of ``write`` bytes stands for."""
        return self.bulk_scale if write > self.bulk_size else 1.0

    def send(self, source: str, destination: str, now: float, size: int) -> Segment:
        """Put ``size`` bytes on the path at ``now``: when they have left the sender's uplink (its
        queue shared with its other connections) and when the receiver's downlink delivers them
        (the last byte: after the propagation delay, at the downlink's rate, in turn with what else
        reaches it). Cut-through: a fast downlink delivers as the uplink sends."""
        up, down = self.hosts[source].uplink, self.hosts[destination].downlink
        self.bytes_sent_total += size
        self.segments_sent_total += 1
        delay = self.one_way_delay(source, destination)
        leaves = max(now, self._uplink_free[source])
        sent_at = leaves + size / up
        self._uplink_free[source] = sent_at
        # At the edge from when the downlink can take it without getting ahead of the uplink.
        reaches_edge = max(leaves + delay, sent_at + delay - size / down)
        arrives_at = self._book_downlink(destination, now, reaches_edge, size / down)
        return Segment(sent_at, arrives_at)

    def _book_downlink(self, destination: str, now: float, ready: float, duration: float) -> float:
        """Book ``duration`` of the downlink in its first free stretch from ``ready`` on: when it ends."""
        busy = self._downlink_busy[destination]
        done = bisect.bisect_right(busy, now, key=lambda stretch: stretch[1])
        del busy[:done]  # over: every segment sent from now on reaches the edge later
        index = bisect.bisect_right(busy, ready, key=lambda stretch: stretch[1])
        start = ready
        while index < len(busy) and start + duration > busy[index][0]:
            start = max(start, busy[index][1])
            index += 1
        busy.insert(index, (start, start + duration))
        return start + duration
