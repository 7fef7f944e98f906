"""The serving side of a DHT node: the ``dht.*`` RPC handlers.

Each handler parses its body strictly (``wire``), records the caller as alive if it is dialable (the
address comes from the caller's authenticated hello, never from the body), and answers from the
routing table and validated local records. Bad input raises ``BadRequest``; nothing a caller sends
can do more than waste one request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from peer import Message, Request, Router

from . import wire
from .routing import Contact

if TYPE_CHECKING:
    from .node import DHTNode

__all__ = ["DHTServer", "METHODS"]

METHODS = ("dht.ping", "dht.find", "dht.store")


class DHTServiceStopped(Exception):
    """The node behind these handlers has left (its host lives on, e.g. in the daemon)."""


class DHTServer:
    def __init__(self, node: DHTNode):
        self.node = node

    def register(self, router: Router) -> None:
        router.add_unary("dht.ping", self.ping)
        router.add_unary("dht.find", self.find)
        router.add_unary("dht.store", self.store)

    def _begin(self, request: Request) -> None:
        if self.node.stopped:
            raise DHTServiceStopped("this peer's DHT node has stopped")

    def _note_caller(self, request: Request) -> None:
        address = request.listen_address
        if address is not None and address.peer_id is not None:
            self.node.peer_alive(Contact(address.peer_id, address))

    async def ping(self, request: Request) -> None:
        self._begin(request)
        self._note_caller(request)

    async def find(self, request: Request) -> Message:
        self._begin(request)
        target, key = wire.parse_find_request(request.body)
        self._note_caller(request)
        node = self.node
        found = node.records.found(key) if key is not None else None
        if found is not None:  # as Kademlia's FIND_VALUE: the value instead of contacts
            return Message([], wire.encode_found(found))
        caller = request.peer.to_bytes()
        excluded = node.excluded()
        neighbours = node.routing_table.find_neighbors(
            Contact.for_id(target),
            node.config.k,
            exclude=(lambda c: c.id == caller or excluded(c)) if excluded else (lambda c: c.id == caller),
        )
        return Message(wire.encode_contacts(neighbours))

    async def store(self, request: Request) -> list[bool]:
        self._begin(request)
        records = wire.parse_store_request(request.body, time.time())
        self._note_caller(request)
        writer = request.peer.to_bytes()  # the authenticated caller: storage evicts by fair share per writer
        return [self.node.records.store(record, writer) for record in records]
