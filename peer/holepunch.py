"""Hole punching: two peers on a relayed connection open a direct TCP connection by simultaneous
open (as libp2p's DCUtR), and the direct connection takes over from the relay.

Over the relayed connection, the peer that dialed (A) and the peer it reached (B, behind NAT):

1. A calls ``nat.punch {addresses}`` with its public address (the observed host from its
   reachability check, at its listen port); B answers with its own. A measures the round trip.
2. A calls ``nat.sync {delay: rtt / 2}``; B answers at once and dials A ``delay`` seconds later,
   A dials B as soon as the answer arrives: both SYNs leave at about the same moment.
3. Both dial from their listen port (the transport's ``connect_from``; over TCP
   ``peer/reuse_port.py``), so a port-preserving NAT sends
   each SYN out from the public port the other side was told, each NAT sees its own peer's SYN
   leave before the other's arrives, and the two dials meet as one TCP connection. B runs the
   Noise handshake as initiator and A as responder (if B's SYN reached A's listener instead, A's
   listener is the responder; if A's reached B's listener, A hears nothing within
   ``RESPONDER_PATIENCE`` and initiates itself).
4. The direct connection replaces the relayed one in both pools (``ConnectionPool.add``).

Up to ``ATTEMPTS`` tries in a round; a round that fails (a SYN lost to a busy machine, a side
that did not yet know its public address) is tried again while the relayed connection lives,
``RETRY_PAUSE`` later and then twice as long each time up to ``MAX_RETRY_PAUSE``. Behind a
port-randomizing NAT the public port differs from the one announced, every round fails, and the
peers stay on the relay. The addresses A names are claims: B
dials at most ``MAX_ADDRESSES`` of them, at most ``ATTEMPTS`` times per peer per minute and twice a
second for all peers together, and only for a peer on a relayed connection.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .address import PeerAddress
from .admission import address_group
from .host import ConnectError, PeerHost
from .identity import PeerID
from .nat_state import TokenBucket
from .router import Request
from .rpc import Connection
from .rpc_errors import BadRequest, Busy, RPCError

__all__ = ["HolePuncher", "PUNCH", "SYNC", "TAKEN", "connect_until", "dialable"]

log = logging.getLogger("peerd.holepunch")

PUNCH, SYNC = "nat.punch", "nat.sync"
ATTEMPTS = 3
ATTEMPT_TIMEOUT = 3.0  # covers the SYN and its first retransmission (1 s later)
CALL_TIMEOUT = 5.0
MAX_ADDRESSES = 2
MAX_PUNCHES = 8  # punches in progress at once (each holds a socket and a task)
MAX_TRACKED = 1024
RETRY_PAUSE = 10.0  # after a failed round; doubles up to MAX_RETRY_PAUSE
MAX_RETRY_PAUSE = 300.0
NOT_READY_PAUSE = 1.0  # how often a round that cannot start yet looks again (no traffic: a timer)
# The responder waits this long for the initiator's first handshake message before starting the
# handshake itself (its SYN met the other side's listener).
RESPONDER_PATIENCE = 1.0
REFUSED_RETRY = 0.05  # the first pause after a NAT refused a dial, doubling (see connect_until)
TAKEN = object()  # connect_until: the connection exists already (the other side's dial got in)


class HolePuncher:
    """Punches for every relayed connection this host dials, answers the other side's punches.
    ``observed_host()`` is our public host as others see it (None while unknown)."""

    def __init__(self, host: PeerHost, observed_host: Callable[[], str | None]):
        self.host = host
        self.observed_host = observed_host
        self.attempts = 0
        self.successes = 0
        self.failures = 0
        self.last_punch_s: float | None = None
        self._in_progress: set[PeerID] = set()
        self._retrying: set[PeerID] = set()
        self._offered: dict[PeerID, list[tuple[str, int]]] = {}
        self._budgets: dict[PeerID, TokenBucket] = {}
        self._direct_arrived: dict[PeerID, trio.Event] = {}
        self._everyone = TokenBucket(2.0, 10.0, trio.current_time())  # dials for any peer, per second
        host.router.add_unary(PUNCH, self._punch)
        host.router.add_unary(SYNC, self._sync)
        host.on_connection.append(self._on_connection)

    def status(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "successes": self.successes,
            "failures": self.failures,
            "last_punch_s": None if self.last_punch_s is None else round(self.last_punch_s, 3),
        }

    @property
    def punching(self) -> int:
        """How many peers a punch (ours or theirs) is in progress with now."""
        return len(self._in_progress)

    def _addresses(self) -> list[str]:
        host = self.observed_host()
        listen = self.host.listen_address
        return [] if host is None or listen is None else [PeerAddress(host, listen.port).endpoint]

    def _direct(self, peer: PeerID) -> bool:
        connection = self.host.connection_to(peer)
        return connection is not None and connection.relayed_via is None

    def _on_connection(self, connection: Connection, incoming: bool) -> None:
        peer = connection.remote_peer_id
        if connection.relayed_via is None and (arrived := self._direct_arrived.get(peer)) is not None:
            arrived.set()
        if connection.relayed_via is None or incoming or self.host.listen_address is None:
            return
        if peer in self._retrying:
            return
        self._retrying.add(peer)
        try:
            self.host.start_soon(self.keep_punching, connection)
        except RuntimeError:  # the host is closing
            self._retrying.discard(peer)

    async def keep_punching(self, relayed: Connection) -> None:
        """Punch rounds for ``relayed`` until one succeeds or the connection ends, the pause
        between failed rounds doubling. A round waits (``NOT_READY_PAUSE`` at a time) while our
        public address is unknown, a punch with this peer is already running, or ``MAX_PUNCHES``
        are. Waiting holds no punch slot, only this task (one per peer we dialed through a
        relay, so bounded by the connection pool)."""
        peer = relayed.remote_peer_id
        pause = RETRY_PAUSE
        try:
            while not (relayed.is_closed or self._direct(peer)):
                ready = bool(self._addresses()) and peer not in self._in_progress
                if ready and len(self._in_progress) < MAX_PUNCHES:
                    if await self.punch(relayed):
                        return
                    if pause == RETRY_PAUSE:
                        log.info("hole punching to %s failed; staying on the relay, trying again later", peer)
                    waited, pause = pause, min(2 * pause, MAX_RETRY_PAUSE)
                else:
                    waited = NOT_READY_PAUSE
                with trio.move_on_after(waited):
                    await relayed.closed.wait()
        finally:
            self._retrying.discard(peer)

    # ------------------------------------------------------------------ the dialer's side (A)
    async def punch(self, relayed: Connection) -> bool:
        """Try to replace ``relayed`` by a direct connection; True when one exists afterwards."""
        peer = relayed.remote_peer_id
        self._in_progress.add(peer)
        started = trio.current_time()
        connected = False
        try:
            for _ in range(ATTEMPTS):
                if self._direct(peer) or relayed.is_closed or not self._addresses():
                    break  # (without our public address the other side has nothing to dial)
                self.attempts += 1
                sent = trio.current_time()
                try:
                    reply = await relayed.call(PUNCH, {"addresses": self._addresses()}, timeout=CALL_TIMEOUT)
                    rtt = trio.current_time() - sent
                    theirs = _parse_addresses(reply.body, self.observed_host())
                    if not theirs:
                        break  # the peer does not know its public address: nothing to dial
                    await relayed.call(SYNC, {"delay": rtt / 2}, timeout=CALL_TIMEOUT)
                except (RPCError, trio.TooSlowError, ValueError) as error:
                    log.debug("punch to %s: %s", peer, error)
                    break
                if await self._dial(peer, theirs, initiator=False):
                    connected = True
                    break
            if connected or self._direct(peer):
                self.successes += 1
                self.last_punch_s = trio.current_time() - started
                log.info("direct connection to %s by hole punching after %.2f s", peer, self.last_punch_s)
                return True
            self.failures += 1
            log.debug("hole punching to %s failed", peer)
            return False
        finally:
            self._in_progress.discard(peer)

    # ------------------------------------------------------------------ the reached peer's side (B)
    def _relayed_caller(self, request: Request) -> Connection:
        connection = request.connection
        if connection is None or connection.relayed_via is None:
            raise BadRequest("hole punching is for relayed connections")
        return connection

    async def _punch(self, request: Request) -> Any:
        self._relayed_caller(request)
        peer = request.peer
        if peer in self._in_progress and self.host.peer_id.to_bytes() < peer.to_bytes():
            raise Busy("already punching to this peer")  # both dialed: the higher ID's punch goes on
        budget = self._budgets.get(peer)
        if budget is None:
            while len(self._budgets) >= MAX_TRACKED:
                del self._budgets[next(iter(self._budgets))]
            budget = self._budgets[peer] = TokenBucket(ATTEMPTS / 60, ATTEMPTS, trio.current_time())
        if budget.available(trio.current_time()) < 1:
            raise Busy("too many hole punching attempts")
        if self._everyone.available(trio.current_time()) < 1:
            raise Busy("too many hole punching attempts from all peers")
        budget.take(1, trio.current_time())
        self._everyone.take(1, trio.current_time())
        theirs = _parse_addresses(request.body, self.observed_host())
        while len(self._offered) >= MAX_TRACKED:
            del self._offered[next(iter(self._offered))]
        self._offered[peer] = theirs
        return {"addresses": self._addresses()}

    async def _sync(self, request: Request) -> Any:
        self._relayed_caller(request)
        theirs = self._offered.pop(request.peer, None)
        delay = request.body.get("delay") if isinstance(request.body, dict) else None
        if theirs is None or not isinstance(delay, (int, float)) or not 0 <= delay <= 2:
            raise BadRequest("sync without a punch, or a delay outside 0..2 s")
        if len(self._in_progress) >= MAX_PUNCHES:
            raise Busy("too many punches in progress")
        if theirs:
            self._in_progress.add(request.peer)
            self.host.start_soon(self._dial_later, request.peer, theirs, float(delay))
        return None

    async def _dial_later(self, peer: PeerID, addresses: list[tuple[str, int]], delay: float) -> None:
        try:
            await trio.sleep(delay)
            await self._dial(peer, addresses, initiator=True)
        finally:
            self._in_progress.discard(peer)

    # ------------------------------------------------------------------ both
    async def _dial(self, peer: PeerID, addresses: list[tuple[str, int]], *, initiator: bool) -> bool:
        listen = self.host.listen_address
        if listen is None:
            return False
        local = ("0.0.0.0" if listen.host in ("", "::") else listen.host, listen.port)
        transport = self.host.transport
        for host, port in addresses:
            deadline = trio.current_time() + ATTEMPT_TIMEOUT
            stream = await connect_until(transport.connect_from, local, (host, port), deadline)
            if stream is TAKEN:
                # the other side's SYN reached our listener first, which is running the handshake
                # now: wait for that connection rather than call the attempt failed
                arrived = self._direct_arrived.setdefault(peer, trio.Event())
                with trio.move_on_after(self.host.handshake_timeout):
                    await arrived.wait()
                if self._direct_arrived.get(peer) is arrived:
                    del self._direct_arrived[peer]
                return self._direct(peer)
            if stream is None:
                continue
            address = PeerAddress(host, port, peer)
            if not initiator:
                # Our SYN may have reached the other side's listener rather than its dial (no NAT
                # in front of it, or its dial came late): a listener answers as responder, so if
                # no handshake message comes soon we are the one to start it.
                try:
                    with trio.move_on_after(RESPONDER_PATIENCE) as patience:
                        await transport.peek_first_byte(stream)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
                    log.debug("punched connection to %s: %r", address, error)  # (reset: the address is a claim)
                    await trio.aclose_forcefully(stream)
                    continue
                initiator = patience.cancelled_caught
            if initiator:
                try:
                    await self.host.secure_outgoing(stream, address)
                except ConnectError as error:
                    log.debug("punched connection to %s: %s", address, error)
                    continue
                return True
            try:
                channel = await self.host.secure_responder(stream)
            except Exception as error:
                log.debug("punched connection from %s: %r", address, error)
                await trio.aclose_forcefully(stream)
                continue
            if channel.remote_peer_id != peer:
                await channel.aclose()
                continue
            await self.host.start(functools.partial(self.host.accept_channel, channel, address_group(host)))
            return self._direct(peer)
        return False


async def connect_until(
    dial: Callable[[tuple[str, int], tuple[str, int], float], Awaitable[trio.abc.Stream]],
    local: tuple[str, int],
    remote: tuple[str, int],
    deadline: float,
) -> Any:
    """Dial ``remote`` from ``local`` with ``dial`` (a transport's ``connect_from``) until
    ``deadline``: a stream, None, or TAKEN when a connection
    between the two already exists (the other side's SYN reached our listener). A refusal is tried
    again: a NAT answers a SYN that arrives before its own peer's SYN has opened the mapping with a
    reset, and the other side's SYN opens it a moment later. The pauses double (about 6 dials in
    an attempt), since the address may name a third party."""
    pause = REFUSED_RETRY
    while True:
        try:
            return await dial(local, remote, max(0.0, deadline - trio.current_time()))
        except ConnectionRefusedError:
            if trio.current_time() + pause >= deadline:
                return None
            await trio.sleep(pause)
            pause *= 2  # the addresses are claims: a third party that refuses gets a few SYNs only
        except OSError as error:
            if error.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                return TAKEN
            log.debug("punch dial to %s:%d: %r", *remote, error)
            return None
        except (trio.TooSlowError, ValueError) as error:  # ValueError: a host the resolver cannot encode
            log.debug("punch dial to %s:%d: %r", *remote, error)
            return None


def _parse_addresses(body: Any, ours: str | None) -> list[tuple[str, int]]:
    """At most MAX_ADDRESSES ``IP:PORT`` endpoints from a punch message (others are ignored). Only
    IP literals: a peer's public address is what others observed, never a name, and a name would
    have us resolve (or fail to encode) whatever a remote wrote. Never one that dials our own
    machine (unspecified, or loopback unless our own public host ``ours`` is: peers on one host),
    nor a multicast one: the addresses are claims, and would aim us at our local services."""
    listed = body.get("addresses") if isinstance(body, dict) else None
    if not isinstance(listed, list):
        raise ValueError("expected {addresses: [HOST:PORT, ...]}")
    found = []
    for text in listed[:MAX_ADDRESSES]:
        if isinstance(text, str) and len(text) < 100:
            try:
                address = PeerAddress.parse(text)
            except ValueError:
                continue
            if address.relay is None and dialable(address.host, ours):
                found.append((address.host, address.port))
    return found


def dialable(host: str, ours: str | None) -> bool:
    """Whether a host that another peer named may be dialed: an IP literal (never a name, which
    we would resolve or fail to encode), not unspecified, multicast or link-local (a cloud's
    metadata service); loopback only when ``ours`` (our own public or listen host) is (peers on
    one machine), and a private or otherwise non-global address only when ours is one too (a
    swarm on one LAN): a public peer is never aimed into its own network."""
    ip = _ip(host)
    if ip is None or ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return False
    own = _ip(ours) if ours is not None else None
    if ip.is_loopback:
        return own is not None and own.is_loopback
    return ip.is_global or (own is not None and not own.is_unspecified and not own.is_global)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
