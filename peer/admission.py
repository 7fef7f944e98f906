"""Who may occupy a peer's door: fair limits on pending handshakes and on connections.

A plain object with no I/O: the host reports what happens (a handshake starts or ends, a
connection is authenticated or closes) and gets back which pending handshakes or connections to
drop. Tickets are whatever the host uses to drop one (a cancel scope, a connection); this class
only orders and counts them.

Why these rules:
- A stranger's connection costs a socket and a task until its handshake ends, and opening one
  costs the stranger nothing. Pending handshakes are therefore limited per source address and in
  total, and when a limit is reached the *oldest* pending handshake goes, not the newcomer: an
  honest peer's handshake finishes within a round trip or two, so the slots an attacker holds open
  are always the old ones, and nobody can hold the door by refilling it.
- Authenticated connections cost buffers; one identity needs one connection (a few while
  reconnecting), and one address is shared by at most a household or a NAT's users. Per identity,
  the newest connection replaces the oldest (a restarted peer reconnects at once); per address,
  connections beyond the limit are refused.
- IPv6 addresses are grouped by their /64 prefix: one subscriber gets a whole /64 for free.
- Loopback addresses have no per-address limits (only the totals apply): a peer on this machine is
  not a remote host taking seats from others, and one-host swarms (tests, `peerd swarm`, a
  benchmark's 200 nodes) reach each other only through 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

__all__ = [
    "Admission",
    "address_group",
    "MAX_PENDING_HANDSHAKES",
    "MAX_PENDING_PER_ADDRESS",
    "MAX_CONNECTIONS_PER_ADDRESS",
    "MAX_CONNECTIONS_PER_IDENTITY",
    "MAX_CONNECTIONS",
]

# Each pending handshake costs a socket and a few KiB, and lives at most the handshake timeout.
MAX_PENDING_HANDSHAKES = 512
# A host behind one address dials us a few times at once at most (the DHT's parallel lookups).
MAX_PENDING_PER_ADDRESS = 16
# A NAT or a shared host puts a few dozen volunteers behind one address.
MAX_CONNECTIONS_PER_ADDRESS = 64
# One pooled connection per peer pair, plus a few that overlap while a peer reconnects.
MAX_CONNECTIONS_PER_IDENTITY = 4
# Incoming connections in all. Each may hold a few bounded buffers (its unread stream data, its
# queued replies), so this is what turns those per-connection caps into a bound on the process.
# A swarm peer talks to its routing table (k=20 per bucket, ~160 known peers) and its groups.
MAX_CONNECTIONS = 1024


def address_group(host: str) -> str | None:
    """The unit per-address limits apply to: the IPv4 address, or the /64 prefix of an IPv6
    address; None for loopback addresses, which only count toward the totals."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Admission:
    def __init__(
        self,
        *,
        max_pending: int = MAX_PENDING_HANDSHAKES,
        max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
        max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
        max_connections_per_identity: int = MAX_CONNECTIONS_PER_IDENTITY,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.max_pending = max_pending
        self.max_pending_per_address = max_pending_per_address
        self.max_connections_per_address = max_connections_per_address
        self.max_connections_per_identity = max_connections_per_identity
        self.max_connections = max_connections
        # Insertion-ordered, oldest first; each maps ticket -> its group (or (group, identity)).
        self._pending: OrderedDict[Any, str] = OrderedDict()
        self._pending_by_group: dict[str, OrderedDict[Any, None]] = {}
        self._connections: dict[Any, tuple[str, Hashable]] = {}
        self._by_group: dict[str, int] = {}
        self._by_identity: dict[Hashable, OrderedDict[Any, None]] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def connections(self) -> int:
        return len(self._connections)

    # ------------------------------------------------------------------ handshakes
    def handshake_started(self, ticket: Any, group: str | None) -> list[Any]:
        """Admit a new pending handshake; returns the older pending tickets to drop for it."""
        victims = []
        same_group = self._pending_by_group.get(group) if group is not None else None
        if same_group is not None and len(same_group) >= self.max_pending_per_address:
            victims.append(next(iter(same_group)))
        elif len(self._pending) >= self.max_pending:
            victims.append(next(iter(self._pending)))
        for victim in victims:
            self.handshake_ended(victim)
        self._pending[ticket] = group
        if group is not None:
            self._pending_by_group.setdefault(group, OrderedDict())[ticket] = None
        return victims

    def handshake_ended(self, ticket: Any) -> None:
        """The handshake finished, failed or was dropped (calling this twice is harmless)."""
        if ticket not in self._pending:
            return
        group = self._pending.pop(ticket)
        if group is None:
            return
        same_group = self._pending_by_group[group]
        del same_group[ticket]
        if not same_group:
            del self._pending_by_group[group]

    # ------------------------------------------------------------------ connections
    def connection_opened(self, ticket: Any, group: str | None, identity: Hashable) -> list[Any] | None:
        """Admit an authenticated incoming connection. Returns the older connections of the same
        identity to close for it, or None when its address, or the peer as a whole, has no room
        (refuse this one)."""
        if group is not None and self._by_group.get(group, 0) >= self.max_connections_per_address:
            return None
        victims = []
        same_identity = self._by_identity.get(identity)
        if same_identity is not None and len(same_identity) >= self.max_connections_per_identity:
            victims.append(next(iter(same_identity)))
        elif len(self._connections) >= self.max_connections:
            return None
        for victim in victims:
            self.connection_closed(victim)
        self._connections[ticket] = (group, identity)
        if group is not None:
            self._by_group[group] = self._by_group.get(group, 0) + 1
        self._by_identity.setdefault(identity, OrderedDict())[ticket] = None
        return victims

    def connection_closed(self, ticket: Any) -> None:
        """The connection ended or was closed (calling this twice is harmless)."""
        entry = self._connections.pop(ticket, None)
        if entry is None:
            return
        group, identity = entry
        if group is not None:
            self._by_group[group] -= 1
            if not self._by_group[group]:
                del self._by_group[group]
        same_identity = self._by_identity[identity]
        del same_identity[ticket]
        if not same_identity:
            del self._by_identity[identity]
