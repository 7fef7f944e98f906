"""The dialer's side of a relayed address (``HOST:PORT/RELAYID/relay/PEERID``): reach the peer
behind NAT through its relay (``peer/relay.py`` has the protocol).

A dialer that others can reach directly asks the relay for **connection reversal** first: the
relay tells the peer where we listen (the address our connection to the relay announced, as the
relay sees it) and the peer dials us directly, as a peer behind NAT can. That costs no circuit
and no relayed bytes, and needs no hole punching afterwards; the relay's per-peer circuit limit
would otherwise let no more than a few peers reach a NAT'd peer at once (a whole averaging group
dials a new member at the same moment). If the relay refuses, or the peer's connection does not
arrive within ``REVERSAL_WAIT``, we open a circuit as a dialer behind NAT always does; a relay that
does not answer at all fails the dial (a circuit would need it too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from .address import PeerAddress
from .host import CIRCUIT_MAGIC, ConnectError, PeerHost
from .identity import PeerID
from .nat_state import TOKEN_BYTES
from .rpc_errors import CallTimeoutError, RPCError

if TYPE_CHECKING:
    from .rpc import Connection

__all__ = ["RelayedDials", "dial_through_relay", "CONNECT", "CALL_TIMEOUT", "REVERSAL_WAIT"]

CONNECT = "relay.connect"
CALL_TIMEOUT = 5.0
# How long a reversal may take before we open a circuit instead: the relay's call to the peer,
# the peer's dial (one RTT) and the handshake (two more) on a slow continental path.
REVERSAL_WAIT = 5.0


async def dial_through_relay(host: PeerHost, address: PeerAddress) -> trio.abc.Stream:
    """A stream to ``address.peer_id`` through ``address.relay``, ready for the Noise handshake."""
    if address.peer_id is None:
        raise ConnectError(f"{address}: a relayed address must name the peer")
    connection = await host.connect(address.relay_address)
    try:
        reply = await connection.call(CONNECT, {"target": address.peer_id.to_bytes()}, timeout=CALL_TIMEOUT)
    except (RPCError, trio.TooSlowError) as error:
        raise ConnectError(f"{address}: the relay refused: {error}") from None
    return await _circuit_end(host, address, reply.body)


async def _circuit_end(host: PeerHost, address: PeerAddress, body: Any) -> trio.abc.Stream:
    """Our end of the circuit the relay set up (its reply ``body`` holds our token)."""
    token = body.get("token") if isinstance(body, dict) else None
    if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
        raise ConnectError(f"{address}: the relay sent a malformed circuit token")
    stream = await host.open_stream(address.relay_address)
    try:
        await stream.send_all(bytes([CIRCUIT_MAGIC]) + token)
    except (trio.BrokenResourceError, OSError):
        await trio.aclose_forcefully(stream)
        raise ConnectError(f"{address}: the relay closed the circuit") from None
    return stream


class RelayedDials:
    """Dials relayed addresses for ``host`` (its ``presence`` dialer): reversal first while
    ``reachable()`` says others can dial us, else (or when it fails) a circuit."""

    def __init__(self, host: PeerHost, reachable: Callable[[], bool]):
        self.host = host
        self.reachable = reachable
        self.reversed = 0  # connections the peer dialed back (no circuit)
        self._awaited: dict[PeerID, trio.Event] = {}  # reversals we wait for, by peer
        host.on_connection.append(self._on_connection)
        host.presence.dial_relayed_with(self.dial)

    def _on_connection(self, connection: Connection, incoming: bool) -> None:
        awaited = self._awaited.get(connection.remote_peer_id)
        if awaited is not None and incoming and connection.relayed_via is None:
            awaited.set()

    async def dial(self, address: PeerAddress) -> trio.abc.Stream | Connection:
        """The connection the peer dialed back, or a stream through a circuit. A relay we cannot
        reach, or that does not answer, fails the dial (a circuit needs it too); one that refuses,
        or whose peer's connection does not arrive within ``REVERSAL_WAIT``, is asked for a
        circuit."""
        if address.peer_id is None:
            raise ConnectError(f"{address}: a relayed address must name the peer")
        if self.reachable() and self.host.listen_address is not None:
            reached = await self._reversal(address, address.peer_id)
            if reached is not None:
                return reached
        return await dial_through_relay(self.host, address)

    async def _reversal(self, address: PeerAddress, peer: PeerID) -> trio.abc.Stream | Connection | None:
        """The peer's connection, dialed back; a circuit's end where the relay set one up instead
        (a relay that does not reverse); None where the relay refused or the connection did not
        arrive within ``REVERSAL_WAIT``. A reversal of the same peer already on its way (asked
        through another of its relays) is waited for, and whatever connection came of it taken."""
        settled = self._awaited.get(peer)
        if settled is not None:
            with trio.move_on_after(REVERSAL_WAIT + CALL_TIMEOUT):
                await settled.wait()
            return self.host.connection_to(peer)
        settled = self._awaited[peer] = trio.Event()  # (set when a direct connection arrives, or we give up)
        try:
            relay = await self.host.connect(address.relay_address)
            request = {"target": peer.to_bytes(), "reverse": True}
            try:
                reply = await relay.call(CONNECT, request, timeout=CALL_TIMEOUT)
            except CallTimeoutError:
                raise ConnectError(f"{address}: the relay did not answer within {CALL_TIMEOUT:g} s") from None
            except RPCError:
                return None  # refused: a circuit may still be had (the relay's limits on the two differ)
            if not (isinstance(reply.body, dict) and reply.body.get("reversed") is True):
                return await _circuit_end(self.host, address, reply.body)
            with trio.move_on_after(REVERSAL_WAIT):
                await settled.wait()
            connection = self._direct(peer)
            if connection is not None:
                self.reversed += 1
            return connection
        finally:
            settled.set()
            if self._awaited.get(peer) is settled:
                del self._awaited[peer]

    def _direct(self, peer: PeerID) -> Connection | None:
        connection = self.host.connection_to(peer)
        return connection if connection is not None and connection.relayed_via is None else None
