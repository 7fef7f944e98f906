"""The DHT node: Kademlia over the peer RPC, on trio.

``DHTNode.open(...)`` is an async context manager: inside the block the node serves ``dht.*`` calls
(unless in client mode), refreshes stale buckets and pings contacts of full buckets, all in its own
nursery; leaving the block cancels all of it. It either runs its own ``PeerHost`` or attaches to an
existing one (the daemon's), registering its methods on that host's router.

``DHTNode`` composes the pieces and keeps the public API in one place:
- ``Contacts`` (contacts.py): routing table, peer health, every request sent, eviction pings;
- ``DHTServer`` (server.py): the ``dht.*`` handlers, given only the records and the contacts;
- ``LookupDriver`` (lookup_driver.py): runs ``IterativeLookup`` over the network, hedged;
- ``Replicas`` (replicas.py): store on and get from the k nearest peers;
- ``TableMaintenance`` (maintenance.py): bootstrap, bucket refresh, reconnecting after outages.
The rules themselves live in plain objects: ``RoutingTable``, ``IterativeLookup``, ``RecordStore``
behind ``LocalRecords``, ``PeerHealth``, the validators, and ``wire``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from peer import (
    LOCAL_DIFFICULTY,
    SYSTEM_CLOCK,
    Clock,
    Identity,
    NodeIDProof,
    PeerAddress,
    PeerHost,
    PeerID,
    Router,
    open_peer_host,
)
from peer.verified import VerifiedSignatureCache

from .background import Background
from .config import DHTBootstrapError, DHTConfig, DHTError
from .contacts import Contacts
from .liveness import PeerHealth
from .local import LocalRecords
from .lookup import DisjointLookup
from .lookup_driver import LookupDriver, LookupResult
from .maintenance import TableMaintenance
from .records import DHTValue
from .replicas import Replicas
from .routing import Contact, RoutingTable
from .server import DHTServer
from .storage import RecordStore
from .validation import CompositeValidator, RecordValidator, SignatureValidator

__all__ = ["DHTNode", "DHTConfig", "DHTError", "DHTBootstrapError", "LookupResult"]


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
        clock: Clock = SYSTEM_CLOCK,
    ):
        self.host = host
        self.clock = clock  # record expirations and versions by its wall clock, backoff by its monotonic one
        self.peer_id: PeerID = host.peer_id
        # Our place in the keyspace: the node ID our host's puzzle solution yields (``peer/node_id.py``).
        self.node_id = int.from_bytes(host.node_id.node_id, "big")
        self.config = config
        self.validator = validator
        self.client_mode = client_mode
        self.routing_table = RoutingTable(Contact.for_id(self.node_id), config.k, clock.monotonic)
        self.records = LocalRecords(validator, RecordStore(clock=clock.time))
        self.storage: RecordStore = self.records.storage
        self._background = Background(nursery)
        health = PeerHealth(clock=clock.monotonic)
        self._contacts = Contacts(
            host, self.routing_table, self._background, rpc_timeout=config.rpc_timeout, health=health
        )
        self._server = DHTServer(self.records, self._contacts, k=config.k)
        self._lookups = LookupDriver(self._contacts, self.records, node_id=self.node_id, config=config)
        self._replicas = Replicas(
            self._lookups,
            self._contacts,
            self.records,
            self._background,
            node_id=self.node_id,
            config=config,
            client_mode=client_mode,
        )
        self._maintenance = TableMaintenance(
            host, self.routing_table, self._contacts, self._lookups, node_id=self.node_id, config=config
        )

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
        node_id_difficulty: int = LOCAL_DIFFICULTY,
        node_id: NodeIDProof | None = None,
        signatures: VerifiedSignatureCache | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> AsyncIterator[DHTNode]:
        """Run a DHT node for the duration of the block.

        With ``host``, attach to that running host (its identity, listener, pool and node-ID proof;
        ``client_mode`` must match how it was opened). Otherwise open a host with ``identity`` (new
        if None) on ``listen``, at the run's ``node_id_difficulty`` with ``node_id`` (solved now if
        None; see ``PeerHost``). Raises DHTBootstrapError if ``initial_peers`` are given and none
        answers. A ``SignatureValidator`` for the host's identity is always included (and no other
        may be): every node refuses owner-marked records its owner did not sign, and signs its own
        with that identity. It checks signatures through ``signatures`` (default: the process's
        ``default_signature_cache``, shared by every node of the process). ``clock`` is the time
        records live and are signed by (the system's; ``peer.clock.TrioClock`` for swarms
        simulated under trio's virtual clock).
        """
        config = config or DHTConfig()
        validators = CompositeValidator(validators).validators
        if any(isinstance(v, SignatureValidator) for v in validators):
            # A second one would wrap the node's signed envelope in another, which no node verifies.
            raise ValueError("a DHT node signs with its host's identity; pass no SignatureValidator of your own")
        peers = [PeerAddress.parse(p) if isinstance(p, str) else p for p in initial_peers]
        own_host = {"run_id": run_id, "node_id_difficulty": node_id_difficulty, "node_id": node_id}
        try:
            checks = (validators, signatures)  # what the node checks records with
            opening = cls._open(host, identity, listen, peers, client_mode, own_host, config, checks, clock)
            async with opening as node:
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
        host_options: dict[str, Any],
        config: DHTConfig,
        checks: tuple[Iterable[RecordValidator], VerifiedSignatureCache | None],
        clock: Clock,
    ) -> AsyncIterator[DHTNode]:
        if host is None:
            identity = identity or Identity.generate()
            async with open_peer_host(
                identity,
                listen=None if client_mode else listen,
                router=Router(),
                client_mode=client_mode,
                **host_options,
            ) as own_host:
                async with cls._attach(own_host, peers, client_mode, config, *checks, clock) as node:
                    yield node
        else:
            async with cls._attach(host, peers, client_mode or host.client_mode, config, *checks, clock) as node:
                yield node

    @classmethod
    @asynccontextmanager
    async def _attach(
        cls,
        host: PeerHost,
        initial_peers: list[PeerAddress],
        client_mode: bool,
        config: DHTConfig,
        validators: Iterable[RecordValidator],
        signatures: VerifiedSignatureCache | None,
        clock: Clock,
    ) -> AsyncIterator[DHTNode]:
        signer = SignatureValidator(host.identity, clock=clock.time, signatures=signatures)
        validator = CompositeValidator([signer, *validators])
        async with trio.open_nursery() as nursery:
            node = cls(host, nursery, config=config, validator=validator, client_mode=client_mode, clock=clock)
            if not client_mode:
                node._server.register(host.router)
            try:
                if initial_peers:
                    await node.bootstrap(initial_peers)
                nursery.start_soon(node._maintenance.refresh_forever)
                nursery.start_soon(node._maintenance.reconnect_forever)
                yield node
            finally:
                node._server.stop()
                node._background.stop()
                nursery.cancel_scope.cancel()

    @property
    def requests_served(self) -> int:
        """DHT requests (ping, find, store) this node has handled: its share of the swarm's load."""
        return self._server.served

    @property
    def address(self) -> PeerAddress | None:
        """Where other peers reach this node (None in client mode)."""
        return None if self.client_mode else self.host.listen_address

    @property
    def stopped(self) -> bool:
        """True once the node is leaving: it serves no more calls and starts no side tasks."""
        return not self._background.running

    @property
    def health(self) -> PeerHealth:
        """Failure backoff per claim, a peer ID at an address (see ``PeerHealth``, ``contacts.py``)."""
        return self._contacts.health

    # ------------------------------------------------------------------ joining
    async def bootstrap(self, initial_peers: Sequence[PeerAddress], timeout: float | None = None) -> None:
        """Meet the initial peers (retrying until the deadline), then fill the routing table.
        Raises DHTBootstrapError if none answers within ``timeout`` (default: the config's)."""
        timeout = self.config.bootstrap_timeout if timeout is None else timeout
        await self._maintenance.bootstrap(initial_peers, timeout)

    # ------------------------------------------------------------------ peers
    def excluded(self) -> Callable[[Contact], bool] | None:
        """Contacts to route around: those in failure backoff (None when there are none)."""
        return self._contacts.excluded()

    # ------------------------------------------------------------------ lookups
    async def lookup(
        self,
        target: int,
        key: bytes | None = None,
        *,
        stop_on_value: bool = False,
        on_answer: Callable[[Contact, DisjointLookup], None] | None = None,
    ) -> LookupResult:
        """Iterative lookup of the k nearest peers to ``target`` (and of ``key``'s records).

        ``on_answer(contact, search)`` runs after each answer (stores use it to pipeline)."""
        return await self._lookups.run(target, key, stop_on_value=stop_on_value, on_answer=on_answer)

    async def find_nearest(self, target: int, k: int | None = None) -> list[PeerID]:
        """The k nearest peers to ``target`` in the swarm, ourselves included unless in client mode."""
        return [peer for _, peer in await self._nearest(target, k)]

    async def nearest_node_ids(self, target: int, k: int | None = None) -> list[int]:
        """The node IDs (what the DHT's distances are measured in) of ``find_nearest``'s peers."""
        return [node_id for node_id, _ in await self._nearest(target, k)]

    async def _nearest(self, target: int, k: int | None) -> list[tuple[int, PeerID]]:
        k = k or self.config.k
        result = await self._lookups.run(target)
        placed = [(contact.long_id, contact.peer_id) for contact in result.nearest]
        if not self.client_mode:
            placed.append((self.node_id, self.peer_id))
        placed.sort(key=lambda entry: entry[0] ^ target)
        return placed[:k]

    # ------------------------------------------------------------------ records
    async def store(
        self, key: Any, value: Any, expiration_time: float, subkey: Any = None, *, majority: bool = False
    ) -> bool:
        """Store ``value`` under ``key`` (or under ``subkey`` of the dictionary at ``key``) on the k
        nearest peers until ``expiration_time`` (wall-clock seconds). True if at least one accepted.
        ``majority``: return once most holders accepted, the rest sent to in the background (a
        holder that left would otherwise hold the caller for the whole RPC timeout)."""
        return await self._replicas.store(key, value, expiration_time, subkey, majority=majority)

    async def get(self, key: Any, latest: bool = False) -> DHTValue | None:
        """The value under ``key``: the first valid one found, or with ``latest`` the newest (merged
        across all k nearest peers for dictionaries). None if nobody holds a live value."""
        return await self._replicas.get(key, latest)
