"""Helpers for tests and benchmarks that run many DHT nodes in one process."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from peer import NodeIDProof, PeerAddress, PeerID
from peer.node_id import NONCE_BYTES

from .node import DHTConfig, DHTNode
from .routing import Contact

__all__ = ["open_swarm", "Swarm", "jaccard", "placed_contact"]


class _PlacedProof(NodeIDProof):
    """A stand-in proof at a chosen keyspace position, so that routing and lookup rules can be
    driven with plain positions (a real node ID is a hash nobody can choose)."""

    def __init__(self, peer_id: PeerID, node_id: int):  # no super(): nothing is solved or hashed
        self.peer_id, self.nonce, self.work_bits = peer_id, bytes(NONCE_BYTES), 0
        self.node_id = node_id.to_bytes(20, "big")


def placed_contact(position: int, port: int = 1000) -> Contact:
    """A contact at keyspace ``position`` (its peer ID is the same number, for readable failures)."""
    peer_id = PeerID(position.to_bytes(20, "big"))
    return Contact(_PlacedProof(peer_id, position), PeerAddress("127.0.0.1", port, peer_id))


class Swarm:
    """Nodes that each run in their own task, so any one can be killed without the others."""

    def __init__(self, nursery: trio.Nursery, config: DHTConfig | None, validators: Sequence[Any]):
        self.nodes: list[DHTNode] = []
        self._nursery = nursery
        self._config = config
        self._validators = validators
        self._stops: dict[int, tuple[trio.CancelScope, trio.Event]] = {}

    async def _run(self, options: dict[str, Any], task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with DHTNode.open(config=self._config, validators=self._validators, **options) as node:
                    self._stops[id(node)] = (scope, stopped)
                    task_status.started(node)
                    await trio.sleep_forever()
        finally:
            stopped.set()

    async def add(self, initial_peers: Sequence[Any] = (), **options: Any) -> DHTNode:
        """Start one more node (not added to ``nodes`` if it is a client)."""
        node = await self._nursery.start(self._run, {"initial_peers": list(initial_peers), **options})
        if not node.client_mode:
            self.nodes.append(node)
        return node

    async def kill(self, node: DHTNode) -> None:
        """Stop ``node`` now: its listener closes and its connections drop."""
        scope, stopped = self._stops.pop(id(node))
        scope.cancel()
        await stopped.wait()
        if node in self.nodes:
            self.nodes.remove(node)


@asynccontextmanager
async def open_swarm(
    count: int,
    *,
    config: DHTConfig | None = None,
    seed: int | None = None,
    validators: Sequence[Any] = (),
) -> AsyncIterator[Swarm]:
    """``count`` nodes on 127.0.0.1, each bootstrapped from a random earlier one."""
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, config, validators)
        await swarm.add()
        for _ in range(count - 1):
            await swarm.add([swarm.nodes[rng.randrange(len(swarm.nodes))].address])
        try:
            yield swarm
        finally:
            nursery.cancel_scope.cancel()


def jaccard(a: Sequence[Any], b: Sequence[Any]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0
