"""Real DHT nodes on a simulated internet (``peer/simnet``), for scenarios under trio's virtual clock.

Each node is a real ``PeerHost`` (Noise, RPC) with a real ``DHTNode`` on it, on its own simulated
host, reading ``TrioClock`` for record lifetimes; each runs in its own task, so that one can leave
(its machine switched off) while the others go on.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from dht import DHTConfig, DHTNode
from peer import Router, open_peer_host
from peer.clock import TrioClock
from peer.simnet import SimNetwork, SimTransport
from peer.worker_threads import inline_blocking_work


class SimSwarm:
    def __init__(self, network: SimNetwork, nursery: trio.Nursery, clock: TrioClock, config: DHTConfig):
        self.network, self.clock, self.config = network, clock, config
        self.nodes: list[DHTNode] = []
        self.transports: list[SimTransport] = []
        self._nursery = nursery
        self._scopes: list[trio.CancelScope] = []
        self.gone: set[int] = set()

    async def _run(self, transport: SimTransport, initial_peers: list, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            async with open_peer_host(self.network.identity(), router=Router(), transport=transport) as host:
                async with DHTNode.open(
                    host=host, initial_peers=initial_peers, config=self.config, clock=self.clock
                ) as node:
                    task_status.started((node, scope))
                    await trio.sleep_forever()

    async def add(self, initial_peers: list) -> DHTNode:
        transport = self.network.add_host()
        node, scope = await self._nursery.start(self._run, transport, initial_peers)
        self.nodes.append(node)
        self.transports.append(transport)
        self._scopes.append(scope)
        return node

    def address(self, index: int) -> str:
        return self.transports[index].address

    def leave(self, index: int) -> None:
        """Node ``index``'s machine goes off: off the network at once, its tasks cancelled."""
        self.network.leave(self.address(index))
        self._scopes[index].cancel()
        self.gone.add(index)

    def alive(self) -> list[int]:
        return [index for index in range(len(self.nodes)) if index not in self.gone]


@asynccontextmanager
async def open_sim_swarm(
    network: SimNetwork,
    size: int,
    *,
    config: DHTConfig | None = None,
    clock: TrioClock | None = None,
    joined: Callable[[int], None] | None = None,
) -> AsyncIterator[SimSwarm]:
    """``size`` nodes, joined one after another, each through a seeded choice of the earlier ones
    (``joined(index)`` is called after each). Within the block blocking work runs on the event loop
    (``peer.worker_threads``), so that CPU time costs no simulated time."""
    choices = random.Random(f"peerd-sim-swarm-{network.seed}")  # not the model's own sequence
    with inline_blocking_work():
        async with trio.open_nursery() as nursery:
            swarm = SimSwarm(network, nursery, clock or TrioClock(), config or DHTConfig())
            for index in range(size):
                earlier = [swarm.nodes[i].address for i in choices.sample(range(index), min(index, 2))]
                await swarm.add(earlier)
                if joined is not None:
                    joined(index)
            yield swarm
            nursery.cancel_scope.cancel()
