"""A swarm training with the collaborative optimizer on the simulated internet, for the scale test.

Each peer is a real ``PeerHost`` + ``DHTNode`` (``tests/support/sim_swarm.py``) and a real
``CollaborativeOptimizer`` (progress through the DHT, Moshpit groups of ``group_size``, state
averaging every few epochs, state loading when behind) on a tiny model: a linear regression toward
one set of true weights, each peer drawing its own samples. Compute is modelled: a batch costs
``batch / samples_per_s`` simulated seconds, its gradient real (and, like all CPU here, no simulated
time). The target batch is ``epoch_batches`` batches of every peer, so an epoch takes about that
many batches' time at any swarm size. Matchmaking has the optimizer's default deadline (10 s;
with 3 s, 24 such peers averaged in 0.65-0.93 of their epochs, seeds 1-4) and progress is
exchanged every second (0.25 s, the default, averages as well here: 0.97-1.0).

While the swarm trains, ``churn_per_minute`` of it is replaced per simulated minute (a newcomer
joins through two public peers, loads the swarm's state as its optimizer finds itself behind,
and trains), and once, for ``partition_s``, the swarm is split in two halves. The run ends when
every peer that stayed has reached ``epochs``. The report counts what a swarm owes its users: the
share of the stayers' epochs whose round averaged (outside the partition), how far the stayers'
parameters are from each other and from the true weights, and how long each newcomer took from
its join to its first averaged round.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field

import torch
import trio

from averaging.match_ahead import MatchAhead
from averaging.optimizer import CollaborativeOptimizer
from peer.simnet import SimNetwork
from tests.support.sim_heap import one_heap_for_many_peers
from tests.support.sim_scale import join_newcomer
from tests.support.sim_swarm import SimSwarm, open_sim_swarm

__all__ = ["TrainingScenario", "TrainingReport", "run_training"]

PREFIX = "sim-training"
DIMENSIONS = 16
POLL_S = 1.0  # how often the run looks whether the stayers are done
# The swarm forms, then trains: a peer behind NAT learns so from its reachability check (5-10 s
# after it joins) and declares its private address until then (README, known limits).
WARM_UP_S = 15.0


@dataclass(frozen=True)
class TrainingScenario:
    peers: int
    group_size: int
    epochs: int = 10
    nat_fraction: float = 0.0
    churn_per_minute: float = 0.0
    partition_at: float | None = None  # simulated seconds into training
    partition_s: float = 20.0
    seed: int = 1
    batch: int = 32
    samples_per_s: float = 64.0  # each peer's modelled compute
    epoch_batches: int = 2
    matchmaking_timeout: float = 10.0
    averaging_timeout: float = 30.0
    give_up_s: float = 1800.0  # simulated: a swarm that has not finished by then has failed
    match_ahead: bool = False  # groups formed while the epoch accumulates, as ``peerd join`` forms them


@dataclass
class TrainingReport:
    stayers: int = 0
    least_epoch: int = 0  # the least epoch a stayer reached
    rounds_of_stayers: int = 0  # outside the partition
    averaged_rounds_of_stayers: int = 0
    # epochs before a stayer's current one that it has no round for (it caught up a round, or
    # loaded a donor's state): rounds of the swarm it took no part in, outside the partition
    skipped_epochs_of_stayers: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)  # why rounds did not average
    departures: int = 0
    newcomers: int = 0  # joined and training
    newcomers_joining: int = 0  # still joining when the run ended
    join_failures: int = 0  # every try to join failed
    newcomer_first_average_s: list[float] = field(default_factory=list)
    # newcomers that left, or were still training when the run ended, before they averaged: how long they had
    newcomers_unaveraged_s: list[float] = field(default_factory=list)
    error_before: float = 0.0  # the stayers' largest distance from the true weights, at the start
    error_after: float = 0.0  # and at the end
    spread: float = 0.0  # the stayers' largest distance from their mean, at the end
    partition_healed: bool = False  # the swarm was split, then healed, while it trained
    training_s: float = 0.0  # simulated
    cpu_s: float = 0.0

    @property
    def averaged_fraction(self) -> float:
        return self.averaged_rounds_of_stayers / max(self.rounds_of_stayers, 1)

    @property
    def averaged_fraction_of_epochs(self) -> float:
        """The same share with every epoch a stayer skipped counted as one it did not average in:
        it took no part in the swarm's round (a peer that caught up put its samples into the next
        round's average; one that loaded a donor's state, nowhere)."""
        return self.averaged_rounds_of_stayers / max(self.rounds_of_stayers + self.skipped_epochs_of_stayers, 1)


class Learner:
    """One peer's model, optimizer, samples and record of rounds (epoch -> averaged, failure)."""

    def __init__(self, scenario: TrainingScenario, node, index: int, background: trio.Nursery):
        self.model = torch.nn.Linear(DIMENSIONS, 1)
        start = torch.Generator().manual_seed(scenario.seed + 7_919)  # one initial model, on every peer
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(torch.randn(param.shape, generator=start))
        self.optimizer = CollaborativeOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=0.3),
            node,
            prefix=PREFIX,
            target_batch_size=scenario.batch * scenario.peers * scenario.epoch_batches,
            target_group_size=scenario.group_size,
            matchmaking_timeout=scenario.matchmaking_timeout,
            averaging_timeout=scenario.averaging_timeout,
            progress_interval=1.0,
            matching=MatchAhead(background) if scenario.match_ahead else None,
        )
        self.samples = torch.Generator().manual_seed(scenario.seed * 100_003 + index)
        self.rounds: dict[int, tuple[bool, str | None]] = {}

    def weights(self) -> torch.Tensor:
        return self.model.weight.detach().flatten()

    async def train(self, scenario: TrainingScenario, truth: torch.Tensor) -> None:
        while True:
            inputs = torch.randn(scenario.batch, DIMENSIONS, generator=self.samples)
            targets = inputs @ truth + 0.1 * torch.randn(scenario.batch, generator=self.samples)
            ((self.model(inputs).squeeze(-1) - targets) ** 2).mean().backward()
            await trio.sleep(scenario.batch / scenario.samples_per_s)
            await self.optimizer.step(scenario.batch)
            record = self.optimizer.last_round
            if record is not None:
                self.rounds[record.epoch] = (record.averaged, record.failure)


class TrainingRun:
    """The live learners of a run, churn and newcomers."""

    def __init__(self, scenario: TrainingScenario, swarm: SimSwarm, nursery: trio.Nursery, report: TrainingReport):
        self.scenario, self.swarm, self.nursery, self.report = scenario, swarm, nursery, report
        self.truth = torch.randn(DIMENSIONS, generator=torch.Generator().manual_seed(scenario.seed))
        self.picks = random.Random(f"sim-training-{scenario.seed}")
        self.learners: dict[int, Learner] = {}
        self.scopes: dict[int, trio.CancelScope] = {}
        self.joined_at: dict[int, float] = {}  # newcomers not yet averaged: when they joined
        self.partitioned: dict[int, tuple[int, int]] = {}  # epochs (first, last) a peer spent split
        self.joining = 0  # newcomers joining now

    async def start(self, index: int) -> None:
        scope = self.scopes[index] = trio.CancelScope()

        async def train(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                async with trio.open_nursery() as background:  # (the learner's own: its groups formed ahead)
                    learner = self.learners[index] = Learner(self.scenario, self.swarm.nodes[index], index, background)
                    task_status.started()
                    await learner.train(self.scenario, self.truth)

        await self.nursery.start(train)

    def live(self) -> list[int]:
        return [index for index in self.learners if index not in self.swarm.gone]

    def stayers(self) -> list[int]:
        return [index for index in range(self.scenario.peers) if index not in self.swarm.gone]

    def epoch(self, index: int) -> int:
        return self.learners[index].optimizer.epoch

    async def churn(self) -> None:
        """Replace a peer every ``60 / (churn x peers)`` simulated seconds (on average)."""
        period = 60.0 / (self.scenario.churn_per_minute * self.scenario.peers)
        while True:
            await trio.sleep(self.picks.expovariate(1.0 / period))
            leaving = self.picks.choice([index for index in self.live() if index != 0])
            self.swarm.leave(leaving)
            self.scopes[leaving].cancel()
            self.report.departures += 1
            joined = self.joined_at.pop(leaving, None)
            if joined is not None:
                self.report.newcomers_unaveraged_s.append(trio.current_time() - joined)
            self.joining += 1
            self.nursery.start_soon(self.newcomer)

    async def newcomer(self) -> None:
        joined = trio.current_time()  # (counted in ``joining`` by ``churn``, which started it)
        try:
            node, _ = await join_newcomer(self.swarm, self.live, self.picks)
        finally:
            self.joining -= 1
        if node is None:
            self.report.join_failures += 1
            return
        index = self.swarm.nodes.index(node)
        self.joined_at[index] = joined
        self.report.newcomers += 1
        await self.start(index)

    async def watch_newcomers(self) -> None:
        while True:
            await trio.sleep(POLL_S)
            for index, joined in list(self.joined_at.items()):
                learner = self.learners.get(index)  # (None: its learner is starting)
                if learner is not None and any(averaged for averaged, _ in learner.rounds.values()):
                    self.report.newcomer_first_average_s.append(trio.current_time() - joined)
                    del self.joined_at[index]

    async def partition(self, network: SimNetwork) -> None:
        await trio.sleep(self.scenario.partition_at)
        live = self.live()
        before = {index: self.epoch(index) for index in live}
        half = len(live) // 2
        network.partition([self.swarm.address(i) for i in live[:half]], [self.swarm.address(i) for i in live[half:]])
        await trio.sleep(self.scenario.partition_s)
        network.heal_partition()
        self.report.partition_healed = True
        # the round in flight at the heal may still fail on the split's account
        self.partitioned = {i: (before[i], self.epoch(i) + 1) for i in live if i not in self.swarm.gone}

    def count(self) -> None:
        report = self.report
        stayers = self.stayers()
        report.stayers = len(stayers)
        report.least_epoch = min(self.epoch(index) for index in stayers)
        for index in stayers:
            first, last = self.partitioned.get(index, (-1, -2))
            rounds = self.learners[index].rounds
            for epoch, (averaged, failure) in rounds.items():
                if first <= epoch <= last:
                    continue
                report.rounds_of_stayers += 1
                report.averaged_rounds_of_stayers += averaged
                if not averaged:
                    report.failures[failure] += 1
            # (every epoch before its current one had a round; the last may not be recorded yet: its
            # step still averages the state)
            optimizer = self.learners[index].optimizer
            done = rounds.keys() | ({optimizer.last_round.epoch} if optimizer.last_round else set())
            passed_over = [epoch for epoch in range(optimizer.epoch) if epoch not in done]
            report.skipped_epochs_of_stayers += sum(1 for epoch in passed_over if not first <= epoch <= last)
        weights = torch.stack([self.learners[index].weights() for index in stayers])
        report.error_after = float((weights - self.truth).abs().max())
        report.spread = float((weights - weights.mean(0)).abs().max())


async def run_training(scenario: TrainingScenario) -> TrainingReport:
    """Run ``scenario`` (under a ``MockClock``) and report what the swarm did."""
    with one_heap_for_many_peers():
        return await _run(scenario, SimNetwork(seed=scenario.seed))


async def _run(scenario: TrainingScenario, network: SimNetwork) -> TrainingReport:
    report = TrainingReport()
    swarm_options = {"nat_fraction": scenario.nat_fraction}
    async with open_sim_swarm(network, scenario.peers, **swarm_options) as swarm, trio.open_nursery() as nursery:
        run = TrainingRun(scenario, swarm, nursery, report)
        await trio.sleep(WARM_UP_S)
        for index in range(scenario.peers):
            await run.start(index)
        report.error_before = float((run.learners[0].weights() - run.truth).abs().max())
        began, cpu_before = trio.current_time(), time.process_time()
        nursery.start_soon(run.watch_newcomers)
        if scenario.churn_per_minute > 0:
            nursery.start_soon(run.churn)
        if scenario.partition_at is not None:
            nursery.start_soon(run.partition, network)
        with trio.move_on_after(scenario.give_up_s):
            while min(run.epoch(index) for index in run.stayers()) < scenario.epochs:
                await trio.sleep(POLL_S)
        report.training_s = trio.current_time() - began
        report.cpu_s = time.process_time() - cpu_before
        run.count()
        report.newcomers_joining = run.joining
        report.newcomers_unaveraged_s.extend(trio.current_time() - t for t in run.joined_at.values())
        nursery.cancel_scope.cancel()
    return report
