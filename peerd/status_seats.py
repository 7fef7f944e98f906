"""Who may hold the status port's connections: a plain object with no I/O, which
``status_server.py`` drives (a connection opens, its request arrives, its answer is sent, it ends).

The port serves a local operator (`peerd status`, the dashboard, a scraper) and, bound beyond
loopback (Docker, ``--status-host 0.0.0.0``), hosts on the network. Opening a connection costs a
client nothing, and the server holds it until a request arrives, so:
- When a limit is reached, the connection that has waited longest for its next request is closed
  to make room, not the newcomer refused: `peerd status` sends its request as soon as it is
  connected, so it is never the oldest waiter, and idle connections, however many are opened and
  held, cannot keep it out. A newcomer is refused (503) only when every connection it could
  displace is in the middle of being answered, which lasts at most the send timeout.
- Connections from other hosts never take the last ``LOCAL_RESERVED`` places, and a remote
  newcomer displaces only remote connections (or local ones beyond the reserve): a flood from the
  network leaves room for the operator on this machine.
- One remote address (an IPv6 /64, as ``peer.admission`` groups them) holds at most
  ``MAX_CONNECTIONS_PER_ADDRESS``, and a newcomer beyond that displaces its own address's oldest
  waiter, so one host cannot fill the remote places either. Loopback has no per-address limit:
  every local client is 127.0.0.1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from peer.admission import address_group

__all__ = ["StatusSeats", "Seat", "MAX_CONNECTIONS", "LOCAL_RESERVED", "MAX_CONNECTIONS_PER_ADDRESS"]

# A browser opens up to 6 connections per host, Prometheus and `peerd status` one each: 32 leaves
# room for several tabs and scrapers, and bounds what a flood of connections can pin.
MAX_CONNECTIONS = 32
# Places only loopback clients may take: the operator's `peerd status`, a local dashboard tab
# (6 connections) and a scraper.
LOCAL_RESERVED = 8
# One browser (6 connections) and a scraper on one remote host.
MAX_CONNECTIONS_PER_ADDRESS = 8


class Ticket(Protocol):
    """What closes a connection (a trio cancel scope around it)."""

    def cancel(self) -> None: ...


class Seat:
    """One admitted connection."""

    __slots__ = ("group", "ticket")

    def __init__(self, group: str | None, ticket: Ticket) -> None:
        self.group = group  # None for a loopback client
        self.ticket = ticket


class StatusSeats:
    """The status port's connections, counted per pool and ordered by how long each has waited."""

    def __init__(
        self,
        max_connections: int = MAX_CONNECTIONS,
        local_reserved: int = LOCAL_RESERVED,
        max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
    ) -> None:
        if not 0 <= local_reserved < max_connections:
            raise ValueError("the local reserve must leave room for remote clients")
        self.max_connections = max_connections
        self.local_reserved = local_reserved
        self.max_per_address = max_per_address
        self._seats: set[Seat] = set()
        self._remote = 0
        self._by_group: dict[str, int] = {}
        # Seats waiting for a request (just opened, or idle between keep-alive requests), the one
        # that has waited longest first; a seat being answered is not here and cannot be displaced.
        self._waiting: OrderedDict[Seat, None] = OrderedDict()

    @property
    def open(self) -> int:
        return len(self._seats)

    def admit(self, host: str, ticket: Ticket) -> Seat | None:
        """Seat a new connection from ``host``, cancelling the tickets of the waiters it displaces;
        None if there is no room (answer 503)."""
        group = address_group(host)
        while (displaceable := self._full(group)) is not None:
            victim = next((seat for seat in self._waiting if displaceable(seat)), None)
            if victim is None:
                return None
            self.release(victim)
            victim.ticket.cancel()
        seat = Seat(group, ticket)
        self._seats.add(seat)
        if group is not None:
            self._remote += 1
            self._by_group[group] = self._by_group.get(group, 0) + 1
        self._waiting[seat] = None
        return seat

    def _full(self, group: str | None) -> Callable[[Seat], bool] | None:
        """Which seats a newcomer from ``group`` may displace for the first limit it meets; None if
        it meets none."""
        if group is None:
            return (lambda seat: True) if len(self._seats) >= self.max_connections else None
        if self._by_group.get(group, 0) >= self.max_per_address:
            return lambda seat: seat.group == group
        if self._remote >= self.max_connections - self.local_reserved:
            return lambda seat: seat.group is not None
        if len(self._seats) >= self.max_connections:
            return lambda seat: seat.group is not None or len(self._seats) - self._remote > self.local_reserved
        return None

    def answering(self, seat: Seat) -> None:
        """The seat's request has arrived: it is not displaced while it is answered."""
        self._waiting.pop(seat, None)

    def waiting(self, seat: Seat) -> None:
        """The seat was answered and waits for its next request (a keep-alive connection)."""
        if seat in self._seats:
            self._waiting[seat] = None
            self._waiting.move_to_end(seat)

    def release(self, seat: Seat) -> None:
        """The connection ended or was displaced (calling this twice is harmless)."""
        if seat not in self._seats:
            return
        self._seats.discard(seat)
        self._waiting.pop(seat, None)
        if seat.group is not None:
            self._remote -= 1
            self._by_group[seat.group] -= 1
            if not self._by_group[seat.group]:
                del self._by_group[seat.group]
