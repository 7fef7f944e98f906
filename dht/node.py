"""The DHT node: Kademlia over the peer RPC, on trio.

``DHTNode.open(...)`` is an async context manager: inside the block the node serves ``dht.*`` calls
(unless in client mode), refreshes stale buckets and pings contacts of full buckets, all in its own
nursery; leaving the block cancels all of it. It either runs its own ``PeerHost`` or attaches to an
existing one (the daemon's), registering its methods on that host's router.

The rules live in plain objects: ``RoutingTable`` (k-buckets), ``IterativeLookup`` (whom to ask),
``RecordStore`` (what to keep), ``PeerHealth`` (whom to avoid), validators (what to trust), ``wire``
(what a message may contain). This module only moves messages between them.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from peer import (
    Identity,
    Message,
    PeerAddress,
    PeerHost,
    PeerID,
    RemoteError,
    Router,
    RPCError,
    open_peer_host,
)

from . import wire
from .liveness import PeerHealth
from .local import LocalRecords, as_records
from .lookup import IterativeLookup
from .records import MAX_KEY_BYTES, MAX_VALUE_BYTES, DHTRecord, DHTValue, RecordError, key_id, pack
from .routing import ALPHA, Contact, K, RoutingTable
from .server import DHTServer
from .storage import Found, RecordStore, merge_found
from .validation import CompositeValidator, RecordValidator, SignatureValidator

__all__ = ["DHTNode", "DHTConfig", "DHTError", "DHTBootstrapError", "LookupResult"]

log = logging.getLogger("peerd.dht")


@dataclass(frozen=True)
class DHTConfig:
    k: int = K
    alpha: int = ALPHA
    # One request: a live peer on a continent-wide path answers a small find in well under a second.
    rpc_timeout: float = 2.0
    # A whole lookup: log2(n) rounds of rpc_timeout in the worst case of silent peers.
    lookup_timeout: float = 10.0
    bootstrap_timeout: float = 15.0
    # Paper: refresh buckets not looked up within an hour; 10 min suits a churny volunteer swarm.
    refresh_interval: float = 600.0
    refresh_check_period: float = 60.0
    # Join the paper's way (refresh every bucket farther than our closest neighbour) or only look up
    # our own ID (cheaper for huge one-process test swarms).
    refresh_on_join: bool = True
    cache_on_path: bool = True


class DHTError(Exception):
    """Base class of DHT failures."""


class DHTBootstrapError(DHTError):
    """No initial peer answered within the bootstrap deadline; the message names each and why."""


@dataclass
class LookupResult:
    nearest: list[Contact]  # nearest live peers that answered, nearest first (never ourselves)
    found: Found | None  # validated records for the key, if a key was searched
    hops: int
    rpcs: int
    timed_out: bool
    missing: list[Contact]  # answered without the value (for caching on the path)


_RETRY_INITIAL, _RETRY_MAX = 0.2, 2.0
# Hedged value lookups: before any measurement assume a LAN-ish 10 ms; never hedge sooner than 2 ms
# (below that, scheduling noise rather than a slow peer delays the answer).
_INITIAL_RTT, _MIN_HEDGE_DELAY = 0.01, 0.002  # bootstrap retries: peers of a swarm often start together


class DHTNode:
    """A Kademlia participant. Create with ``async with DHTNode.open(...) as node``."""

    def __init__(
        self,
        host: PeerHost,
        nursery: trio.Nursery,
        *,
        config: DHTConfig,
        validator: RecordValidator,
        client_mode: bool,
    ):
        self.host = host
        self.peer_id: PeerID = host.peer_id
        self.node_id = self.peer_id.to_int()
        self.config = config
        self.validator = validator
        self.client_mode = client_mode
        self.routing_table = RoutingTable(Contact.for_id(self.node_id), config.k)
        self.records = LocalRecords(validator)
        self.storage: RecordStore = self.records.storage
        self.health = PeerHealth()
        self._nursery = nursery
        self._pinging: set[bytes] = set()
        self.stopped = False
        self._rtt = _INITIAL_RTT  # smoothed time to a lookup's first answer (TCP's SRTT, alpha 1/8-ish)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        *,
        host: PeerHost | None = None,
        identity: Identity | None = None,
        listen: tuple[str, int] | None = ("127.0.0.1", 0),
        initial_peers: Iterable[PeerAddress | str] = (),
        client_mode: bool = False,
        run_id: str = "default",
        validators: Iterable[RecordValidator] = (),
        config: DHTConfig | None = None,
    ) -> AsyncIterator[DHTNode]:
        """Run a DHT node for the duration of the block.

        With ``host``, attach to that running host (its identity, listener and pool; ``client_mode``
        must match how it was opened). Otherwise open a host with ``identity`` (new if None) on
        ``listen``. Raises DHTBootstrapError if ``initial_peers`` are given and none answers.
        A ``SignatureValidator`` for the node's identity is always included.
        """
        config = config or DHTConfig()
        peers = [PeerAddress.parse(p) if isinstance(p, str) else p for p in initial_peers]
        try:
            async with cls._open(host, identity, listen, peers, client_mode, run_id, validators, config) as node:
                yield node
        except BaseExceptionGroup as group:
            # The nurseries around the bootstrap wrap its error; callers deserve the plain one.
            matched, rest = group.split(DHTBootstrapError)
            if matched is None or rest is not None:
                raise
            leaf: BaseException = matched
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            raise leaf from None

    @classmethod
    @asynccontextmanager
    async def _open(
        cls,
        host: PeerHost | None,
        identity: Identity | None,
        listen: tuple[str, int] | None,
        peers: list[PeerAddress],
        client_mode: bool,
        run_id: str,
        validators: Iterable[RecordValidator],
        config: DHTConfig,
    ) -> AsyncIterator[DHTNode]:
        if host is None:
            identity = identity or Identity.generate()
            async with open_peer_host(
                identity,
                listen=None if client_mode else listen,
                router=Router(),
                run_id=run_id,
                client_mode=client_mode,
            ) as own_host:
                async with cls._attach(own_host, peers, client_mode, validators, config) as node:
                    yield node
        else:
            async with cls._attach(host, peers, client_mode or host.client_mode, validators, config) as node:
                yield node

    @classmethod
    @asynccontextmanager
    async def _attach(
        cls,
        host: PeerHost,
        initial_peers: list[PeerAddress],
        client_mode: bool,
        validators: Iterable[RecordValidator],
        config: DHTConfig,
    ) -> AsyncIterator[DHTNode]:
        validator = CompositeValidator([SignatureValidator(host.identity), *validators])
        async with trio.open_nursery() as nursery:
            node = cls(host, nursery, config=config, validator=validator, client_mode=client_mode)
            if not client_mode:
                DHTServer(node).register(host.router)
            try:
                if initial_peers:
                    await node.bootstrap(initial_peers)
                nursery.start_soon(node._refresh_loop)
                yield node
            finally:
                node.stopped = True
                nursery.cancel_scope.cancel()

    @property
    def address(self) -> PeerAddress | None:
        """Where other peers reach this node (None in client mode)."""
        return None if self.client_mode else self.host.listen_address

    # ------------------------------------------------------------------ joining
    async def bootstrap(self, initial_peers: Sequence[PeerAddress], timeout: float | None = None) -> None:
        """Meet the initial peers (retrying until the deadline), then fill the routing table."""
        timeout = self.config.bootstrap_timeout if timeout is None else timeout
        reached: list[Contact] = []
        failures: dict[str, str] = {str(address): "no answer yet" for address in initial_peers}

        async def reach(address: PeerAddress) -> None:
            delay = _RETRY_INITIAL
            while True:
                try:
                    connection = await self.host.connect(address)
                    await connection.call("dht.ping", timeout=self.config.rpc_timeout)
                except (OSError, RPCError) as error:
                    failures[str(address)] = str(error).removeprefix(f"{address}: ")
                    if reached or "mismatch" in str(error):
                        return
                else:
                    contact = Contact(connection.remote_peer_id, address)
                    reached.append(contact)
                    self.peer_alive(contact)
                    return
                await trio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)

        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for address in initial_peers:
                    nursery.start_soon(reach, address)
        if not reached:
            lines = "\n".join(f"  {address}: {reason}" for address, reason in failures.items())
            raise DHTBootstrapError(f"could not reach any initial DHT peer within {timeout:g} s:\n{lines}")
        await self.lookup(self.node_id)
        if self.config.refresh_on_join:
            closest = self.routing_table.find_neighbors(Contact.for_id(self.node_id), 1)
            own_bucket = self.routing_table.get_bucket_for(Contact.for_id(self.node_id))
            async with trio.open_nursery() as nursery:
                for index, bucket in enumerate(self.routing_table.buckets):
                    if index != own_bucket and not (closest and bucket.has_in_range(closest[0])):
                        nursery.start_soon(self.lookup, random.randint(*bucket.range))

    async def _refresh_loop(self) -> None:
        while True:
            await trio.sleep(self.config.refresh_check_period)
            for bucket in self.routing_table.stale_buckets(self.config.refresh_interval):
                await self.lookup(random.randint(*bucket.range))

    # ------------------------------------------------------------------ peers
    def peer_alive(self, contact: Contact) -> None:
        """An authenticated exchange with ``contact`` succeeded: (re)add it to the routing table."""
        self.health.succeeded(contact.peer_id)
        connection = self.host.connection_to(contact.peer_id)
        if connection is not None:
            # Prefer the address the peer itself announced in the authenticated hello over one that
            # a third party told us; a client-mode peer announces none and never enters the table.
            announced = connection.remote_listen_address
            if announced is None:
                return
            if announced != contact.address:
                contact = Contact(contact.peer_id, announced)
        if contact.peer_id == self.peer_id:
            return
        head = self.routing_table.add_contact(contact)
        if head is not None and head.id not in self._pinging and not self.stopped:
            self._pinging.add(head.id)
            self._nursery.start_soon(self._ping_head, head)

    def _peer_failed(self, contact: Contact) -> None:
        if self.health.failed(contact.peer_id):
            self.routing_table.remove_contact(contact)

    async def _ping_head(self, head: Contact) -> None:
        """A full bucket's least-recently-seen contact: keep it if it answers (the paper prefers old
        contacts, which are likelier to stay), otherwise count a failure."""
        try:
            await self._call(head, "dht.ping", None)
        finally:
            self._pinging.discard(head.id)

    async def _call(self, contact: Contact, method: str, body: Any) -> Message | None:
        """One request with the RPC deadline; None (and a failure counted) if the peer did not answer."""
        try:
            reply = await self.host.call(contact.address, method, body, timeout=self.config.rpc_timeout)
        except RemoteError as error:  # it answered, but refused: alive, yet no use to this request
            log.debug("%s refused %s: %s", contact.peer_id, method, error)
            self.peer_alive(contact)
            return None
        except (OSError, RPCError) as error:
            log.debug("%s to %s failed: %s", method, contact.peer_id, error)
            self._peer_failed(contact)
            return None
        self.peer_alive(contact)
        return reply

    def _hedge_delay(self) -> float:
        # Three smoothed round trips: on a healthy path the first answer is back well before that.
        return min(max(3 * self._rtt, _MIN_HEDGE_DELAY), self.config.rpc_timeout)

    def _observe_rtt(self, seconds: float) -> None:
        self._rtt += 0.1 * (seconds - self._rtt)

    def excluded(self) -> Callable[[Contact], bool] | None:
        """Contacts to route around: those in failure backoff (None when there are none)."""
        if not self.health:
            return None
        backing_off = self.health.backing_off
        return lambda contact: backing_off(contact.peer_id)

    # ------------------------------------------------------------------ lookups
    async def lookup(
        self,
        target: int,
        key: bytes | None = None,
        *,
        stop_on_value: bool = False,
        on_answer: Callable[[Contact, IterativeLookup], None] | None = None,
    ) -> LookupResult:
        """Iterative lookup of the k nearest peers to ``target`` (and of ``key``'s records).

        ``on_answer(contact, search)`` runs after each answer (stores use it to pipeline)."""
        backing_off = self.health.backing_off
        initial = self.routing_table.find_neighbors(Contact.for_id(target), self.config.k, exclude=self.excluded())
        self.routing_table.touch(target)
        search = IterativeLookup(target, initial, k=self.config.k, alpha=self.config.alpha, self_id=self.node_id)
        body = [target.to_bytes(20, "big"), key]
        found: Found | None = None
        missing: list[Contact] = []
        send, receive = trio.open_memory_channel(math.inf)
        narrow = stop_on_value
        if narrow:
            search.start_narrow()
        started, first_answer = trio.current_time(), True

        async def query(contact: Contact) -> None:
            reply = await self._call(contact, "dht.find", body)
            parsed = None
            if reply is not None:
                try:
                    neighbours = wire.parse_contacts(reply.body)
                    if self.health:
                        neighbours = [c for c in neighbours if not backing_off(c.peer_id)]
                    records = wire.parse_found(key, reply.payload, time.time()) if key is not None else []
                    parsed = neighbours, self.records.validated(records) if records else None
                except RecordError as error:
                    log.debug("bad find reply from %s: %s", contact.peer_id, error)
            send.send_nowait((contact, parsed))

        with trio.move_on_after(self.config.lookup_timeout) as scope:
            async with trio.open_nursery() as nursery:
                while not (stop_on_value and found is not None):
                    for contact in search.next_queries():
                        nursery.start_soon(query, contact)
                    if search.done or search.in_flight == 0:
                        break
                    if narrow:
                        with trio.move_on_after(self._hedge_delay()):
                            contact, parsed = await receive.receive()
                            narrow = False
                        if narrow:  # the nearest peer is slow: open up to alpha requests
                            narrow = False
                            search.hedge()
                            continue
                    else:
                        contact, parsed = await receive.receive()
                    if parsed is not None and first_answer:
                        first_answer = False
                        self._observe_rtt(trio.current_time() - started)
                    if parsed is None:
                        search.on_failure(contact)
                        continue
                    search.on_response(contact, parsed[0])
                    if on_answer is not None:
                        on_answer(contact, search)
                    if parsed[1] is not None:
                        found = merge_found(found, parsed[1])
                    elif key is not None:
                        missing.append(contact)
                nursery.cancel_scope.cancel()
        return LookupResult(search.closest(), found, search.hops, search.rpcs, scope.cancelled_caught, missing)

    async def find_nearest(self, target: int, k: int | None = None) -> list[PeerID]:
        """The k nearest peers to ``target`` in the swarm, ourselves included unless in client mode."""
        k = k or self.config.k
        result = await self.lookup(target)
        ids = [contact.peer_id for contact in result.nearest]
        if not self.client_mode:
            ids.append(self.peer_id)
        return sorted(ids, key=lambda peer: peer.to_int() ^ target)[:k]

    # ------------------------------------------------------------------ records
    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store ``value`` under ``key`` (or under ``subkey`` of the dictionary at ``key``) on the k
        nearest peers until ``expiration_time`` (wall-clock seconds). True if at least one accepted."""
        record = DHTRecord(pack(key), None if subkey is None else pack(subkey), pack(value), float(expiration_time))
        if len(record.key) > MAX_KEY_BYTES or len(record.subkey or b"") > MAX_KEY_BYTES:
            raise ValueError(f"keys and subkeys are limited to {MAX_KEY_BYTES} bytes")
        record = replace(record, value=self.validator.sign(record))
        if len(record.value) > MAX_VALUE_BYTES:
            raise ValueError(f"values are limited to {MAX_VALUE_BYTES} bytes (got {len(record.value)})")
        self.records.check_lifetime(record, time.time())  # other nodes would refuse it silently
        if record.expiration_time <= time.time():
            return False
        target = key_id(record.key)
        outcomes: list[bool] = []
        sent: set[bytes] = set()
        async with trio.open_nursery() as nursery:

            def send_to(contact: Contact) -> None:
                if contact.id not in sent:
                    sent.add(contact.id)
                    nursery.start_soon(self._send_records, contact, [record], outcomes)

            # Pipelined: a peer that answers while it is among the k nearest known gets the record at
            # once instead of after the whole lookup. A peer later pushed out of the k nearest keeps
            # an extra copy, as a path cache would.
            result = await self.lookup(
                target, on_answer=lambda contact, search: send_to(contact) if search.among_nearest(contact) else None
            )
            nearest = result.nearest[: self.config.k]
            for contact in nearest:
                send_to(contact)
            if not self.client_mode and (
                len(nearest) < self.config.k or self.node_id ^ target < nearest[-1].long_id ^ target
            ):
                outcomes.append(self.records.store(record))
        return any(outcomes)

    async def _send_records(self, contact: Contact, records: list[DHTRecord], outcomes: list[bool]) -> None:
        for start in range(0, len(records), wire.MAX_RECORDS_PER_STORE):
            batch = records[start : start + wire.MAX_RECORDS_PER_STORE]
            reply = await self._call(contact, "dht.store", [wire.encode_record(r) for r in batch])
            if reply is None or not isinstance(reply.body, list):
                outcomes.append(False)
                return
            outcomes.append(any(result is True for result in reply.body))

    async def get(self, key: Any, latest: bool = False) -> DHTValue | None:
        """The value under ``key``: the first valid one found, or with ``latest`` the newest (merged
        across all k nearest peers for dictionaries). None if nobody holds a live value."""
        key_bytes = pack(key)
        if len(key_bytes) > MAX_KEY_BYTES:
            raise ValueError(f"keys are limited to {MAX_KEY_BYTES} bytes")
        local = None if self.client_mode else self.records.found(key_bytes)
        if local is not None and not latest:
            return self.records.decode(key_bytes, local)
        result = await self.lookup(key_id(key_bytes), key_bytes, stop_on_value=not latest)
        found = merge_found(local, result.found)
        if found is None:
            return None
        if result.found is not None and self.config.cache_on_path and result.missing and not self.stopped:
            # Kademlia's caching: the nearest peer on the path that lacked the value gets a copy.
            target = key_id(key_bytes)
            nearest_missing = min(result.missing, key=lambda c: c.long_id ^ target)
            self._nursery.start_soon(self._send_records, nearest_missing, as_records(key_bytes, found), [])
        return self.records.decode(key_bytes, found)
