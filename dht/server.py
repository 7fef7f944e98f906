"""The serving side of a DHT node: the ``dht.*`` RPC handlers.

Each handler parses its body strictly (``wire``), records the caller as alive if it is dialable (the
address comes from the caller's authenticated hello, never from the body), and answers from the
routing table and validated local records. Bad input raises ``BadRequest``; nothing a caller sends
can do more than waste one request.

The server sees only what answering needs, as two small protocols: ``ServedRecords`` (a node's
``LocalRecords``) and ``ServedContacts`` (its ``Contacts``); it never sees the node.
"""

from __future__ import annotations

from typing import Protocol

from peer import Message, NodeIDProof, PeerAddress, PeerID, Request, Router

from . import wire
from .records import DHTRecord
from .routing import Contact
from .storage import Found

__all__ = ["DHTServer", "DHTServiceStopped", "ServedContacts", "ServedRecords"]


class ServedRecords(Protocol):
    def found(self, key: bytes) -> Found | None:
        """Valid live records under ``key``."""

    def store(self, record: DHTRecord) -> bool:
        """Validate and keep ``record``; False if refused."""

    def now(self) -> float:
        """The wall clock the records live by."""


class ServedContacts(Protocol):
    def called_by(self, peer: PeerID, address: PeerAddress | None, node_id: NodeIDProof) -> None:
        """``peer`` just called us over an authenticated connection, announcing ``address``, where
        its handshake showed ``node_id``."""

    def nearest(self, target: int, k: int, *, excluding: PeerID | None = None) -> list[Contact]:
        """The k known contacts nearest to ``target``, without the peer ``excluding``."""


class DHTServiceStopped(Exception):
    """The node behind these handlers has left (its host lives on, e.g. in the daemon)."""


class DHTServer:
    def __init__(self, records: ServedRecords, contacts: ServedContacts, *, k: int):
        self.records = records
        self.contacts = contacts
        self.k = k
        self.stopped = False
        self.served = 0  # requests answered or refused: this node's share of the DHT's load

    def register(self, router: Router) -> None:
        router.add_unary("dht.ping", self.ping)
        router.add_unary("dht.find", self.find)
        router.add_unary("dht.store", self.store)

    def stop(self) -> None:
        """Refuse every later call: the handlers stay registered on a host that may outlive us."""
        self.stopped = True

    def _begin(self) -> None:
        self.served += 1
        if self.stopped:
            raise DHTServiceStopped("this peer's DHT node has stopped")

    def _note_caller(self, request: Request) -> None:
        if request.connection is not None:  # (the connection the call came on, even if it is retiring)
            self.contacts.called_by(request.peer, request.listen_address, request.connection.remote_node_id)

    async def ping(self, request: Request) -> None:
        self._begin()
        self._note_caller(request)

    async def find(self, request: Request) -> Message:
        self._begin()
        target, key, known = wire.parse_find_request(request.body)
        self._note_caller(request)
        found = self.records.found(key) if key is not None else None
        if found is not None:  # as Kademlia's FIND_VALUE: the value instead of contacts
            return Message([], wire.encode_found(found, known))
        neighbours = self.contacts.nearest(target, self.k, excluding=request.peer)
        return Message(wire.encode_contacts(neighbours))

    async def store(self, request: Request) -> list[bool]:
        self._begin()
        records = wire.parse_store_request(request.body, self.records.now())
        self._note_caller(request)
        writer = request.peer.to_bytes()  # the authenticated caller: storage evicts by fair share per writer
        return [self.records.store(record, writer) for record in records]
