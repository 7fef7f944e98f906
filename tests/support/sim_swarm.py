"""Real DHT nodes on a simulated internet (``peer/simnet``), for scenarios under trio's virtual clock.

Each node is a real ``PeerHost`` (Noise, RPC) with a real ``DHTNode`` on it, on its own simulated
host, reading ``TrioClock`` for record lifetimes; each runs in its own task, so that one can leave
(its machine switched off) while the others go on.

In a swarm opened with ``nat_fraction`` above 0, that share of the hosts (a seeded draw per
host) sit behind NAT (``peer/simnet/nat.py``), and every node runs ``NatTraversal`` as ``peerd
join`` does (dial-backs, relays for others while public, reservations and hole punching behind
NAT), its initial peers those of its DHT node.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from dht import DHTConfig, DHTNode
from peer import Router, open_peer_host
from peer.clock import TrioClock
from peer.nat import NatTraversal
from peer.simnet import SimNetwork, SimTransport
from peer.worker_threads import inline_blocking_work


class SimSwarm:
    def __init__(
        self, network: SimNetwork, nursery: trio.Nursery, clock: TrioClock, config: DHTConfig, nat_fraction: float
    ):
        self.network, self.clock, self.config = network, clock, config
        self.nat_fraction = nat_fraction
        self.nodes: list[DHTNode] = []
        self.transports: list[SimTransport] = []
        self.traversals: list[NatTraversal | None] = []
        self.behind_nat: set[int] = set()
        self._nursery = nursery
        self._scopes: list[trio.CancelScope] = []
        self._nat_draw = random.Random(f"peerd-sim-swarm-nat-{network.seed}")
        self.gone: set[int] = set()

    async def _run(self, transport: SimTransport, initial_peers: list, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            async with open_peer_host(self.network.identity(), router=Router(), transport=transport) as host:
                traversal = NatTraversal(host, initial_peers=initial_peers) if self.nat_fraction > 0 else None
                async with (
                    DHTNode.open(host=host, initial_peers=initial_peers, config=self.config, clock=self.clock) as node,
                    trio.open_nursery() as nursery,
                ):
                    if traversal is not None:
                        nursery.start_soon(traversal.run)
                    task_status.started((node, traversal, scope))
                    await trio.sleep_forever()

    async def add(self, initial_peers: list) -> DHTNode:
        """A new node, joining through ``initial_peers``; the first one is public (a swarm starts
        from a peer others can reach), any other behind NAT with the swarm's ``nat_fraction``."""
        (node,) = await self.add_many([initial_peers])
        return node

    async def add_many(self, initial_peers: list[list]) -> list[DHTNode]:
        """New nodes joining at once, the i-th through ``initial_peers[i]``; they take their
        indices in the order given (hosts and NAT draws too), whichever join ends first."""
        launches = []
        for peers in initial_peers:
            behind_nat = bool(self.nodes or launches) and self._nat_draw.random() < self.nat_fraction
            launches.append((self.network.add_host(behind_nat=behind_nat), peers, behind_nat))
        joined: dict[int, tuple] = {}

        async def launch(slot: int, transport: SimTransport, peers: list) -> None:
            joined[slot] = await self._nursery.start(self._run, transport, peers)

        async with trio.open_nursery() as nursery:
            for slot, (transport, peers, _) in enumerate(launches):
                nursery.start_soon(launch, slot, transport, peers)
        for slot, (transport, _, behind_nat) in enumerate(launches):
            node, traversal, scope = joined[slot]
            if behind_nat:
                self.behind_nat.add(len(self.nodes))
            self.nodes.append(node)
            self.transports.append(transport)
            self.traversals.append(traversal)
            self._scopes.append(scope)
        return [joined[slot][0] for slot in range(len(launches))]

    def address(self, index: int) -> str:
        return self.transports[index].address

    def leave(self, index: int) -> None:
        """Node ``index``'s machine goes off: off the network at once, its tasks cancelled."""
        self.network.leave(self.address(index))
        self._scopes[index].cancel()
        self.gone.add(index)

    def alive(self) -> list[int]:
        return [index for index in range(len(self.nodes)) if index not in self.gone]

    def entry_points(self, among: list[int]) -> list[int]:
        """Those of ``among`` a newcomer can be told to join through: the public ones (an
        ``--initial-peer`` is an address others can dial)."""
        return [index for index in among if index not in self.behind_nat]


@asynccontextmanager
async def open_sim_swarm(
    network: SimNetwork,
    size: int,
    *,
    config: DHTConfig | None = None,
    clock: TrioClock | None = None,
    joined: Callable[[int], None] | None = None,
    nat_fraction: float = 0.0,
    joins_at_once: int = 1,
) -> AsyncIterator[SimSwarm]:
    """``size`` nodes, each joining through a seeded choice of two earlier ones (``joined(index)``
    is called after each); ``nat_fraction`` of them behind NAT. After the first, nodes join
    ``joins_at_once`` at a time, each through nodes that joined before its batch: a swarm formed
    one join after another takes ~2.5 simulated seconds a node, so at thousands of nodes every
    node's periodic work (idle-connection looks, refreshes of buckets gone quiet) runs for hours
    of simulated time before the last one joins. Within the block blocking work runs on the event
    loop (``peer.worker_threads``), so that CPU time costs no simulated time."""
    if joins_at_once < 1:
        raise ValueError("at least one node joins at a time")
    choices = random.Random(f"peerd-sim-swarm-{network.seed}")  # not the model's own sequence
    with inline_blocking_work():
        async with trio.open_nursery() as nursery:
            swarm = SimSwarm(network, nursery, clock or TrioClock(), config or DHTConfig(), nat_fraction)
            start = 0
            while start < size:
                batch = range(start, min(size, start + joins_at_once) if start else 1)
                public = swarm.entry_points(list(range(start)))
                await swarm.add_many(
                    [[swarm.nodes[i].address for i in choices.sample(public, min(len(public), 2))] for _ in batch]
                )
                for index in batch:
                    if joined is not None:
                        joined(index)
                start = batch.stop
            yield swarm
            nursery.cancel_scope.cancel()
