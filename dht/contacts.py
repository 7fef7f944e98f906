"""Whom a DHT node knows and how they have answered: the routing table, each peer's health, and the
requests the node sends them.

Kademlia updates a k-bucket on every message to or from a peer (Maymounkov & Mazieres, section 2.2),
so the object that sends requests also records how they went: an answer (a refusal is an answer too)
re-adds the peer, silence counts a failure, and enough failures evict it (``PeerHealth``). A full
bucket's least-recently-seen contact is pinged before a newcomer may take its place.

Health is kept per *claim* (a peer ID at an address), not per peer: contacts come from other peers,
and a liar naming an honest peer at a dead address must cost only that claim, never the honest
peer's standing or its entry in the table (which is evicted only when the address it holds fails).

A peer enters the table at the node ID its handshake proved (``PeerHost.remote_node_id``): the proof
on the live connection wins over the one a third party named, and a contact whose proof falls short
of the run's difficulty never enters at all.

A peer that can be reached only through a relay (behind NAT: it announces relayed addresses) is a
client of the DHT, as libp2p's Kademlia runs peers that are not publicly reachable: it asks, it is
never asked, and it leaves the table once it announces a relayed address. Every request to it
would cost a circuit at a relay (a peer behind NAT itself) and then a hole punch, for one small
message: in the simulated swarm with 30% of the peers behind NAT, nine in ten relayed dials were
DHT requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from peer import ConnectError, Connection, Message, NodeIDProof, PeerAddress, PeerHost, PeerID, RemoteError, RPCError
from peer.admission import address_group

from . import wire
from .background import Background
from .liveness import PeerHealth, UnansweredEndpoints
from .reconnect import LostContacts
from .routing import Contact, RoutingTable

__all__ = ["Contacts"]

log = logging.getLogger("peerd.dht")

# A dial is a few round trips (TCP, the Noise handshake, the hellos; a relay adds its circuit):
# twice a request's deadline lets a relayed peer on another continent in, while an endpoint that
# accepts and then says nothing (a tarpit, a server of another protocol waiting for its own
# request) counts as not answering instead of holding the lookup to its own deadline.
DIAL_RPCS = 2


class Contacts:
    def __init__(
        self,
        host: PeerHost,
        table: RoutingTable,
        background: Background,
        *,
        rpc_timeout: float,
        health: PeerHealth | None = None,
    ):
        self.host = host
        self.table = table
        self.health = health if health is not None else PeerHealth()
        self._background = background
        self._rpc_timeout = rpc_timeout
        self._pinging: set[bytes] = set()
        # Claims with requests in flight (see ``_InFlight``): a request that fails after another
        # outcome of its claim was recorded overlapped it (one stall caught several requests), so it
        # counts no second strike.
        self._asking: dict[tuple[PeerID, str, int], _InFlight] = {}
        # Endpoints that did not answer as the peer named there, and the direct dials in flight
        # (one per endpoint: see ``_dial``).
        self.endpoints = UnansweredEndpoints(clock=self.health.clock)
        self._dialing: dict[tuple[str, int], trio.Event] = {}
        # Contacts evicted for silence, pinged again until they answer (``reconnect.py``).
        self.lost: LostContacts[Contact] = LostContacts()
        self._evicted = trio.Event()  # set at the next eviction (``next_eviction``)
        self.difficulty: int = host.node_id_difficulty  # the run's: every contact is checked against it

    # ------------------------------------------------------------------ what we learn
    def alive(self, contact: Contact) -> None:
        """An authenticated exchange with ``contact`` succeeded: (re)add it to the routing table."""
        self._judged(_claim(contact))
        self.health.succeeded(_claim(contact))
        self.lost.found(contact.peer_id)
        connection = self.host.connection_to(contact.peer_id)
        if connection is not None:
            # Prefer the address and proof the peer itself showed in the authenticated hello over
            # those a third party told us; a client-mode peer announces no address and never
            # enters the table.
            announced = connection.remote_listen_address
            if announced is None:
                return
            if announced.relay is not None:  # behind NAT: a client of the DHT from now on
                self._drop_client(contact.peer_id)
                return
            proof = self.host.remote_node_id(connection)
            moved = announced is not contact.address and announced != contact.address
            if moved or proof.nonce != contact.proof.nonce:
                contact = wire.contact_for(proof, announced)
                self.health.succeeded(_claim(contact))
        if contact.peer_id == self.host.peer_id or not contact.proof.satisfies(self.difficulty):
            return
        if contact.address.relay is not None:
            return
        head = self.table.add_contact(contact)
        if head is not None and head.id not in self._pinging and self._background.running:
            self._pinging.add(head.id)
            self._background.start_soon(self._ping_head, head)

    def _drop_client(self, peer: PeerID) -> None:
        """``peer`` announced a relayed address (it is behind NAT): out of the table, unasked."""
        held = self.table.get(peer)
        if held is not None:
            self.table.remove_contact(held)

    def called_by(self, peer: PeerID, address: PeerAddress | None, node_id: NodeIDProof) -> None:
        """``peer`` just called us over an authenticated connection, announcing ``address`` (None:
        a client, which stays out of the table); its place is ``node_id``, the proof from that
        connection's handshake."""
        if address is not None:
            self.alive(wire.contact_for(node_id, address))

    def _judged(self, claim: tuple[PeerID, str, int]) -> None:
        asking = self._asking.get(claim)
        if asking is not None:
            asking.outcomes += 1

    def failed(self, contact: Contact) -> None:
        self._judged(_claim(contact))
        if self.health.failed(_claim(contact)):
            held = self.table.get(contact.peer_id)
            if held is not None and held.address == contact.address:
                self.table.remove_contact(held)
                # one host: an IPv4 address or an IPv6 /64 (a machine's own); loopback, none
                host = address_group(held.address.host)
                self.lost.lost(held.peer_id, held, self.health.clock(), host=host)
                self._evicted.set()

    def next_eviction(self) -> trio.Event:
        """An event set when a contact is next evicted for silence (from now on)."""
        self._evicted = trio.Event()
        return self._evicted

    async def _ping_head(self, head: Contact) -> None:
        """A full bucket's least-recently-seen contact: keep it if it answers (the paper prefers old
        contacts, which are likelier to stay), otherwise count a failure."""
        try:
            await self.call(head, "dht.ping", None)
        finally:
            self._pinging.discard(head.id)

    # ------------------------------------------------------------------ whom to ask
    def excluded(self) -> Callable[[Contact], bool] | None:
        """Contacts to route around: those in failure backoff (None when there are none)."""
        if not self.health:
            return None
        backing_off = self.health.backing_off
        return lambda contact: backing_off(_claim(contact))

    def nearest(self, target: int, k: int, *, excluding: PeerID | None = None) -> list[Contact]:
        """The k known contacts nearest to ``target``, skipping those in backoff and the peer
        ``excluding`` (a caller never needs to be told about itself)."""
        excluded = self.excluded()
        position = Contact.for_id(target)
        if excluding is None:
            return self.table.find_neighbors(position, k, exclude=excluded)
        # The caller sits in the table at most once (usually): take one more and drop it from those,
        # instead of comparing its peer ID with every contact in the table.
        nearest = self.table.find_neighbors(position, k + 1, exclude=excluded)
        raw = excluding.to_bytes()  # bytes compare in C, not PeerID.__eq__ per contact
        kept = [contact for contact in nearest if contact.peer_id.to_bytes() != raw]
        if len(kept) >= k or len(nearest) <= k:
            return kept[:k]
        if excluded is None:
            return self.table.find_neighbors(position, k, exclude=lambda c: c.peer_id == excluding)
        return self.table.find_neighbors(position, k, exclude=lambda c: c.peer_id == excluding or excluded(c))

    def parse(self, body: Any) -> list[Contact]:
        """The contacts a find reply names whose proofs meet the run's difficulty, minus those in
        backoff (``RecordError`` if the reply is malformed as a whole)."""
        return self.routable(wire.parse_contacts(body, self.difficulty))

    def routable(self, contacts: list[Contact]) -> list[Contact]:
        """``contacts`` (named by another peer) without those we are backing off from."""
        if not self.health:
            return contacts
        backing_off = self.health.backing_off
        return [contact for contact in contacts if not backing_off(_claim(contact))]

    def touch(self, target: int) -> None:
        """A lookup toward ``target`` starts: its bucket counts as refreshed."""
        self.table.touch(target)

    # ------------------------------------------------------------------ asking
    async def call(self, contact: Contact, method: str, body: Any) -> Message | None:
        """One request with the RPC deadline; None (and a failure counted) if the peer did not answer.

        The request (and the dial before it) runs on the side, to its own deadlines: a caller that
        stops waiting (a lookup done while a departed peer's request was still unanswered) leaves it
        to count its outcome. Cut short, it learnt nothing, and a departed contact stayed in the
        table of every node whose lookups met it, named to every peer that asked and asked again by
        every lookup (in the simulated churning swarm of 128 peers, 46 dials per peer-round were cut
        short so; a departed peer with a connection open was never evicted at all)."""
        if not self._background.running:  # (the node is stopping: nobody would hear the outcome)
            return await self._ask(contact, method, body)
        request = _Request()
        self._background.start_soon(self._ask_into, request, contact, method, body)
        await request.done.wait()
        return request.reply

    async def _ask_into(self, request: _Request, contact: Contact, method: str, body: Any) -> None:
        try:
            request.reply = await self._ask(contact, method, body)
        finally:
            request.done.set()

    async def _ask(self, contact: Contact, method: str, body: Any) -> Message | None:
        claim = _claim(contact)
        asking = self._asking.setdefault(claim, _InFlight())
        asking.requests += 1
        judged_before = asking.outcomes
        try:
            try:
                connection = self.host.connection_to(contact.peer_id) or await self._dial(contact)
                if connection is None:  # its endpoint is known not to answer as this peer: not dialled
                    self._failed_unless_judged(contact, asking, judged_before)
                    return None
                announced = connection.remote_listen_address
                if announced is not None and announced.relay is not None:  # moved behind a relay since
                    self._drop_client(contact.peer_id)
                    return None
                reply = await connection.call(method, body, timeout=self._rpc_timeout)
            except RemoteError as error:  # it answered, but refused: alive, yet no use to this request
                log.debug("%s refused %s: %s", contact.peer_id, method, error)
                self.alive(contact)
                return None
            except (OSError, RPCError) as error:
                log.debug("%s to %s failed: %s", method, contact.peer_id, error)
                self._failed_unless_judged(contact, asking, judged_before)
                return None
            except Exception as error:  # nothing else is expected: ours, not the peer's; it costs this request
                log.warning("%s to %s failed unexpectedly: %r", method, contact.peer_id, error)
                return None
        finally:
            asking.requests -= 1
            if asking.requests == 0 and self._asking.get(claim) is asking:
                del self._asking[claim]
        self.alive(contact)
        return reply

    def _failed_unless_judged(self, contact: Contact, asking: _InFlight, judged_before: int) -> None:
        """A failure counts unless another outcome of the claim was recorded while this request was
        in flight: requests that one stall (or one departure) caught together are one strike, and a
        failure older than an answer does not undo it."""
        if asking.outcomes == judged_before:
            self.failed(contact)

    def _first_hand(self, contact: Contact) -> bool:
        """Whether we reached ``contact`` ourselves before, at this address: it is in our table, or
        was until it fell silent (then ``LostContacts`` schedules its pings, not the endpoint)."""
        held = self.table.get(contact.peer_id) or self.lost.get(contact.peer_id)
        return held is not None and held.address == contact.address

    async def _dial(self, contact: Contact) -> Connection | None:
        """Connect to ``contact``, unless another peer named it at an endpoint that recently failed
        to answer as the peer that must answer there (``UnansweredEndpoints``): None then. Dials
        of one direct endpoint run one at a time, so that contacts naming it under many identities
        cost one dial until it has answered or failed; a relay's endpoint serves many peers, so
        dials through it do not wait for each other."""
        address = contact.address
        endpoint = (address.host, address.port)
        expected = address.relay or contact.peer_id  # who answers at the endpoint: the relay, or the peer
        if address.relay is None:
            while (busy := self._dialing.get(endpoint)) is not None:
                await busy.wait()
                if (connection := self.host.connection_to(contact.peer_id)) is not None:
                    return connection
        if self.endpoints.blocks(endpoint, expected) and not self._first_hand(contact):
            return None
        done = trio.Event()
        if address.relay is None:
            self._dialing[endpoint] = done
        try:
            with trio.move_on_after(DIAL_RPCS * self._rpc_timeout) as deadline:
                connection = await self.host.connect(address)
            if deadline.cancelled_caught:
                raise ConnectError(f"{address}: no hello within {DIAL_RPCS * self._rpc_timeout:g} s")
        except ConnectError as error:
            # A relayed dial that reached its relay failed further on: the relay's endpoint answered.
            if address.relay is None or self.host.connection_to(address.relay) is None:
                self.endpoints.failed(endpoint, error.answered_by)
            raise
        finally:
            if self._dialing.get(endpoint) is done:
                del self._dialing[endpoint]
            done.set()
        self.endpoints.answered(endpoint)
        return connection


class _InFlight:
    """A claim's requests in flight, and the outcomes (answers or failures) recorded meanwhile."""

    __slots__ = ("requests", "outcomes")

    def __init__(self) -> None:
        self.requests = 0
        self.outcomes = 0


class _Request:
    """One request on the side and its reply (None: no answer); ``done`` once it is known."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Message | None = None


def _claim(contact: Contact) -> tuple[PeerID, str, int]:
    """What a failure or success is about: this peer at this address."""
    return (contact.peer_id, contact.address.host, contact.address.port)
