"""A swarm of many real averaging peers on the simulated internet, for the scale test and
``benchmarks/scale.py``.

Each peer is a real ``PeerHost`` + ``DHTNode`` + ``GroupAverager`` on its own simulated host
(``tests/support/sim_swarm.py``), averaging a vector of ``values`` floats in Moshpit groups of
``group_size``. A run has three phases, all under trio's virtual clock:

1. **Join**: the peers join one after another, each through two earlier ones.
2. **Turbulent rounds**: every live peer steps together, while ``churn_per_minute`` of the swarm
   is replaced per simulated minute (a peer's machine goes off; a newcomer joins, loads the
   swarm's state from a donor and steps from the next round on), and one round
   (``partition_round``) runs with the swarm split in two halves, healed after it.
3. **Calm rounds**: no churn, until every peer holds the mean of the values (within ``tolerance``
   of the spread) or ``calm_rounds`` ran out.

What the report counts is what a swarm owes its users: the fraction of the steps of peers that
stayed (they were present for the whole round) that averaged, outside the partitioned round; how
many calm rounds the swarm took to agree; how long a newcomer took from its join to its first
averaged round; per peer per round: CPU seconds, bytes and segments sent; the DHT requests served
by the busiest node against the median node (of the DHT's servers: peers behind NAT are its clients).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from averaging.averager import GroupAverager
from dht import DHTBootstrapError, DHTConfig
from peer.simnet import SimNetwork
from tests.support.sim_heap import one_heap_for_many_peers, settle
from tests.support.sim_swarm import SimSwarm, open_sim_swarm

__all__ = ["Scenario", "ScaleReport", "run_scenario"]

PREFIX = "sim-scale"
JOIN_TRIES, JOIN_RETRY_S = 5, 10.0


@dataclass(frozen=True)
class Scenario:
    peers: int
    group_size: int = 16
    turbulent_rounds: int = 2
    calm_rounds: int = 4
    values: int = 256
    churn_per_minute: float = 0.0  # fraction of the swarm replaced per simulated minute
    partition_round: int | None = None  # a turbulent round that runs split in two halves
    nat_fraction: float = 0.0  # of the peers, behind NAT (relays and hole punching: sim_swarm.py)
    tolerance: float = 1e-3  # agreement: every peer within this fraction of the initial spread
    round_timeout: float = 60.0
    matchmaking_timeout: float = 15.0
    seed: int = 0


@dataclass
class ScaleReport:
    peers: int
    join_s: float = 0.0  # simulated seconds for everyone to join
    steps_of_stayers: int = 0
    averaged_steps_of_stayers: int = 0
    partition_round_averaged: float | None = None  # fraction of stayers averaged while split
    rounds_to_agree: int | None = None
    departures: int = 0
    newcomers: int = 0
    join_retries: int = 0
    newcomer_first_average_s: list[float] = field(default_factory=list)  # join -> first averaged round
    newcomers_gone_unaveraged_s: list[float] = field(default_factory=list)  # join -> left, not averaged
    cpu_s: float = 0.0  # process CPU over the rounds
    peer_rounds: int = 0
    bytes_sent: int = 0
    segments_sent: int = 0
    # DHT requests served over the rounds per live DHT server (peers behind NAT are the DHT's clients)
    served: list[int] = field(default_factory=list)
    dht_requests: int = 0  # served by every node over the rounds, departed ones included
    connections: int = 0  # made over the rounds (each one handshake)
    max_deviation: float = math.inf  # at the end, as a fraction of the initial spread
    behind_nat: int = 0  # peers behind NAT, newcomers included
    steps_behind_nat: int = 0  # of the stayers' steps counted above, those of peers behind NAT
    averaged_steps_behind_nat: int = 0
    punched: int = 0  # direct connections that hole punching made
    # per round: its simulated seconds, and those of its slowest stayer's step (a departed peer's
    # step ends with its machine: a round lasts as long as its stayers' steps)
    round_s: list[float] = field(default_factory=list)
    slowest_stayer_s: list[float] = field(default_factory=list)

    @property
    def averaged_fraction(self) -> float:
        return self.averaged_steps_of_stayers / max(self.steps_of_stayers, 1)

    @property
    def averaged_fraction_behind_nat(self) -> float | None:
        return self.averaged_steps_behind_nat / self.steps_behind_nat if self.steps_behind_nat else None

    @property
    def cpu_per_peer_round(self) -> float:
        return self.cpu_s / max(self.peer_rounds, 1)

    @property
    def dht_requests_per_peer_round(self) -> float:
        """The swarm's requests (leavers' and newcomers' included) over the stayers' peer-rounds,
        as the CPU and bytes are counted."""
        return self.dht_requests / max(self.peer_rounds, 1)

    @property
    def connections_per_peer_round(self) -> float:
        return self.connections / max(self.peer_rounds, 1)

    @property
    def busiest_node_load_ratio(self) -> float:
        if not self.served:
            return 0.0
        return max(self.served) / max(statistics.median(self.served), 1.0)


class ScaleRun:
    """The live peers of a run, their averagers and what the report counts."""

    def __init__(self, scenario: Scenario, swarm: SimSwarm, report: ScaleReport, newcomers: trio.Nursery):
        self.scenario, self.swarm, self.report = scenario, swarm, report
        self.picks = random.Random(f"sim-scale-{scenario.seed}")
        self.averagers: dict[int, GroupAverager] = {}
        self.joined_at: dict[int, float] = {}  # newcomers: when they joined
        self.stepping: dict[int, trio.CancelScope] = {}  # the round's steps, which a departure ends
        self.generator = torch.Generator().manual_seed(scenario.seed)

        self.options = {
            "prefix": PREFIX,
            "target_group_size": scenario.group_size,
            "matchmaking_timeout": scenario.matchmaking_timeout,
            "aggregation": "mean",  # the scenario checks exact agreement; robust rounds are tested elsewhere
        }
        self.newcomers = newcomers

    def start(self, values: list[torch.Tensor]) -> None:
        for index, vector in enumerate(values):
            self.averagers[index] = GroupAverager([vector.clone()], self.swarm.nodes[index], **self.options)

    def live(self) -> list[int]:
        return [index for index in self.averagers if index not in self.swarm.gone]

    async def step_everyone(self, churn: bool) -> tuple[set[int], set[int]]:
        """One round: every live peer steps (churn going on meanwhile, if asked); returns the
        peers that stayed for the whole round and those of them that averaged."""
        present = set(self.live())
        averaged: set[int] = set()
        started, ended = trio.current_time(), {}

        async def step(index: int) -> None:
            with trio.CancelScope() as self.stepping[index]:  # (the peer's machine may go off meanwhile)
                try:
                    await self.averagers[index].step(timeout=self.scenario.round_timeout)
                except Exception:  # a failed round (the swarm is turbulent): counted, not raised
                    return
                finally:
                    self.stepping.pop(index, None)
                    ended[index] = trio.current_time()
                averaged.add(index)
                if index in self.joined_at:
                    self.report.newcomer_first_average_s.append(trio.current_time() - self.joined_at.pop(index))

        async with trio.open_nursery() as round_nursery:
            if churn and self.scenario.churn_per_minute > 0:
                round_nursery.start_soon(self.churn)
            with trio.move_on_after(self.scenario.round_timeout + 30):
                async with trio.open_nursery() as steps:
                    for index in sorted(present):
                        steps.start_soon(step, index)
            round_nursery.cancel_scope.cancel()
        stayed = present - self.swarm.gone
        self.report.round_s.append(trio.current_time() - started)
        self.report.slowest_stayer_s.append(
            max((ended.get(i, trio.current_time()) for i in stayed), default=started) - started
        )
        return stayed, averaged & stayed

    async def churn(self) -> None:
        """Replace a peer every ``60 / (churn x peers)`` simulated seconds (on average)."""
        period = 60.0 / (self.scenario.churn_per_minute * self.scenario.peers)
        while True:
            await trio.sleep(self.picks.expovariate(1.0 / period))
            candidates = [index for index in self.live() if index != 0]
            leaving = self.picks.choice(candidates)
            self.swarm.leave(leaving)
            if (stepping := self.stepping.pop(leaving, None)) is not None:
                stepping.cancel()  # its process is gone with its machine
            self.report.departures += 1
            joined = self.joined_at.pop(leaving, None)
            if joined is not None:  # a newcomer leaves before it averaged: how long it had
                self.report.newcomers_gone_unaveraged_s.append(trio.current_time() - joined)
            self.newcomers.start_soon(self.newcomer)

    async def newcomer(self) -> None:
        """A fresh peer joins through two live public ones and loads the swarm's state from a
        donor; it steps from the round after that."""
        joined = trio.current_time()
        node, retries = await join_newcomer(self.swarm, self.live, self.picks)
        self.report.join_retries += retries
        if node is None:
            return
        index = len(self.swarm.nodes) - 1
        assert self.swarm.nodes[index] is node
        averager = GroupAverager([torch.zeros(self.scenario.values)], node, **self.options)
        try:
            await averager.load_state_from_peers(timeout=30.0)
        except Exception:
            pass  # it averages from its own values then
        self.averagers[index] = averager
        self.joined_at[index] = joined
        self.report.newcomers += 1


async def run_scenario(scenario: Scenario, network: SimNetwork | None = None) -> ScaleReport:
    """Run ``scenario`` (under a ``MockClock``) and report what the swarm did; the N peers'
    garbage is collected as N processes' would be (``sim_heap.py``)."""
    with one_heap_for_many_peers():
        return await _run(scenario, network or SimNetwork(seed=scenario.seed))


async def _run(scenario: Scenario, network: SimNetwork) -> ScaleReport:
    report = ScaleReport(scenario.peers)
    swarm_options = {"config": DHTConfig(), "nat_fraction": scenario.nat_fraction}
    async with open_sim_swarm(network, scenario.peers, **swarm_options) as swarm, trio.open_nursery() as newcomers:
        report.join_s = trio.current_time()
        run = ScaleRun(scenario, swarm, report, newcomers)
        initial = [torch.randn(scenario.values, generator=run.generator) for _ in range(scenario.peers)]
        run.start(initial)
        spread = float((torch.stack(initial).max(0).values - torch.stack(initial).min(0).values).max())
        served_before = {index: swarm.nodes[index].requests_served for index in range(scenario.peers)}
        sent_before = network.model.bytes_sent_total, network.model.segments_sent_total
        connections_before = network.connections_total
        cpu_before = time.process_time()
        for number in range(scenario.turbulent_rounds):
            split = number == scenario.partition_round
            settle()
            if split:
                live = run.live()
                half = len(live) // 2
                network.partition([swarm.address(i) for i in live[:half]], [swarm.address(i) for i in live[half:]])
            stayed, averaged = await run.step_everyone(churn=True)
            report.peer_rounds += len(stayed)
            if split:
                network.heal_partition()
                report.partition_round_averaged = len(averaged) / max(len(stayed), 1)
            else:
                count_steps(report, swarm, stayed, averaged)
        with trio.move_on_after(60):  # the last newcomers finish joining before the calm
            while newcomers.child_tasks:
                await trio.sleep(0.5)
        for number in range(scenario.calm_rounds):
            settle()
            stayed, averaged = await run.step_everyone(churn=False)
            report.peer_rounds += len(stayed)
            count_steps(report, swarm, stayed, averaged)
            report.max_deviation = deviation(run) / spread
            if report.max_deviation <= scenario.tolerance:
                report.rounds_to_agree = number + 1
                break
        report.cpu_s = time.process_time() - cpu_before
        report.bytes_sent = network.model.bytes_sent_total - sent_before[0]
        report.segments_sent = network.model.segments_sent_total - sent_before[1]
        servers = [index for index in swarm.alive() if index not in swarm.behind_nat]
        report.served = [swarm.nodes[index].requests_served - served_before.get(index, 0) for index in servers]
        report.dht_requests = sum(node.requests_served for node in swarm.nodes) - sum(served_before.values())
        report.connections = network.connections_total - connections_before
        report.behind_nat = len(swarm.behind_nat)
        report.punched = sum(t.puncher.successes for t in swarm.traversals if t is not None)
        newcomers.cancel_scope.cancel()
    return report


def count_steps(report: ScaleReport, swarm: SimSwarm, stayed: set[int], averaged: set[int]) -> None:
    report.steps_of_stayers += len(stayed)
    report.averaged_steps_of_stayers += len(averaged)
    report.steps_behind_nat += len(stayed & swarm.behind_nat)
    report.averaged_steps_behind_nat += len(averaged & swarm.behind_nat)


async def join_newcomer(swarm: SimSwarm, live: Callable[[], list[int]], picks: random.Random) -> tuple[Any, int]:
    """A fresh node, joined through two of the ``live()`` public peers; a try whose entry peers are
    beyond a partition is retried through two others later. Returns the node (None: every try
    failed) and how many tries failed."""
    for failed in range(JOIN_TRIES):
        public = swarm.entry_points(live())
        entry = picks.sample(public, min(2, len(public)))
        try:
            return await swarm.add([swarm.nodes[i].address for i in entry]), failed
        except Exception as error:
            if not bootstrap_failure(error):
                raise
            await trio.sleep(JOIN_RETRY_S)
    return None, JOIN_TRIES


def bootstrap_failure(error: BaseException) -> bool:
    """``error`` is a DHT bootstrap failure, perhaps inside (nested) exception groups."""
    inner = getattr(error, "exceptions", None)  # an exception group's
    if inner:
        return all(bootstrap_failure(one) for one in inner)
    return isinstance(error, DHTBootstrapError)


def deviation(run: ScaleRun) -> float:
    """The largest distance of any live peer's values from the live peers' mean."""
    vectors = torch.stack([run.averagers[index].tensors[0] for index in run.live()])
    return float((vectors - vectors.mean(0)).abs().max())
