"""A host's pool of live connections, one per remote peer, and the dials in flight.

At most one connection per remote peer is pooled (incoming connections are reused for outgoing
calls too); a closed one is never handed out, and the next call dials again. Concurrent calls for
the same endpoint and expected identity share one dial and its outcome. The dialing itself (TCP,
relays, the handshake) is the host's: ``connect`` takes it as a function.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from .address import PeerAddress
from .identity import PeerID
from .idle_connections import IDLE_RETIRE_S, IdleConnections, RecurringPeers
from .rpc import Connection

__all__ = ["ConnectError", "ConnectionPool", "MAX_KNOWN_ENDPOINTS"]

# Endpoints whose identity we learned by dialing them. Contacts come from other peers, so this map
# is bounded: past the cap the oldest entries go (they only save a lookup in the pool).
MAX_KNOWN_ENDPOINTS = 4096

_DialKey = tuple[str, int, "PeerID | None"]


class ConnectError(OSError):
    """Could not reach or authenticate a peer; the message says which address and why.
    ``refused``: the host answered that nothing listens at that port (ECONNREFUSED), unlike a
    timeout or an unreachable network, which say nothing about whether a peer is there.
    ``answered_by``: the identity the endpoint proved when it is not the one the address pins
    (the endpoint is that peer's, whoever named it for another)."""

    def __init__(self, message: str, *, refused: bool = False, answered_by: PeerID | None = None):
        super().__init__(message)
        self.refused = refused
        self.answered_by = answered_by


class _Dial:
    """One dial in flight, shared by every caller that wants the same endpoint and identity."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: ConnectError | None = None


class ConnectionPool:
    """Live connections by remote peer, the peers known at dialed endpoints, and shared dials."""

    def __init__(self, retire_idle_after: float | None = IDLE_RETIRE_S) -> None:
        """``retire_idle_after``: seconds a connection may stay idle (None: for ever)."""
        self._idle = IdleConnections(retire_idle_after) if retire_idle_after is not None else None
        self._recurring = RecurringPeers(retire_idle_after) if retire_idle_after is not None else None
        self._connections: dict[PeerID, Connection] = {}
        # Every connection the host runs, pooled or not (in the order they came): when two peers
        # dial each other at once, a connection can find a pooled one beside it at both ends; it
        # still carries its dialer's calls, and retires when idle like the pooled ones.
        self._running: dict[Connection, None] = {}
        self._endpoint_peer: dict[tuple[str, int], PeerID] = {}
        self._dialing: dict[_DialKey, _Dial] = {}

    def get(self, peer: PeerID) -> Connection | None:
        """The pooled connection to ``peer``, unless it is closed, closing or retiring."""
        connection = self._connections.get(peer)
        return connection if connection is not None and connection.takes_calls else None

    @property
    def peers(self) -> list[PeerID]:
        return [peer for peer, connection in self._connections.items() if connection.takes_calls]

    def idle(self, now: float) -> list[Connection]:
        """The connections idle long enough to retire (``idle_connections.py``), pooled or not."""
        if self._idle is None:
            return []
        live = [connection for connection in self._running if connection.takes_calls]
        activity = ((c, (c.link_progress(), c.protocol.active_calls)) for c in live)
        return self._idle.look(activity, now)

    def add(self, connection: Connection, now: float) -> Connection | None:
        """Pool ``connection`` if its peer has no live one, or only a relayed one while this one is
        direct (hole punched, or the peer became reachable); return the relayed connection it
        replaces (the caller gives its calls a grace period), else None."""
        peer = connection.remote_peer_id
        self._running[connection] = None
        if self._idle is not None:
            # a peer called again soon after a retirement keeps its connections longer; not through a
            # relay, whose circuits per peer and in all are few
            direct = connection.relayed_via is None
            self._idle.allow(connection, self._recurring.connected(peer, now) if direct else self._idle.retire_after)
        existing = self._connections.get(peer)
        if existing is None or not existing.takes_calls:
            self._connections[peer] = connection
        elif existing.relayed_via is not None and connection.relayed_via is None:
            self._connections[peer] = connection
            return existing
        return None

    def remove(self, connection: Connection, now: float) -> None:
        """``connection`` is down: it leaves the pool, if it is the one pooled for its peer."""
        peer = connection.remote_peer_id
        self._running.pop(connection, None)
        if self._connections.get(peer) is connection:
            del self._connections[peer]
        if self._idle is not None:
            quiet_since = self._idle.forget(connection)
            # idle, by our look or the peer's; a duplicate retiring beside a live connection to the
            # same peer tells nothing of that peer's quiet
            if connection.retired and connection.relayed_via is None and self.get(peer) is None:
                self._recurring.retired(peer, now, now - quiet_since if quiet_since is not None else 0.0)

    async def connect(self, address: PeerAddress, dial: Callable[[PeerAddress], Awaitable[Connection]]) -> Connection:
        """A live connection to ``address``: the pooled one, the outcome of a dial in flight for the
        same endpoint and identity, or ``dial(address)``'s (ConnectError on failure)."""
        endpoint = (address.host, address.port)
        key = (address.host, address.port, address.peer_id)
        while True:
            known = address.peer_id or self._endpoint_peer.get(endpoint)
            if known is not None and (connection := self.get(known)) is not None:
                if address.peer_id is None or address.peer_id == connection.remote_peer_id:
                    return connection
            shared = self._dialing.get(key)
            if shared is None:
                break
            await shared.done.wait()
            if shared.error is not None:
                raise ConnectError(
                    str(shared.error), refused=shared.error.refused, answered_by=shared.error.answered_by
                )
            # Their connection is pooled now, unless it already closed or their dial was cancelled
            # (their deadline, not ours): then look, and dial, again.
        ours = self._dialing[key] = _Dial()
        try:
            connection = await dial(address)
            if address.relay is None:  # a relay's endpoint is the relay's, not the peer's
                self._remember(endpoint, connection.remote_peer_id)
        except ConnectError as error:
            ours.error = error
            raise
        finally:
            del self._dialing[key]
            ours.done.set()
        return connection

    def _remember(self, endpoint: tuple[str, int], peer: PeerID) -> None:
        self._endpoint_peer.pop(endpoint, None)
        self._endpoint_peer[endpoint] = peer
        while len(self._endpoint_peer) > MAX_KNOWN_ENDPOINTS:
            del self._endpoint_peer[next(iter(self._endpoint_peer))]
