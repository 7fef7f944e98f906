"""Circuit relays: a public peer forwards the bytes of a connection between two peers, one of which
cannot be reached directly (behind NAT). The relay sees only ciphertext.

The protocol, with R the relay, B the peer behind NAT and A the peer that wants to reach it:

1. B keeps an RPC connection to R and reserves a slot (``relay.reserve``, renewed before the
   reservation's TTL runs out). B announces ``R_HOST:R_PORT/R_ID/relay`` as its address.
2. A calls ``relay.connect {target: B}`` on R. R checks the reservation and its limits
   (``peer/nat_state.py``), makes one random token per end and tells B ``relay.incoming {source:
   A, token}`` over B's reservation connection; A gets its own token in the reply.
3. A and B each open a fresh TCP connection to R's listen port and send ``0xFF`` + their token
   (the host tells such a stream from a Noise handshake by its first byte). R pairs the two by
   their tokens and from then on copies bytes both ways, within the circuit's rate and lifetime.
4. Over the joined stream A and B run the ordinary Noise handshake (A initiates, pinning B's ID;
   B checks that the peer is the ``source`` R named) and the ordinary RPC connection: end-to-end
   authenticated and encrypted, so R can neither read nor alter the traffic unnoticed.

The ends are real TCP sockets, so the secure channel's direct-I/O path runs on both peers; the
relay's copying costs one receive and one send per chunk. ``Relay`` is the relay's side,
``RelayClient`` the NAT'd peer's side (reservations and incoming circuits), ``dial_through_relay``
the dialer's.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from .address import PeerAddress
from .admission import address_group
from .holepunch import dialable
from .host import CIRCUIT_MAGIC, ConnectError, PeerHost
from .identity import PeerID
from .nat_state import TOKEN_BYTES, Circuit, RelayBook, RelayLimits, RelayRefused, TokenBucket
from .relay_dials import CALL_TIMEOUT, CONNECT, RelayedDials, dial_through_relay
from .router import Request
from .rpc import Connection
from .rpc_errors import BadRequest, Busy, RPCError

__all__ = ["Relay", "RelayClient", "RelayLimits", "dial_through_relay", "RESERVE", "CONNECT", "INCOMING"]

log = logging.getLogger("peerd.relay")

RESERVE, INCOMING = "relay.reserve", "relay.incoming"
MAX_WAITING_ENDS = 256  # circuit ends waiting for their partner
CHUNK = 256 * 1024
MAX_PENDING_INCOMING = 32  # circuits and dials back a relayed peer is still setting up at once
MAX_PENDING_PER_SOURCE = 4  # of those, from one source
MAX_PENDING_PER_RELAY = 16  # of those, through one relay (it names the sources): a group's worth
# Dials back (connection reversal) relays may have us make: two groups' worth at once from one relay
# (a whole averaging group dials a new member together, and a NAT'd leader is dialed by every peer
# that would join it: with half of this, 128 simulated peers left some NAT'd leaders unjoined round
# after round), then two a second, and four a second for all relays together, so a hostile relay
# cannot aim us at an address again and again.
DIALS_BACK_PER_RELAY_PER_S, DIALS_BACK_PER_RELAY_BURST = 2.0, 32.0
DIALS_BACK_PER_S, DIALS_BACK_BURST = 4.0, 64.0
MAX_DIAL_BACK_RELAYS = 64  # (we hold a few reservations; a relay we forgot starts a fresh budget)
# Reversals a relay passes on: per requester's address (identities cost nothing to make, hosts do),
# and per target, below what the target takes from one relay, so that an honest relay is never
# refused by its target (others asking too much are refused by the relay, and their dialers get
# circuits instead).
REVERSALS_PER_REQUESTER_PER_S, REVERSALS_PER_REQUESTER_BURST = 1.0, 16.0
REVERSALS_PER_TARGET_PER_S, REVERSALS_PER_TARGET_BURST = 1.5, 24.0
MAX_REVERSAL_BUDGETS = 1024
RESERVE_RETRY = 5.0  # seconds between looks for a relay while short of reservations
# Renew a reservation after this share of its lifetime (20 s of the default 120): the renewal is
# also how a relay that went silent (a machine switched off sends no FIN) is noticed and replaced,
# and until then every peer that reads our declarations dials a dead relay.
RENEW_AFTER = 1 / 6


class Relay:
    """The relay a public peer runs for others: its host hands it every circuit end that arrives
    (``host.presence.serve_circuits``)."""

    def __init__(self, host: PeerHost, limits: RelayLimits | None = None):
        self.host = host
        self.book: RelayBook[PeerID] = RelayBook(limits)
        self.bytes_relayed = 0
        self._accepting = True
        self._waiting_ends = 0
        # the connection each reservation was made (or last renewed) on: its reservation goes
        # when it closes, since circuits reach the target over it
        self._reserved_on: dict[PeerID, Connection] = {}
        self._watched: set[Connection] = set()  # the connections a _drop_when_closed task watches
        limits = self.book.limits
        self._all_circuits = TokenBucket(limits.total_bytes_per_s, limits.total_burst_bytes, trio.current_time())
        self._reversal_budgets: dict[tuple[str, Any], TokenBucket] = {}  # per requester host and per target
        host.router.add_unary(RESERVE, self._reserve)
        host.router.add_unary(CONNECT, self._connect)
        host.presence.serve_circuits(self)

    @property
    def accepting(self) -> bool:
        """Whether this relay takes reservations (see ``accept_reservations``)."""
        return self._accepting

    def accept_reservations(self, accepting: bool) -> None:
        """Take reservations or not: a peer that cannot be reached itself is no use as a relay
        (``NatTraversal`` keeps this to "our reachability is not nat"). Not accepting also forgets
        the reservations taken so far; their holders move on when they renew."""
        self._accepting = accepting
        if not accepting:
            self.book.drop_reservations()

    @property
    def waiting_ends(self) -> int:
        """Circuit ends that arrived and wait for their partner (at most ``MAX_WAITING_ENDS``)."""
        return self._waiting_ends

    async def _reserve(self, request: Request) -> Any:
        connection = request.connection
        if connection is None or connection.relayed_via is not None:
            raise BadRequest("reserve over a direct connection to the relay")
        if not self._accepting:
            raise Busy("this peer cannot be reached itself, so it relays for nobody")
        try:
            self.book.reserve(request.peer, trio.current_time(), group=_address_group_of(connection))
        except RelayRefused as error:
            raise Busy(str(error)) from None
        self._reserved_on[request.peer] = connection
        if connection not in self._watched:  # one task per connection, however often a peer
            self._watched.add(connection)  # moves its reservation between its connections
            self.host.start_soon(self._drop_when_closed, request.peer, connection)
        return {"ttl": self.book.limits.reservation_ttl}

    async def _drop_when_closed(self, peer: PeerID, connection: Connection) -> None:
        """A reservation lives as long as the connection it was made on: a peer that went away
        (or restarted under a new identity, as a NAT'd host does) does not hold its slot, and its
        address group's share, until the reservation's TTL runs out."""
        try:
            await connection.closed.wait()
        finally:
            self._watched.discard(connection)
        if self._reserved_on.get(peer) is connection:
            del self._reserved_on[peer]
            self.book.drop_reservation(peer)

    async def _connect(self, request: Request) -> Any:
        body = request.body
        if not isinstance(body, dict) or not isinstance(body.get("target"), bytes):
            raise BadRequest("expected {target: peer ID bytes}")
        target = PeerID(body["target"])
        # the connection its reservation was made on (which may not be the one our pool hands out)
        connection = self._reserved_on.get(target)
        if connection is None or not connection.takes_calls:
            connection = self.host.connection_to(target)
        if connection is None or connection.relayed_via is not None:
            raise Busy("the target is not connected to this relay")
        if body.get("reverse") is True and (back := _listen_address_of(request.connection)) is not None:
            self._take_reversal(_address_group_of(request.connection), target)
            try:  # connection reversal: the target dials the source; no circuit, no relayed bytes
                await connection.call(
                    INCOMING, {"source": request.peer.to_bytes(), "dial": back.endpoint}, timeout=CALL_TIMEOUT
                )
            except (RPCError, trio.TooSlowError) as error:
                raise Busy(f"the target will not dial back: {error}") from None
            return {"reversed": True}
        source_group = _address_group_of(request.connection)
        try:
            circuit = self.book.open_circuit(request.peer, target, trio.current_time(), source_group)
        except RelayRefused as error:
            raise Busy(str(error)) from None
        circuit.waiter = trio.Event()
        try:
            await connection.call(
                INCOMING, {"source": request.peer.to_bytes(), "token": circuit.tokens[1]}, timeout=CALL_TIMEOUT
            )
        except (RPCError, trio.TooSlowError) as error:
            self._forget(circuit)
            raise Busy(f"the target did not take the circuit: {error}") from None
        return {"token": circuit.tokens[0]}

    def _take_reversal(self, requester_group: str | None, target: PeerID) -> None:
        """One reversal from the requester's host's budget and from the target's, or Busy."""
        now = trio.current_time()
        budgets = []
        for key, rate, burst in (
            (("requester", requester_group), REVERSALS_PER_REQUESTER_PER_S, REVERSALS_PER_REQUESTER_BURST),
            (("target", target), REVERSALS_PER_TARGET_PER_S, REVERSALS_PER_TARGET_BURST),
        ):
            budget = self._reversal_budgets.get(key)
            if budget is None:
                while len(self._reversal_budgets) >= MAX_REVERSAL_BUDGETS:
                    del self._reversal_budgets[next(iter(self._reversal_budgets))]
                budget = self._reversal_budgets[key] = TokenBucket(rate, burst, now)
            if budget.available(now) < 1:
                raise Busy("too many reversals asked")
            budgets.append(budget)
        for budget in budgets:
            budget.take(1, now)

    def _forget(self, circuit: Circuit[PeerID]) -> None:
        self.book.close_circuit(circuit)
        circuit.waiter.set()  # a waiting end sees the circuit is not active and closes

    async def accept_circuit_end(self, stream: trio.SocketStream, token: bytes) -> None:
        """An incoming stream that opened with the circuit byte and ``token`` (read by the host
        under its limits on pending handshakes): pair it, or drop it."""
        if self._waiting_ends >= MAX_WAITING_ENDS:
            await trio.aclose_forcefully(stream)
            return
        self._waiting_ends += 1
        try:
            circuit = self.book.arrive(token, stream, trio.current_time())
            if circuit is None:
                await trio.aclose_forcefully(stream)
                return
            if not circuit.active:
                with trio.move_on_at(circuit.expires):
                    await circuit.waiter.wait()
                if not circuit.active:
                    self._forget(circuit)
                    await trio.aclose_forcefully(stream)
                # else: the partner's task carries the circuit
                return
        finally:
            self._waiting_ends -= 1
        circuit.waiter.set()
        await self._splice(circuit)

    async def _splice(self, circuit: Circuit[PeerID]) -> None:
        first, second = circuit.arrived
        limits = self.book.limits
        bucket = TokenBucket(limits.circuit_bytes_per_s, limits.circuit_burst_bytes, trio.current_time())
        log.debug("relaying %s -> %s", circuit.source, circuit.target)
        try:
            with trio.move_on_at(circuit.expires):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, first, second, bucket, nursery.cancel_scope)
                    nursery.start_soon(self._pump, second, first, bucket, nursery.cancel_scope)
        finally:
            self.book.close_circuit(circuit)
            for stream in (first, second):
                await trio.aclose_forcefully(stream)

    async def _pump(self, source: Any, sink: Any, bucket: TokenBucket, scope: trio.CancelScope) -> None:
        try:
            while data := await source.receive_some(CHUNK):
                now = trio.current_time()
                wait = max(bucket.take(len(data), now), self._all_circuits.take(len(data), now))
                if wait > 0:
                    await trio.sleep(wait)  # the circuit's byte rate and the relay's total
                await sink.send_all(data)
                self.bytes_relayed += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            scope.cancel()  # one direction ended: the circuit is over


class RelayClient:
    """Reservations with up to ``wanted`` relays, for a peer that cannot be reached directly, and
    the circuits they bring. ``run`` keeps the reservations and the host's announced addresses
    (``host.presence``) up to date; the host dials relayed addresses with ``dial_through_relay``."""

    def __init__(
        self,
        host: PeerHost,
        *,
        wanted: int = 2,
        reachable: Callable[[], bool] = lambda: False,
        observed_host: Callable[[], str | None] = lambda: None,
    ):
        """``reachable()``: whether others can dial us directly now (our relayed dials then ask
        for connection reversal first: ``peer/relay_dials.py``); ``observed_host()``: our host
        as others see it (None while unknown), which decides the addresses we dial back."""
        self.host = host
        self.wanted = wanted
        self.observed_host = observed_host
        self.reserved: dict[PeerID, PeerAddress] = {}
        # circuits and dials back in setup, per source and per relay (which names the source)
        self._pending_incoming: Counter[PeerID] = Counter()
        self._pending_by_relay: Counter[PeerID] = Counter()
        # dials back that relays ask of us: per relay, and for all together
        self._dial_back_budgets: dict[PeerID, TokenBucket] = {}
        self._all_dials_back = TokenBucket(DIALS_BACK_PER_S, DIALS_BACK_BURST, trio.current_time())
        self.changed = trio.Event()
        host.router.add_unary(INCOMING, self._incoming)
        self.dials = RelayedDials(host, reachable)

    @property
    def setting_up(self) -> int:
        """Circuits being answered and dials back being made now."""
        return self._pending_incoming.total()

    async def _incoming(self, request: Request) -> Any:
        """A relay we hold a reservation with names a peer that wants us: a circuit (``token``) to
        answer through the relay, or (``dial``) the address to dial that peer back at."""
        relay = self.reserved.get(request.peer)
        if relay is None:
            raise BadRequest("no reservation with this peer")
        body = request.body
        if not isinstance(body, dict) or not isinstance(body.get("source"), bytes):
            raise BadRequest("expected {source, token} or {source, dial}")
        source = PeerID(body["source"])
        if "dial" not in body:
            token = body.get("token")
            if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
                raise BadRequest("malformed circuit token")
        if self._pending_incoming.total() >= MAX_PENDING_INCOMING:
            raise Busy("too many circuits being set up")
        if self._pending_incoming[source] >= MAX_PENDING_PER_SOURCE:
            raise Busy("too many circuits from this source being set up")
        if self._pending_by_relay[request.peer] >= MAX_PENDING_PER_RELAY:
            raise Busy("too many circuits through this relay being set up")
        if "dial" in body:
            address = self._dial_back_address(request.peer, source, body["dial"])
            task: Any = functools.partial(self._dial_back, request.peer, address)
        else:
            task = functools.partial(self._answer, relay, source, token)
        self._pending_incoming[source] += 1
        self._pending_by_relay[request.peer] += 1
        try:
            self.host.start_soon(task)
        except BaseException:
            self._settled(request.peer, source)
            raise
        return {"ok": True}

    def _dial_back_address(self, relay: PeerID, source: PeerID, text: Any) -> PeerAddress:
        """Where ``relay`` says ``source`` listens, if we will dial it: an IP literal we may dial
        from where we are (``holepunch.dialable``: a public peer is never aimed at private or
        link-local addresses), within the dial-back budgets. The relay names both the address
        and the source, so both are claims: the dial pins ``source``'s ID, and the budgets, per
        relay and in all, bound how often relays can aim us anywhere."""
        try:
            address = PeerAddress.parse(text) if isinstance(text, str) and len(text) < 100 else None
        except ValueError:
            address = None
        listen = self.host.listen_address
        # (our bound host when it is one; else the host others report seeing, which a liar among
        # them could skew: the budgets bound what that buys)
        concrete = listen is not None and listen.host not in ("0.0.0.0", "::", "")
        ours = listen.host if concrete else self.observed_host()
        if address is None or address.relay is not None or not dialable(address.host, ours):
            raise BadRequest("expected {source, dial: IP:PORT} at an address this peer dials")
        now = trio.current_time()
        budget = self._dial_back_budgets.get(relay)
        if budget is None:
            while len(self._dial_back_budgets) >= MAX_DIAL_BACK_RELAYS:
                del self._dial_back_budgets[next(iter(self._dial_back_budgets))]
            budget = TokenBucket(DIALS_BACK_PER_RELAY_PER_S, DIALS_BACK_PER_RELAY_BURST, now)
            self._dial_back_budgets[relay] = budget
        if budget.available(now) < 1 or self._all_dials_back.available(now) < 1:
            raise Busy("too many dials back")
        budget.take(1, now)
        self._all_dials_back.take(1, now)
        return PeerAddress(address.host, address.port, source)

    async def _dial_back(self, relay_id: PeerID, address: PeerAddress) -> None:
        """Connection reversal: dial the peer that asked for us through our relay."""
        assert address.peer_id is not None
        try:
            await self.host.connect(address)
        except ConnectError as error:
            log.debug("dialing %s back: %s", address, error)
        finally:
            self._settled(relay_id, address.peer_id)

    async def _answer(self, relay: PeerAddress, source: PeerID, token: bytes) -> None:
        host = self.host
        try:
            try:
                stream = await host.open_stream(relay)
            except ConnectError as error:
                log.debug("circuit from %s via %s: %s", source, relay, error)
                return
            try:
                await stream.send_all(bytes([CIRCUIT_MAGIC]) + token)
                channel = await host.secure_responder(stream)
            except Exception as error:
                log.debug("circuit from %s via %s failed: %r", source, relay, error)
                await trio.aclose_forcefully(stream)
                return
            if channel.remote_peer_id != source:
                log.info("relay %s named %s but %s came through; closed", relay.peer_id, source, channel.remote_peer_id)
                await channel.aclose()
                return
        finally:
            self._settled(relay.peer_id, source)
        await host.accept_channel(channel, f"relay:{relay.peer_id}", relayed_via=relay.peer_id)

    def _settled(self, relay_id: PeerID, source: PeerID) -> None:
        for pending, key in ((self._pending_incoming, source), (self._pending_by_relay, relay_id)):
            pending[key] -= 1
            if pending[key] <= 0:
                del pending[key]

    async def reserve(self, relay: PeerAddress) -> tuple[PeerID, float]:
        """Reserve (or renew) with ``relay``; returns the relay's ID and the reservation's TTL.
        Raises ConnectError (also for a relay reached through a relay, or a malformed answer),
        RPCError or trio.TooSlowError."""
        connection = await self.host.connect(relay)
        if connection.relayed_via is not None:
            raise ConnectError(f"{relay}: a relay must be reached directly")
        reply = await connection.call(RESERVE, None, timeout=CALL_TIMEOUT)
        ttl = reply.body.get("ttl") if isinstance(reply.body, dict) else None
        if type(ttl) not in (int, float) or not 1 <= ttl <= 86400:
            raise ConnectError(f"{relay}: the relay sent a malformed reservation")
        relay_id = connection.remote_peer_id
        self.reserved[relay_id] = relay.with_peer_id(relay_id)
        return relay_id, float(ttl)

    def _relayed_addresses(self) -> list[PeerAddress]:
        """Our address at each relay we hold a reservation with (our peer ID filled in by the host)."""
        return [PeerAddress(a.host, a.port, None, a.peer_id) for a in self.reserved.values()]

    async def run(self, candidates: Callable[[], list[PeerAddress]], *, retry: float | None = None) -> None:
        """Keep ``wanted`` reservations among ``candidates()`` (public peers, tried in order);
        a relay whose connection closes or that refuses is replaced at the next pass."""
        retry = RESERVE_RETRY if retry is None else retry
        renew_at: dict[PeerID, float] = {}
        while True:
            now = trio.current_time()
            for relay_id, address in list(self.reserved.items()):
                if self.host.connection_to(relay_id) is None or renew_at.get(relay_id, 0) <= now:
                    try:
                        _, ttl = await self.reserve(address)
                        renew_at[relay_id] = trio.current_time() + ttl * RENEW_AFTER
                    except (ConnectError, RPCError, trio.TooSlowError) as error:
                        log.info("lost the reservation with relay %s: %s", relay_id, error)
                        del self.reserved[relay_id]
                        renew_at.pop(relay_id, None)
            if self.reserved:  # (a lost relay leaves our addresses before we look for another)
                self._announce()
            for candidate in candidates():
                if len(self.reserved) >= self.wanted:
                    break
                if candidate.peer_id in self.reserved or candidate.peer_id == self.host.peer_id:
                    continue
                try:
                    relay_id, ttl = await self.reserve(candidate)
                except (ConnectError, RPCError, trio.TooSlowError) as error:
                    log.debug("relay candidate %s: %s", candidate, error)
                    continue
                renew_at[relay_id] = trio.current_time() + ttl * RENEW_AFTER
                log.info("reserved a relayed address with %s", self.reserved[relay_id])
            self._announce()
            now = trio.current_time()
            wait = min([60.0, *(at - now for at in renew_at.values())])
            if len(self.reserved) < self.wanted:
                wait = min(wait, retry)
            with trio.move_on_after(max(0.5, wait)):
                await self._any_relay_lost()

    def _announce(self) -> None:
        """Announce our relayed addresses, if they changed (and tell ``changed``'s waiters)."""
        relayed = self._relayed_addresses()
        if [str(a) for a in self.host.presence.announced] != [str(a) for a in relayed]:
            self.host.presence.announce(relayed)
            self.changed.set()
            self.changed = trio.Event()

    async def _any_relay_lost(self) -> None:
        async with trio.open_nursery() as nursery:
            for relay_id in list(self.reserved):
                connection = self.host.connection_to(relay_id)
                if connection is None:
                    return
                nursery.start_soon(_wait_then_cancel, connection.closed, nursery.cancel_scope)
            if not self.reserved:
                await trio.sleep_forever()


def _address_group_of(connection: Any) -> str | None:
    """The per-address limit group of a direct connection's remote end (a relayed one, or one
    whose address the transport could not tell, counts as its own unknown address)."""
    if connection is None or connection.relayed_via is not None or connection.seen_from is None:
        return "unknown"
    return address_group(connection.seen_from[0])


def _listen_address_of(connection: Any) -> PeerAddress | None:
    """Where the peer of a direct connection listens, at the host we see it from (None: relayed,
    or it announced no listen address)."""
    if connection is None or connection.relayed_via is not None or connection.seen_from is None:
        return None
    address = connection.remote_listen_address
    if address is None or address.relay is not None:
        return None
    return PeerAddress(connection.seen_from[0], address.port)


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
