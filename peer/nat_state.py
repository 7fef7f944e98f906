"""Bookkeeping for reachability checks and circuit relays, with no I/O (times are passed in).

``DialBackLimiter``: a peer asked to dial another back (``peer/reachability.py``) dials only the
address it saw the request come from, and only so often: at most one dial-back in flight per source
address, one per source address per ``per_address_interval``, a token bucket per address group
(the caller picks the port, so a host could otherwise take every slot) and a global one. A peer
therefore cannot make us dial arbitrary hosts, nor one host at a high rate.

``RelayBook``: what a relay (``peer/relay.py``) has promised. A reservation lets a peer behind NAT
be reached through us; a circuit joins two raw TCP connections to us, one from each end, matched by
one-time random tokens. Every count a remote can raise is capped: reservations in total, circuits in
total, per reserving peer and per requesting peer; pending circuits expire when their partner does
not arrive; each circuit has a byte rate (``TokenBucket``) and a lifetime.

``reachability_verdict``: public, nat or unknown from the dial-back answers.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = [
    "DialBackLimiter",
    "RelayBook",
    "RelayLimits",
    "RelayRefused",
    "TokenBucket",
    "reachability_verdict",
    "PUBLIC",
    "NAT",
    "UNKNOWN",
]

PUBLIC, NAT, UNKNOWN = "public", "nat", "unknown"
TOKEN_BYTES = 16

Peer = TypeVar("Peer")


class TokenBucket:
    """``rate`` units per second with a burst of ``burst``; ``take`` says how long to wait first."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._at = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` (going into debt if need be); seconds the caller must wait before using it."""
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        self._level -= amount
        return 0.0 if self._level >= 0 else -self._level / self.rate

    def available(self, now: float) -> float:
        return min(self.burst, self._level + (now - self._at) * self.rate)


class DialBackLimiter:
    """Whether a dial-back to ``address`` may start now; ``finished`` when it ends."""

    def __init__(
        self,
        now: float,
        *,
        rate: float = 2.0,
        burst: float = 8.0,
        per_address_interval: float = 10.0,
        max_addresses: int = 4096,
        group_rate: float = 0.5,
        group_burst: float = 4.0,
    ):
        self._bucket = TokenBucket(rate, burst, now)
        self.per_address_interval = per_address_interval
        self.max_addresses = max_addresses
        self.group_rate, self.group_burst = group_rate, group_burst
        self._last: dict[str, float] = {}  # address -> when its last dial-back started
        self._groups: dict[str, TokenBucket] = {}  # address group -> its share of the dial-backs
        self._in_flight: set[str] = set()

    def start(self, address: str, now: float, *, group: str | None = None) -> str | None:
        """None if a dial-back to ``address`` may start (and is counted as started), else why not.
        ``group``: the caller's address group (``peer/admission.py``; None: no per-group limit).
        An endpoint's port is the caller's to choose, so one host gets ``group_burst`` dial-backs
        and ``group_rate`` a second, not the whole budget."""
        if address in self._in_flight:
            return "a dial-back to this address is already in progress"
        last = self._last.get(address)
        if last is not None and now - last < self.per_address_interval:
            return f"this address was dialed back {now - last:.1f} s ago"
        group_bucket = None
        if group is not None:
            group_bucket = self._groups.pop(group, None) or TokenBucket(self.group_rate, self.group_burst, now)
            self._groups[group] = group_bucket  # the most recently seen group goes last
            while len(self._groups) > self.max_addresses:
                del self._groups[next(iter(self._groups))]
            if group_bucket.available(now) < 1:
                return "too many dial-back requests from this address; try later"
        if self._bucket.available(now) < 1:
            return "too many dial-back requests; try later"
        self._bucket.take(1, now)
        if group_bucket is not None:
            group_bucket.take(1, now)
        self._last.pop(address, None)
        self._last[address] = now
        while len(self._last) > self.max_addresses:
            del self._last[next(iter(self._last))]  # the oldest: their interval has long passed
        self._in_flight.add(address)
        return None

    def finished(self, address: str) -> None:
        self._in_flight.discard(address)


def reachability_verdict(answers: list[bool], *, needed: int = 2) -> str:
    """``answers``: whether each peer that tried could dial us back. One success proves we can be
    reached (a peer cannot fake the handshake with our key); ``needed`` failures and no success
    say we are behind a NAT or firewall; anything less is unknown."""
    if any(answers):
        return PUBLIC
    return NAT if len(answers) >= needed else UNKNOWN


def most_common(addresses: list[tuple[str, int]]) -> tuple[str, int] | None:
    """The observed address most peers agree on (None if none was reported)."""
    if not addresses:
        return None
    return Counter(addresses).most_common(1)[0][0]


@dataclass(frozen=True)
class RelayLimits:
    """What one relay offers. Defaults let a few NAT'd volunteers train through one public peer
    until hole punching moves their traffic off it, without letting them take the whole uplink."""

    max_reservations: int = 128
    reservation_ttl: float = 120.0  # renewed by the client well before it runs out
    max_circuits: int = 64
    # Per reserving peer and per requesting peer (both ends count): every NAT'd member of an
    # averaging group dials every other through circuits at once when a round starts, until hole
    # punching moves them off, so a NAT'd reducer in a group of 16 with a third of it behind NAT
    # needs about 10; go-libp2p's circuit relay v2 allows 16 too. Larger groups, or a NAT'd
    # address shared by several peers (the per-address cap below), can still meet the cap: their
    # dials are refused and retried through the next round's punches.
    max_circuits_per_peer: int = 16
    # Per source address (IPv4, or IPv6 /64; loopback exempt): identities cost nothing to make, so
    # one host's Sybils must not hold every slot. A NAT puts a few volunteers behind one address.
    max_reservations_per_address: int = 16
    max_circuits_per_address: int = 16
    circuit_bytes_per_s: float = 16 * 2**20
    circuit_burst_bytes: float = 4 * 2**20
    circuit_lifetime: float = 3600.0
    # All circuits together: a few Sybil identities opening every circuit must not take more of
    # the relay's uplink than this (its own training traffic keeps the rest).
    total_bytes_per_s: float = 32 * 2**20
    total_burst_bytes: float = 8 * 2**20
    pending_timeout: float = 10.0  # both ends must arrive within this after the circuit is set up


class RelayRefused(Exception):
    """The relay will not reserve or connect; the message says which limit or why."""


@dataclass
class Circuit(Generic[Peer]):
    source: Peer
    target: Peer
    tokens: tuple[bytes, bytes]  # (the source's, the target's)
    expires: float  # while pending: when it is dropped if an end has not arrived
    arrived: list = field(default_factory=lambda: [None, None])  # each end's stream once it came
    active: bool = False
    waiter: Any = None  # the driver's: what the first end to arrive waits on
    groups: tuple[str, ...] = ()  # the address groups it counts against


class RelayBook(Generic[Peer]):
    """Reservations and circuits of one relay."""

    def __init__(self, limits: RelayLimits | None = None):
        self.limits = limits if limits is not None else RelayLimits()
        self.reservations: dict[Peer, float] = {}  # peer -> expiry
        self._reserved_from: dict[Peer, str | None] = {}  # peer -> its address group
        self._by_token: dict[bytes, tuple[Circuit[Peer], int]] = {}
        self._circuits: set[int] = set()
        self._all: dict[int, Circuit[Peer]] = {}
        self._per_peer: Counter = Counter()
        self._per_address: Counter = Counter()  # circuits per address group, either end

    @property
    def circuits(self) -> int:
        return len(self._all)

    def counted(self) -> tuple[int, int]:
        """How many peers and address groups have circuits counted against their limits now; each
        leaves the count with its last circuit, so the counters never outgrow the circuits."""
        return len(self._per_peer), len(self._per_address)

    def reserve(self, peer: Peer, now: float, group: str | None = None) -> float:
        """Reserve (or renew) for ``peer``, whose connection comes from address ``group`` (None:
        loopback, no per-address limit); returns the expiry. Raises RelayRefused when full."""
        self.expire(now)
        if peer not in self.reservations:
            if len(self.reservations) >= self.limits.max_reservations:
                raise RelayRefused(f"this relay holds its maximum of {self.limits.max_reservations} reservations")
            same_address = sum(1 for other in self._reserved_from.values() if group is not None and other == group)
            if same_address >= self.limits.max_reservations_per_address:
                raise RelayRefused(
                    f"{group} holds its maximum of {self.limits.max_reservations_per_address} reservations"
                )
        expiry = now + self.limits.reservation_ttl
        self.reservations[peer] = expiry
        self._reserved_from[peer] = group
        return expiry

    def drop_reservation(self, peer: Peer) -> None:
        self.reservations.pop(peer, None)
        self._reserved_from.pop(peer, None)

    def drop_reservations(self) -> None:
        """Forget every reservation (and where each came from)."""
        self.reservations.clear()
        self._reserved_from.clear()

    def open_circuit(self, source: Peer, target: Peer, now: float, source_group: str | None = None) -> Circuit[Peer]:
        """A pending circuit from ``source`` (calling from address ``source_group``) to the reserved
        ``target``, with a fresh token per end."""
        self.expire(now)
        if source == target:
            raise RelayRefused("a peer cannot relay to itself")
        if target not in self.reservations:
            raise RelayRefused("the target has no reservation with this relay")
        if len(self._all) >= self.limits.max_circuits:
            raise RelayRefused(f"this relay carries its maximum of {self.limits.max_circuits} circuits")
        for peer in (source, target):
            if self._per_peer[peer] >= self.limits.max_circuits_per_peer:
                raise RelayRefused(f"{peer} is at its maximum of {self.limits.max_circuits_per_peer} circuits")
        groups = tuple(g for g in {source_group, self._reserved_from.get(target)} if g is not None)
        for group in groups:
            if self._per_address[group] >= self.limits.max_circuits_per_address:
                raise RelayRefused(f"{group} is at its maximum of {self.limits.max_circuits_per_address} circuits")
        circuit = Circuit(
            source,
            target,
            (secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES)),
            now + self.limits.pending_timeout,
            groups=groups,
        )
        self._all[id(circuit)] = circuit
        self._per_peer[source] += 1
        self._per_peer[target] += 1
        self._per_address.update(groups)
        for side, token in enumerate(circuit.tokens):
            self._by_token[token] = (circuit, side)
        return circuit

    def arrive(self, token: bytes, stream: object, now: float) -> Circuit[Peer] | None:
        """An end presented ``token`` on ``stream``: its pending circuit (now active if both ends
        are there), or None for an unknown, used or expired token."""
        self.expire(now)
        found = self._by_token.pop(token, None)
        if found is None:
            return None
        circuit, side = found
        circuit.arrived[side] = stream
        if all(end is not None for end in circuit.arrived):
            circuit.active = True
            circuit.expires = now + self.limits.circuit_lifetime
        return circuit

    def close_circuit(self, circuit: Circuit[Peer]) -> None:
        if self._all.pop(id(circuit), None) is None:
            return
        for token in circuit.tokens:
            self._by_token.pop(token, None)
        for peer in (circuit.source, circuit.target):
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]
        for group in circuit.groups:
            self._per_address[group] -= 1
            if self._per_address[group] <= 0:
                del self._per_address[group]

    def expire(self, now: float) -> list[Circuit[Peer]]:
        """Drop expired reservations and pending circuits; returns the circuits dropped (their
        arrived ends are the driver's to close). Active circuits end by their own deadline."""
        for peer in [peer for peer, expiry in self.reservations.items() if expiry <= now]:
            self.drop_reservation(peer)
        dropped = [c for c in self._all.values() if not c.active and c.expires <= now]
        for circuit in dropped:
            self.close_circuit(circuit)
        return dropped
