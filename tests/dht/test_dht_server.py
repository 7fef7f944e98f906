"""The ``dht.*`` handlers built from records and contacts alone, without a ``DHTNode``: real hosts on
127.0.0.1 carry the calls, and a recording stand-in plays the routing side."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest

from dht.local import LocalRecords
from dht.records import DHTRecord, key_id, pack
from dht.routing import Contact
from dht.server import DHTServer, ServedContacts
from dht.testing import placed_contact
from dht.validation import SignatureValidator
from dht.wire import encode_record, entry_digest, parse_contacts, parse_found
from peer import (
    BadRequestError,
    Identity,
    NodeIDProof,
    PeerAddress,
    PeerHost,
    PeerID,
    RemoteError,
    Router,
    open_peer_host,
)


class RecordingContacts:
    """Knows a fixed set of contacts and remembers whom the server reported alive."""

    def __init__(self, known: list[Contact]):
        self.known = known
        self.seen: list[PeerID] = []
        self.asked: list[tuple[int, int, PeerID | None]] = []

    def called_by(self, peer: PeerID, address: PeerAddress | None, node_id: NodeIDProof) -> None:
        if address is not None:
            self.seen.append(peer)

    def nearest(self, target: int, k: int, *, excluding: PeerID | None = None) -> list[Contact]:
        self.asked.append((target, k, excluding))
        return [c for c in self.known if c.peer_id != excluding][:k]


def contact(number: int) -> Contact:
    return placed_contact(number, 4000 + number)


@asynccontextmanager
async def serving(server: DHTServer) -> AsyncIterator[tuple[PeerHost, PeerHost]]:
    """A host serving ``server`` and a second, dialable host to call it from."""
    router = Router()
    server.register(router)
    async with open_peer_host(Identity.generate(), router=router, run_id="s") as host:
        async with open_peer_host(Identity.generate(), router=Router(), run_id="s") as caller:
            yield host, caller


async def test_server_answers_from_records_and_contacts_alone():
    records = LocalRecords(SignatureValidator())
    contacts = RecordingContacts([contact(n) for n in range(1, 6)])
    served: ServedContacts = contacts  # the narrow protocol is all the server gets
    server = DHTServer(records, served, k=3)
    async with serving(server) as (host, caller):
        address = host.listen_address
        await caller.call(address, "dht.ping", None, timeout=5)
        assert contacts.seen == [caller.peer_id]  # a dialable caller is noted as alive

        record = DHTRecord(pack("k"), None, pack("v"), time.time() + 30)
        assert (await caller.call(address, "dht.store", [encode_record(record)], timeout=5)).body == [True]
        assert records.found(record.key) is not None

        target = key_id(record.key)
        reply = await caller.call(address, "dht.find", [target.to_bytes(20, "big"), record.key], timeout=5)
        assert reply.body == []  # the value instead of contacts
        assert [r.value for r in parse_found(record.key, reply.payload, time.time())] == [record.value]

        reply = await caller.call(address, "dht.find", [target.to_bytes(20, "big"), pack("other")], timeout=5)
        assert [c.peer_id for c in parse_contacts(reply.body, 0)] == [c.peer_id for c in contacts.known[:3]]
        assert contacts.asked == [(target, 3, caller.peer_id)]  # never told about itself

        with pytest.raises(BadRequestError):
            await caller.call(address, "dht.store", "not a list", timeout=5)
        assert len(records.storage) == 1


async def test_stopped_server_refuses_while_its_host_lives_on():
    records = LocalRecords(SignatureValidator())
    contacts = RecordingContacts([])
    server = DHTServer(records, contacts, k=20)
    async with serving(server) as (host, caller):
        await caller.call(host.listen_address, "dht.ping", None, timeout=5)
        server.stop()
        record = DHTRecord(pack("k"), None, pack("v"), time.time() + 30)
        for method, body in [("dht.ping", None), ("dht.store", [encode_record(record)])]:
            with pytest.raises(RemoteError, match="stopped"):
                await caller.call(host.listen_address, method, body, timeout=5)
        assert len(records.storage) == 0 and contacts.seen == [caller.peer_id]


async def test_a_find_that_names_the_entries_its_asker_holds_gets_only_the_others():
    records = LocalRecords(SignatureValidator(None))
    server = DHTServer(records, RecordingContacts([]), k=3)
    key = pack("group")
    entries = [DHTRecord(key, pack(f"peer{n}"), pack(n), time.time() + 30) for n in range(3)]
    async with serving(server) as (host, caller):
        address = host.listen_address
        stored = await caller.call(address, "dht.store", [encode_record(r) for r in entries], timeout=5)
        assert stored.body == [True] * 3
        target = key_id(key).to_bytes(20, "big")
        held = records.found(key)
        assert isinstance(held, dict)

        def known(*subkeys: bytes) -> bytes:
            return b"".join(entry_digest(subkey, held[subkey]) for subkey in subkeys)

        async def find(*body):
            reply = await caller.call(address, "dht.find", [target, key, *body], timeout=5)
            return sorted(r.subkey for r in parse_found(key, reply.payload, time.time())), bool(reply.payload)

        everything = sorted(r.subkey for r in entries)
        assert await find() == (everything, True)
        assert await find(known(pack("peer0"), pack("peer2"))) == ([pack("peer1")], True)
        assert await find(known(*everything)) == ([], True)  # it holds the key, nothing we lack
        stale = entry_digest(pack("peer1"), replace(held[pack("peer1")], expiration_time=1.0))
        assert await find(stale) == (everything, True)  # an older version of an entry is not it
        for malformed in (b"short", b"x" * 8 * 257, "not bytes"):
            with pytest.raises(BadRequestError):
                await caller.call(address, "dht.find", [target, key, malformed], timeout=5)
