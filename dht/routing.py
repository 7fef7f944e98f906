"""The routing table: the ``kademlia`` package's k-buckets with its three defects corrected.

- ``get_bucket_for``: bucket ranges are inclusive (``KBucket.split`` makes ``[lo, mid]`` and
  ``[mid + 1, hi]``), but the package compares ``long_id < range[1]``, so an ID equal to a bucket's
  upper bound lands in the next bucket. Here: ``<=``, found by bisection.
- ``add_contact``: on a full bucket the package calls ``asyncio.ensure_future(protocol.call_ping(...))``,
  which needs a running asyncio loop. Here it returns the bucket's least-recently-seen contact and the
  trio node decides whether and when to ping it (the newcomer waits in the replacement list).
- ``find_neighbors``: the package walks buckets outward from the target's bucket and stops at k
  nodes, which is not the k nearest by XOR distance (neighbouring buckets in list order are not the
  nearest in XOR space). Here: exact, walking buckets in the order of their XOR distance from the
  target. Every bucket is an aligned block of 2**m IDs (the keyspace, halved at each split), and
  XOR with the target maps an aligned block onto an aligned block of distances: of two buckets,
  every contact of the one whose block starts nearer is nearer than every contact of the other. So
  the walk stops at the end of the first buckets that hold k contacts, and a lookup's cost does not
  grow with the table.

Contacts carry the pinned ``PeerAddress`` that reaches them; only peers we have talked to over an
authenticated connection are ever added (never addresses that a third party claimed).

A contact sits in the keyspace at the node ID of its puzzle solution (``peer/node_id.py``), not at
its peer ID: a peer ID is a free hash of a free key, a node ID costs 2**difficulty hashes, so
landing next to a chosen key is expensive. Whoever builds a contact checks the proof against the
run's difficulty first (the handshake for peers we talk to, ``wire.parse_contacts`` for named ones).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import time
from collections.abc import Callable, Iterator, Sequence

from kademlia.node import Node
from kademlia.routing import KBucket
from kademlia.routing import RoutingTable as _PackageRoutingTable

from peer import NodeIDProof, PeerAddress, PeerID

__all__ = ["Contact", "RoutingTable", "K", "ALPHA", "KEYSPACE_BITS", "swarm_estimate"]

# Kademlia's parameters (Maymounkov & Mazieres, 2002): k = 20 replicas/bucket size, alpha = 3.
K = 20
ALPHA = 3
KEYSPACE_BITS = 160
# Node IDs that entered the table lately, remembered so that one leaving and entering again counts
# as a new contact (a bucket's refresh) once (``RoutingTable.add_contact``); ~25 KB a table.
ENTRIES_REMEMBERED = 256


class Contact(Node):
    """A ``kademlia.node.Node`` placed by its node-ID proof, knowing its peer ID and the pinned
    address that reaches it (``id``/``long_id`` are the node ID, never the peer ID)."""

    def __init__(self, proof: NodeIDProof, address: PeerAddress):
        super().__init__(proof.node_id, address.host, address.port)
        self.proof = proof
        self.peer_id: PeerID = proof.peer_id
        peer_id = proof.peer_id
        self.address = address if address.peer_id == peer_id else address.with_peer_id(peer_id)

    @functools.cached_property
    def wire_entry(self) -> tuple[bytes, str, int, bytes]:
        """How a find reply names this contact (``wire.encode_contacts``): built once, as a DHT
        node names the same few contacts in every reply (a tuple: shared, so never changed). A
        peer reached through a relay is named ``RELAY_HOST/RELAY_ID`` at the relay's port."""
        host = self.address.host if self.address.relay is None else f"{self.address.host}/{self.address.relay}"
        return (self.peer_id.to_bytes(), host, self.address.port, self.proof.nonce)

    @classmethod
    def for_id(cls, node_id: int) -> Node:
        """A bare keyspace position (a lookup target), not a reachable peer."""
        return Node(node_id.to_bytes(KEYSPACE_BITS // 8, "big"))

    def __repr__(self) -> str:
        return f"Contact({self.peer_id}, {self.address.endpoint})"


def _block_distance(target: int, bucket: KBucket) -> int:
    """The XOR distance from ``target`` to the nearest ID ``bucket`` can hold: its range is an
    aligned block of 2**m IDs, ``[low, low + 2**m - 1]``, so the distances are one aligned block too,
    starting at ``target ^ low`` with its m low bits cleared."""
    low, high = bucket.range
    return (target ^ low) & ~(high - low)


def swarm_estimate(target: int, nearest: Sequence[int], k: int) -> float:
    """The number of nodes in a DHT whose ``k`` nearest node IDs to ``target`` are ``nearest``.
    IDs are uniform over the key space, so the k-th nearest lies at distance k / (N + 1) of it on
    average, and ``(k - 1) / distance`` estimates N without bias (within ~1/sqrt(k)). Fewer than
    k found: the lookup saw the whole DHT."""
    distances = sorted(node ^ target for node in nearest)
    if len(distances) < k or k < 2:
        return float(len(distances))
    return (k - 1) * 2**KEYSPACE_BITS / max(1, distances[k - 1])


class RoutingTable(_PackageRoutingTable):
    """k-buckets around ``node`` (our own position), usable from trio."""

    def __init__(self, node: Node, ksize: int = K, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # when buckets were refreshed, in the node's monotonic time
        self._entered: dict[int, None] = {}  # (least recent first)
        super().__init__(protocol=None, ksize=ksize, node=node)

    def flush(self) -> None:
        # Ranges are inclusive, so the whole keyspace is [0, 2**160 - 1].
        self.buckets = [KBucket(0, 2**KEYSPACE_BITS - 1, self.ksize)]
        self.buckets[0].last_updated = self.clock()

    def split_bucket(self, index: int) -> None:
        """Split as the package does; both halves count as refreshed now, by our clock (the
        package stamps them with ``time.monotonic``)."""
        super().split_bucket(index)
        self.buckets[index].last_updated = self.buckets[index + 1].last_updated = self.clock()

    def _first_entry(self, node_id: int) -> bool:
        """Whether ``node_id`` enters for the first time of those remembered. A peer can leave the
        table at will (announcing a relayed address drops it) and enter again: only its first
        entry counts as meeting its bucket's range."""
        first = node_id not in self._entered
        self._entered.pop(node_id, None)
        self._entered[node_id] = None
        while len(self._entered) > ENTRIES_REMEMBERED:
            del self._entered[next(iter(self._entered))]
        return first

    def get_bucket_for(self, node: Node) -> int:
        uppers = [bucket.range[1] for bucket in self.buckets]
        index = bisect.bisect_left(uppers, node.long_id)
        if index == len(self.buckets):
            raise ValueError(f"node ID {node.long_id} is outside the keyspace")
        return index

    def add_contact(self, node: Node) -> Node | None:
        """Add or refresh ``node``. Returns the bucket's least-recently-seen contact when the bucket
        is full (the newcomer is kept as a replacement); the caller should ping it and report a
        failure with ``remove_contact`` (which promotes the newest replacement) or a success with
        another ``add_contact`` (which moves it to the tail)."""
        if node.long_id == self.node.long_id:
            return None
        index = self.get_bucket_for(node)
        bucket = self.buckets[index]
        new = node.id not in bucket.nodes
        if bucket.add_node(node):
            if new and self._first_entry(node.long_id):  # its range is met unasked: no refresh (BEP 5)
                bucket.last_updated = self.clock()
            return None
        # Section 4.2 of the paper: split the bucket holding our own ID, and (relaxed) others whose
        # depth is not a multiple of 5, as the package does.
        if bucket.has_in_range(self.node) or bucket.depth() % 5 != 0:
            self.split_bucket(index)
            return self.add_contact(node)
        return bucket.head()

    def find_neighbors(
        self, node: Node, k: int | None = None, exclude: Callable[[Contact], bool] | None = None
    ) -> list[Contact]:
        """The exact k nearest contacts to ``node`` by XOR distance (never ``node`` itself), skipping
        those for which ``exclude(contact)`` is true."""
        k = k or self.ksize
        target = node.long_id
        candidates: list[Contact] = []
        for bucket in sorted(self.buckets, key=functools.partial(_block_distance, target)):
            for contact in bucket.nodes.values():
                if contact.long_id != target and (exclude is None or not exclude(contact)):
                    candidates.append(contact)
            if len(candidates) >= k:  # every later bucket's contacts are farther (the module)
                break
        # A list, not a generator: nsmallest then just sorts when the table holds k or fewer.
        return heapq.nsmallest(k, candidates, key=lambda contact: contact.long_id ^ target)

    def estimated_swarm_size(self) -> int:
        """How many nodes the swarm holds, as far as this table can tell (``swarm_estimate`` of our
        own ID's k nearest contacts): a table holds the k nearest as soon as its join's lookup of
        our own ID has run, while its far buckets fill only as traffic comes, so its size alone
        reads a newcomer's swarm as a small one."""
        nearest = [contact.long_id for contact in self.find_neighbors(self.node, self.ksize)]
        return max(len(self), round(swarm_estimate(self.node.long_id, nearest, self.ksize)))

    def contacts(self) -> Iterator[Contact]:
        for bucket in self.buckets:
            yield from bucket.nodes.values()

    def get(self, peer_id: PeerID) -> Contact | None:
        """The contact of ``peer_id`` (a scan: a peer's place comes from its proof, not its ID)."""
        return next((contact for contact in self.contacts() if contact.peer_id == peer_id), None)

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, PeerID) and self.get(peer_id) is not None

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self.buckets)

    def touch(self, target: int) -> None:
        """Mark the bucket covering ``target`` as refreshed (a lookup went there)."""
        self.buckets[self.get_bucket_for(Contact.for_id(target))].last_updated = self.clock()

    def stale_buckets(self, max_age: float) -> list[KBucket]:
        """Buckets that for ``max_age`` seconds no lookup went to and no contact new to them
        entered (the package hard-codes an hour, and counts lookups only). A busy swarm's traffic
        brings each node new contacts in every range it should know, so only a quiet node, or a
        range quiet for it, costs refresh lookups: BitTorrent's DHT (BEP 5) refreshes by the same
        rule. Only a contact's first entry counts (of the last ENTRIES_REMEMBERED), not its calls
        while there nor its entering again after it left, so one peer cannot hold a range's
        refresh off: that takes a new identity, a node-ID puzzle, every ``max_age``."""
        cutoff = self.clock() - max_age
        return [bucket for bucket in self.buckets if bucket.last_updated < cutoff]
