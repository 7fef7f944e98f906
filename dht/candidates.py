"""A lookup's candidates, nearest first, and the order in which a read that needs only some of a
key's holders draws them (``spread_order``)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from itertools import islice
from operator import itemgetter

from kademlia.node import Node, NodeHeap

__all__ = ["CandidateHeap", "spread_order"]

_distance = itemgetter(0)
_contact = itemgetter(1)


class CandidateHeap(NodeHeap):
    """The package's ``NodeHeap`` (candidates as (XOR distance, contact) pairs) kept fully sorted,
    nearest first, with O(1) membership. A lookup holds a few dozen candidates and reads its k
    nearest after every answer (whom to ask, whether it is done): the package's ``__iter__`` sorts
    them again for each read (``nsmallest``) and its ``push`` and ``__contains__`` scan them all. A
    sorted list is still a valid heap, so the package's other methods keep working."""

    def __init__(self, target: Node, k: int):
        super().__init__(target, k)
        self._target = target.long_id
        self._ids: set[bytes] = set()

    def push(self, nodes: Node | list[Node]) -> list[Node]:
        """Add the nodes that are not candidates yet (one per node ID); return those."""
        ids, heap, target = self._ids, self.heap, self._target
        added = []
        for node in nodes if isinstance(nodes, list) else [nodes]:
            if node.id not in ids:
                ids.add(node.id)
                heap.append((node.long_id ^ target, node))
                added.append(node)
        if added:
            heap.sort(key=_distance)  # a few sorted runs: timsort merges them
        return added

    def remove(self, peers: Iterable[bytes]) -> None:
        peers = set(peers) & self._ids
        if peers:
            self._ids -= peers
            self.heap = [entry for entry in self.heap if entry[1].id not in peers]

    def popleft(self) -> Node | None:
        if not self.heap:
            return None
        node = self.heap.pop(0)[1]
        self._ids.discard(node.id)
        return node

    def __contains__(self, node: object) -> bool:
        return isinstance(node, Node) and node.id in self._ids

    def __iter__(self) -> Iterator[Node]:
        """The k nearest, nearest first."""
        return map(_contact, islice(self.heap, self.maxsize))

    def nearest_entries(self) -> list[tuple[int, Node]]:
        """The k nearest as (distance, node) pairs, nearest first."""
        return self.heap[: self.maxsize]

    @property
    def best_distance(self) -> int:
        return self.heap[0][0] if self.heap else 2**160


def spread_order(salt: bytes, node_id: bytes) -> bytes:
    """Where ``node_id`` comes in the order ``salt`` draws (a keyed hash: uniform, and different
    for every salt). A read that needs only some of a key's holders takes the first in its own
    order, so that the readers of a popular key spread over its holders instead of all asking
    the nearest few."""
    return hashlib.blake2b(node_id, key=salt, digest_size=8).digest()
