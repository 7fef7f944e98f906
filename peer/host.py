"""A peer's network presence: its listener and its pool of authenticated RPC connections.

``open_peer_host`` is the one place a peer's connections live: it owns the nursery in which every
connection runs, so leaving the ``async with`` block closes them all. At most one connection per
remote peer is kept in the pool (``peer/connection_pool.py``; incoming connections are reused for
outgoing calls too); a dead connection leaves the pool and the next call dials again.

What NAT traversal (``peer/relay.py``, ``peer/holepunch.py``, ``peer/reachability.py``) needs of a
host is public: ``start_soon``/``start`` run a task the host owns (it ends with the host),
``hello()`` is what the host says at a handshake, and ``presence`` (``peer/presence.py``) holds the
announced relayed addresses, the relay dialer and the relay that takes circuit ends.

A host dials and listens through its transport (``peer/transport.py``): TCP, unless a test or
benchmark opens it on a simulated network (``peer/simnet``).

A host carries its node-ID proof (``peer/node_id.py``) and the run's node-ID difficulty: its hellos
show the proof, and it refuses peers whose proof or difficulty does not match the run's.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from .access import SwarmAccess
from .address import PeerAddress
from .admission import Admission, address_group
from .connection_pool import ConnectError, ConnectionPool
from .identity import Identity, PeerID
from .idle_connections import IDLE_CHECK_S, IDLE_RETIRE_S
from .nat_state import TOKEN_BYTES
from .node_id import LOCAL_DIFFICULTY, NodeIDProof, check_difficulty
from .presence import Presence
from .router import Message, Router
from .rpc import Connection, TrafficCounter
from .secure_channel import (
    HANDSHAKE_TIMEOUT,
    PROTOCOL_VERSION,
    HandshakeError,
    Hello,
    HelloMismatch,
    PeerIDMismatch,
    SecureChannel,
    secure_handshake,
)
from .tcp_options import tune_connection
from .transport import TcpTransport, Transport

__all__ = ["PeerHost", "ConnectError", "open_peer_host"]

log = logging.getLogger("peerd.host")

# A relayed connection replaced by a direct one stays open this long for the calls still on it.
RELAY_HANDOVER_GRACE = 30.0

Service = TypeVar("Service")


class PeerHost:
    """Listener plus connection pool of one peer. Create it with ``open_peer_host``."""

    def __init__(
        self,
        identity: Identity,
        nursery: trio.Nursery,
        *,
        router: Router | None = None,
        run_id: str = "default",
        client_mode: bool = False,
        protocol_version: int = PROTOCOL_VERSION,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        node_id_difficulty: int = LOCAL_DIFFICULTY,
        node_id: NodeIDProof | None = None,
        access: SwarmAccess | None = None,
        transport: Transport | None = None,
        retire_idle_after: float | None = IDLE_RETIRE_S,
    ):
        """``node_id_difficulty`` is the run's: every peer of a run must use the same one. The
        default is the local one (a few hundred hashes), so that scripts, tests and local swarms
        start at once; a public run passes a high one, and a proof (``node_id``, e.g. from
        ``load_or_solve`` beside the identity file) so that the work is done once per key, not per
        start. Without ``node_id`` the host solves the puzzle itself, now. ``access`` makes the
        swarm private (``peer/access.py``): an allowlist of peer IDs and/or a shared swarm key.
        ``transport`` is how the host dials and listens: TCP (``TcpTransport``, which also holds the
        dial deadline) unless a test or benchmark passes a simulated network's.
        ``retire_idle_after``: seconds a connection may carry nothing before it is retired
        (``idle_connections.py``; None keeps every connection until it fails)."""
        self.identity = identity
        node_id_difficulty = check_difficulty(node_id_difficulty)
        if node_id is None:
            node_id = NodeIDProof.solve(identity.peer_id, node_id_difficulty)
        elif node_id.peer_id != identity.peer_id or not node_id.satisfies(node_id_difficulty):
            raise ValueError(f"{node_id!r} is not a solution for {identity.peer_id} at difficulty {node_id_difficulty}")
        self.node_id = node_id
        # What every hello of ours says whatever our addresses (``hello()`` fills those in).
        self._hello_terms = Hello(
            protocol_version, run_id, node_id_nonce=node_id.nonce, node_id_difficulty=node_id_difficulty
        )
        self.router = router if router is not None else Router()
        self.access = access if access is not None else SwarmAccess()
        self.client_mode = client_mode
        self.handshake_timeout = handshake_timeout
        self.transport: Transport = transport if transport is not None else TcpTransport()
        self.listen_address: PeerAddress | None = None
        self._nursery = nursery
        self._pool = ConnectionPool(retire_idle_after)
        self.admission = Admission()  # fair limits on pending handshakes and incoming connections
        self.traffic = TrafficCounter()  # totals over all of this peer's connections
        self.on_connection: list[Any] = []  # callbacks(connection, incoming: bool)
        self._services: dict[type, Any] = {}
        self.presence = Presence()  # relayed addresses we announce, relays we dial and run

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def node_id_difficulty(self) -> int:
        """The run's node-ID difficulty: every peer we accept proves its node ID at it."""
        return self._hello_terms.node_id_difficulty

    @property
    def public_address(self) -> PeerAddress | None:
        """Where others reach us: our first relayed address while we announce relayed ones (behind
        NAT), else our listen address (None in client mode)."""
        announced = self.presence.announced
        if announced:
            return announced[0].with_peer_id(self.peer_id)
        return self.listen_address

    def start_soon(self, task: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``task(*args)`` as a task of this host: it is cancelled when the host closes (a
        RuntimeError once the host is closing). For work that outlives the call that starts it,
        on behalf of the host's connections (answering a relayed circuit, a hole punch)."""
        self._nursery.start_soon(task, *args)

    async def start(self, task: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Like ``start_soon``, but wait until ``task`` calls ``task_status.started()``; returns
        what it passed."""
        return await self._nursery.start(task, *args)

    def service(self, kind: type[Service]) -> Service:
        """This host's one ``kind(self)``, created on first use.

        For a component that serves RPC methods for every user of the host (all averagers share
        one all-reduce service and its ``avg.reduce``): it lives as long as the host, and its
        methods reach the host's router once, which refuses any second registration of a name."""
        service = self._services.get(kind)
        if service is None:
            service = self._services[kind] = kind(self)
        return service

    def provide_service(self, kind: type[Service], service: Service) -> None:
        """Make ``service`` this host's ``kind`` (one built with other options, or a substitute in
        tests and benchmarks); only before anyone used ``service(kind)``."""
        if kind in self._services:
            raise ValueError(f"this host already has its {kind.__name__}")
        self._services[kind] = service

    # ------------------------------------------------------------------ listening
    def hello(self) -> Hello:
        """What this host says at a handshake now: its protocol version, run, node-ID proof, client
        mode and where it is reached (its announced relayed addresses, else its listen address)."""
        announced = self.presence.announced
        if announced:
            listen = tuple(str(address) for address in announced[:4])
        else:
            listen = (self.listen_address.endpoint,) if self.listen_address is not None else ()
        return dataclasses.replace(self._hello_terms, client_mode=self.client_mode, listen_addresses=listen)

    async def _serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        (bound_host, bound_port), listeners = await self.transport.listen(host, port)
        self.listen_address = PeerAddress(bound_host, bound_port, self.peer_id)
        task_status.started(self.listen_address)
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener)

    async def _accept_loop(self, listener: trio.abc.Listener) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as error:
                    if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        log.warning("out of sockets while accepting (%s); pausing", error)
                        await trio.sleep(0.1)
                        continue
                    raise
                self._nursery.start_soon(self._handle_incoming, stream)

    async def _handle_incoming(self, stream: trio.abc.Stream) -> None:
        group = address_group(self.transport.remote_host(stream))
        circuit_token: bytes | None = None
        with trio.CancelScope() as pending:
            for older in self.admission.handshake_started(pending, group):
                older.cancel()  # the oldest pending handshake of this address (or overall) yields
            try:
                tune_connection(stream)
                # the first byte and the handshake, or a circuit end's token: both under the fair
                # limits on pending handshakes, so silent circuit ends cannot hold the door either
                with trio.fail_after(self.handshake_timeout):
                    if await self.transport.peek_first_byte(stream) == _CIRCUIT_FIRST_BYTE:
                        if not self.presence.relays_circuits:
                            raise ConnectError("a circuit end, but this peer relays nothing")
                        circuit_token = await _circuit_token(stream)
                    else:
                        channel = await self.secure_responder(stream)
            except Exception as error:  # whatever a stranger sends, it costs them the connection only
                await self._refuse(stream, error)
                return
            finally:
                self.admission.handshake_ended(pending)
        if pending.cancelled_caught:
            log.debug("dropped a pending handshake from %s to make room", group)
            await trio.aclose_forcefully(stream)
            return
        if circuit_token is not None:  # one end of a relayed circuit (peer/relay.py)
            await self.presence.accept_circuit_end(stream, circuit_token)
            return
        await self.accept_channel(channel, group)

    async def accept_channel(
        self,
        channel: SecureChannel,
        group: str | None,
        relayed_via: PeerID | None = None,
        *,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Admit and run an authenticated incoming connection (direct, or through ``relayed_via``);
        ``task_status.started()`` once it is pooled (or refused)."""
        connection = Connection(
            channel,
            self.router,
            serve=not self.client_mode,
            traffic=self.traffic,
            relayed_via=relayed_via,
            seen_from=None if relayed_via is not None else self.transport.remote_address(channel.stream),
        )
        older_connections = self.admission.connection_opened(connection, group, connection.remote_peer_id)
        if older_connections is None:
            log.debug("refused a connection from %s: too many from that address", group)
            task_status.started()
            await channel.aclose()
            return
        for older in older_connections:
            older.close()  # the same identity's oldest connection makes room for its newest
        try:
            await self._run_connection(connection, incoming=True, task_status=task_status)
        finally:
            self.admission.connection_closed(connection)

    async def _refuse(self, stream: trio.abc.Stream, error: Exception) -> None:
        reason = "handshake timed out" if isinstance(error, trio.TooSlowError) else str(error)
        # A peer of another run or version is worth telling the user about; scanners and junk
        # are not (a flood of them must not flood the log either).
        level = logging.INFO if isinstance(error, HelloMismatch) else logging.DEBUG
        endpoint = self.transport.remote_endpoint(stream)
        log.log(level, "refused incoming connection from %s: %s", endpoint, reason or repr(error))
        await trio.aclose_forcefully(stream)

    async def _run_connection(
        self, connection: Connection, incoming: bool, *, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        replaced = self._pool.add(connection, trio.current_time())
        if replaced is not None:
            # a direct path (hole punched, or the peer became reachable) took over from the relay;
            # calls already on the relayed connection get a grace period to finish
            self._nursery.start_soon(_close_after, replaced, RELAY_HANDOVER_GRACE)
        for callback in self.on_connection:
            callback(connection, incoming)
        task_status.started()
        try:
            await connection.run()
        finally:
            self._pool.remove(connection, trio.current_time())
            log.debug("connection to %s closed", connection.remote_peer_id)

    async def retire_idle_connections(self) -> None:
        """Every IDLE_CHECK_S, retire the connections idle for longer than the pool allows."""
        while True:
            await trio.sleep(IDLE_CHECK_S)
            for connection in self._pool.idle(trio.current_time()):
                log.debug("retiring the idle connection to %s", connection.remote_peer_id)
                connection.retire()

    # ------------------------------------------------------------------ dialing
    def connection_to(self, peer: PeerID) -> Connection | None:
        return self._pool.get(peer)

    @staticmethod
    def remote_node_id(connection: Connection) -> NodeIDProof:
        """The node-ID proof the remote showed at ``connection``'s handshake, where it was verified
        against this run's difficulty (derived from its nonce once per connection)."""
        return connection.remote_node_id

    @property
    def connected_peers(self) -> list[PeerID]:
        return self._pool.peers

    async def connect(self, address: PeerAddress) -> Connection:
        """A live connection to ``address``, reused from the pool or dialed (then pooled).

        Addresses come from other peers (contact lists, records), so any of them may be wrong or
        hostile: every failure is a ``ConnectError`` for this address alone. Concurrent calls for
        the same endpoint and expected identity share one dial and its outcome; calls that pin
        different identities at one endpoint dial separately, so each gets its own answer.
        """
        return await self._pool.connect(address, self._dial)

    async def _dial(self, address: PeerAddress) -> Connection:
        if address.relay is not None:
            reached = await self.presence.dial_relayed(address)
            if isinstance(reached, Connection):  # the peer dialed us back (``peer/relay_dials.py``)
                return reached
            stream = reached
        else:
            stream = await self.open_stream(address)
        connection = await self.secure_outgoing(stream, address)
        log.debug("connected to %s at %s", connection.remote_peer_id, address)
        return connection

    async def open_stream(self, address: PeerAddress) -> trio.abc.Stream:
        """A plain stream (TCP, unless the host was given another transport) to ``address``'s
        endpoint (ConnectError on failure)."""
        stream = await self.transport.connect(address)
        tune_connection(stream)
        return stream

    async def secure_responder(self, stream: trio.abc.Stream) -> SecureChannel:
        """Run the handshake as responder on ``stream`` with this host's identity, hello, access
        rules and deadline: for accepted connections, relayed circuit ends and punched ones."""
        return await secure_handshake(
            stream, self.identity, self.hello(), initiator=False, timeout=self.handshake_timeout, access=self.access
        )

    async def secure_outgoing(self, stream: trio.abc.Stream, address: PeerAddress) -> Connection:
        """Run the handshake as initiator on ``stream`` (pinning ``address.peer_id``) and start the
        connection in this host (pooled); the stream is closed on failure."""
        try:
            channel = await secure_handshake(
                stream,
                self.identity,
                self.hello(),
                initiator=True,
                expected_peer=address.peer_id,
                timeout=self.handshake_timeout,
                access=self.access,
            )
        except BaseException as error:
            await trio.aclose_forcefully(stream)
            if isinstance(error, trio.TooSlowError):
                raise ConnectError(f"{address}: handshake timed out after {self.handshake_timeout} s") from None
            if isinstance(error, HandshakeError):
                answered_by = error.actual if isinstance(error, PeerIDMismatch) else None
                raise ConnectError(f"{address}: {error}", answered_by=answered_by) from error
            if isinstance(error, (trio.BrokenResourceError, OSError)):
                raise ConnectError(f"{address}: connection lost during the handshake") from None
            raise
        connection = Connection(
            channel,
            self.router,
            serve=not self.client_mode,
            traffic=self.traffic,
            relayed_via=address.relay,
            seen_from=None if address.relay is not None else self.transport.remote_address(channel.stream),
        )
        try:
            self._nursery.start_soon(self._run_connection, connection, False)
        except RuntimeError:  # the host is shutting down; callers running outside it see a clean error
            await channel.aclose()
            raise ConnectError(f"{address}: this peer's host is shutting down") from None
        return connection

    async def call(
        self, address: PeerAddress, method: str, body: Any = None, *, payload: Any = None, timeout: float | None = None
    ) -> Message:
        """Connect (or reuse the pooled connection) and make one unary call."""
        connection = await self.connect(address)
        return await connection.call(method, body, payload=payload, timeout=timeout)


# The first byte of a relayed circuit's end (peer/relay.py); a Noise handshake record starts with
# its 4-byte big-endian length, whose first byte is 0 for anything a handshake could be.
CIRCUIT_MAGIC = 0xFF
_CIRCUIT_FIRST_BYTE = bytes([CIRCUIT_MAGIC])


async def _circuit_token(stream: trio.abc.Stream) -> bytes:
    """The token after a circuit end's first byte (BrokenResourceError if the stream ends first)."""
    head = b""
    while len(head) < 1 + TOKEN_BYTES:
        chunk = await stream.receive_some(1 + TOKEN_BYTES - len(head))
        if not chunk:
            raise trio.BrokenResourceError("the circuit end closed before its token")
        head += chunk
    return head[1:]


async def _close_after(connection: Connection, delay: float) -> None:
    await trio.sleep(delay)
    connection.close()


@asynccontextmanager
async def open_peer_host(
    identity: Identity, *, listen: tuple[str, int] | None = ("127.0.0.1", 0), **options: Any
) -> AsyncIterator[PeerHost]:
    """Run a peer host for the duration of the block. ``listen=None`` accepts no connections."""
    async with trio.open_nursery() as nursery:
        host = PeerHost(identity, nursery, **options)
        nursery.start_soon(host.retire_idle_connections)
        if listen is not None and not host.client_mode:
            await nursery.start(host._serve, listen[0], listen[1])
        try:
            yield host
        finally:
            nursery.cancel_scope.cancel()
