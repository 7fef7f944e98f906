"""The in-process swarm of ``benchmarks/byzantine.py``: real hosts, real all-reduce services and
reducer checks on 127.0.0.1, one process, training the digits task while some peers attack.

``gradient`` mode (collaborative training): an epoch is one batch of 32 per peer; the peers
average their gradients in one round and each applies the average with its own Adam. ``local``
mode (local updates, DiLoCo): a round is ``LOCAL_STEPS`` Adam steps per peer on its own batches;
the peers average their pseudo-gradients (``start - params``) and each takes peerd's outer step
(``OuterStep``: Nesterov SGD from the shared start, momentum 0.9, at ``Case.outer_lr``, ``OUTER_LR`` by
default).

Attackers are the last f peers. They compute their own update as honest peers do (on flipped
labels for label flipping), then, knowing every honest update of the round, send their attack's
(``attacks.py``); all attackers of a run send the same attack, except the loud ones, which take
turns through ``LOUD``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import trio

from averaging.allreduce import AllReduceService, RoundSettings
from averaging.group import AveragingMode, GroupInfo, GroupMember
from averaging.outer_step import OuterStep
from averaging.robust import Aggregation
from peer import Identity, open_peer_host
from peerd.tasks import Task
from tests.support.hostile_reducers import LyingShard

from .attacks import LOUD, QUIET, Attack, flip_labels
from .shards import peer_task

__all__ = ["Case", "RunResult", "run_swarm", "MODES", "LATE_SHARE", "LOCAL_STEPS", "OUTER_LR"]

MODES = ("gradient", "local")
HOSTILE_WEIGHT = float(2**40)
LOCAL_STEPS = 5  # inner steps per local-updates round: few, so the quick runs see many rounds
# Local mode's outer step: Nesterov 0.9 as ``LocalUpdatesOptimizer``'s default, at lr 0.35, not its
# default (DiLoCo's 0.7, tuned for hundreds of inner steps). With 5 inner steps, 0.7 lies past this
# task's stable outer step: clean runs of 100 rounds on label-skewed shards end anywhere in
# 0.92-0.97 (0.970 at 0.35; 50 rounds, 4 initial models: 0.946 at 0.7, 0.961 at 0.35, 0.968 at 0.5,
# 0.873 at 1.0; iid 0.966 / 0.974 / 0.971 / 0.912), and a quiet minority's bounded pull, which a
# steady swarm absorbs, keeps this one swinging: 2 of 8 sending min-max (p = -std) take the honest peers
# from 0.953 to 0.804 in 100 rounds at 0.7, from 0.970 to 0.962 at 0.35 (0.968 to 0.926 in 50
# rounds at 0.5). ``--outer-lr`` runs another.
OUTER_LR, OUTER_MOMENTUM = 0.35, 0.9
# A round's deadlines: generous for 16 peers sharing 2 cores, only there to catch hangs.
SENDER_TIMEOUT = 20.0
REDUCER_TIMEOUT = 40.0
LATE_SHARE = 0.1  # ``RunResult.late_accuracy``: the rounds it averages, as a share of the run's


@dataclass(frozen=True)
class Case:
    """One run: ``attack`` names a quiet attack (``QUIET``), ``"loud"`` (part 1's attacks in
    turn) or None (no attacker)."""

    peers: int
    attackers: int
    attack: str | None
    aggregation: str = "centered-clip"  # a public swarm's rule (or centered-clip-mixed, mean)
    checks: bool = True
    sharding: str = "iid"
    mode: str = "gradient"
    seed: int = 0  # 0: the task's own initial model; another: every peer's model drawn from it
    scored: bool = False  # honest reducers score contributions against a validation split's loss
    outer_lr: float = OUTER_LR  # local mode's outer learning rate

    @property
    def rule(self) -> Aggregation:
        return Aggregation(self.aggregation)

    def attack_of(self, index: int) -> Attack | None:
        first = self.peers - self.attackers
        if index < first or self.attack is None:
            return None
        return LOUD[(index - first) % len(LOUD)] if self.attack == "loud" else QUIET[self.attack]


@dataclass
class SwarmPeer:
    index: int
    host: object
    service: AllReduceService
    task: Task
    optimizer: torch.optim.Optimizer
    outer: OuterStep | None  # local mode's outer step
    attack: Attack | None = None  # None: honest
    validation: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None  # scored cases' held-out batches

    @property
    def peer_id(self):
        return self.host.peer_id


@dataclass
class RunResult:
    accuracy: float
    caught: int
    liars: int
    caught_after: int | None
    round_cpu: list[float] = field(default_factory=list)
    round_wall: list[float] = field(default_factory=list)
    honest_banned: int = 0  # honest peers some honest peer banned (false verdicts)
    # The honest peers' mean accuracy over the last ``LATE_SHARE`` of the rounds: on skewed shards
    # the accuracy swings by up to 0.04 from one round to the next, so one round's reading depends
    # on where the swing stands when the run ends.
    late_accuracy: float = 0.0


def batch(peer: SwarmPeer) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = next(peer.task.batches)
    return (inputs, flip_labels(targets)) if peer.attack and peer.attack.flips_labels else (inputs, targets)


def own_update(peer: SwarmPeer) -> torch.Tensor:
    """This peer's honest update: its gradient on one batch, or its pseudo-gradient after a round
    of local steps."""
    model, task = peer.task.model, peer.task
    if peer.outer is None:
        model.zero_grad()
        task.loss_fn(model, batch(peer)).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for _ in range(LOCAL_STEPS):
        peer.optimizer.zero_grad()
        task.loss_fn(model, batch(peer)).backward()
        peer.optimizer.step()
    peer.outer.compute_deltas()
    return torch.cat([delta.reshape(-1) for delta in peer.outer.deltas])


def apply(peer: SwarmPeer, averaged: torch.Tensor) -> None:
    targets = [p.grad for p in peer.task.model.parameters()] if peer.outer is None else peer.outer.deltas
    offset = 0
    for target in targets:
        target.copy_(averaged[offset : offset + target.numel()].view_as(target))
        offset += target.numel()
    if peer.outer is None:
        peer.optimizer.step()
    else:
        peer.outer.apply()


def reference(peer: SwarmPeer) -> list[torch.Tensor] | None:
    """The gradient of a validation batch's loss (the task's ``validation_batches``) where this
    round's updates start from: taken before the round's steps, the parameters are that point in
    both modes (in local mode, the shared start). What the peer scores the others' contributions
    against (``averaging/contribution_scores.py``); None for a peer that does not."""
    if peer.validation is None or peer.attack is not None:
        return None
    params = list(peer.task.model.parameters())
    loss = peer.task.loss_fn(peer.task.model, next(peer.validation))
    return [g.detach() for g in torch.autograd.grad(loss, params)]


def updates(members: list[SwarmPeer]) -> dict[int, torch.Tensor]:
    """What each member sends this round: honest peers their own update; attackers their attack's,
    computed from every honest update of the round."""
    own = {p.index: own_update(p) for p in members}
    honest = torch.stack([own[p.index] for p in members if p.attack is None])
    n, f = len(members), sum(1 for p in members if p.attack is not None)
    return {p.index: p.attack.update(own[p.index], honest, n, f) if p.attack else own[p.index] for p in members}


async def run_round(
    members: list[SwarmPeer],
    vectors: dict[int, torch.Tensor],
    settings: RoundSettings,
    references: dict[int, list[torch.Tensor] | None],
) -> None:
    group = GroupInfo(
        os.urandom(16),
        tuple(GroupMember(p.peer_id, p.host.listen_address, 1.0, AveragingMode.NODE) for p in members),
    )

    async def one(p: SwarmPeer) -> None:
        weight = HOSTILE_WEIGHT if p.attack and p.attack.loud else 1.0
        reference = references.get(p.index)  # (flattened by the service, in the vector's order)
        await p.service.run(group, [vectors[p.index]], weight=weight, settings=settings, reference=reference)

    async with trio.open_nursery() as nursery:
        for p in members:
            nursery.start_soon(one, p)


async def run_swarm(case: Case, epochs: int) -> RunResult:
    """Train ``epochs`` epochs (gradient mode) or rounds (local mode) under ``case``'s attack;
    groups are formed as matchmaking forms them once peers ban each other: without any peer that
    an honest member has caught (``averaging/verification.py``)."""
    torch.manual_seed(1 + case.seed)
    settings = RoundSettings(
        aggregation=case.rule,
        check_reducers=case.checks and case.rule.robust,
        sender_timeout=SENDER_TIMEOUT,
        reducer_timeout=REDUCER_TIMEOUT,
    )
    peers: list[SwarmPeer] = []
    async with trio.open_nursery() as nursery:

        async def run_peer(index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with open_peer_host(Identity.generate()) as host:
                attack = case.attack_of(index)
                lying = attack is not None and attack.loud
                service = AllReduceService(host, shard_type=LyingShard) if lying else AllReduceService(host)
                task = peer_task(index, case.peers, case.sharding)
                if case.seed:  # the same draw for every peer: they still start from one model
                    torch.manual_seed(case.seed)
                    for module in task.model.modules():
                        if hasattr(module, "reset_parameters"):
                            module.reset_parameters()
                params = list(task.model.parameters())
                outer = OuterStep(params, lr=case.outer_lr, momentum=OUTER_MOMENTUM) if case.mode == "local" else None
                validation = task.validation_batches if case.scored else None
                peer = SwarmPeer(index, host, service, task, task.make_optimizer(params), outer, attack, validation)
                task_status.started(peer)
                await trio.sleep_forever()

        for index in range(case.peers):
            peers.append(await nursery.start(run_peer, index))
        honest = [p for p in peers if p.attack is None]
        liars = {p.peer_id for p in peers if p.attack is not None}
        result = RunResult(0.0, 0, len(liars), None)
        everyone = {p.peer_id for p in peers}
        late: list[float] = []
        for epoch in range(epochs):
            banned = {peer for p in honest for peer in everyone if peer in p.service.checks.banned}
            if liars <= banned and result.caught_after is None and liars:
                result.caught_after = epoch
            members = [p for p in peers if p.peer_id not in banned]
            references = {p.index: reference(p) for p in members}
            vectors = updates(members)
            cpu, wall = time.process_time(), time.perf_counter()
            await run_round(members, vectors, settings, references)
            result.round_cpu.append(time.process_time() - cpu)
            result.round_wall.append(time.perf_counter() - wall)
            for p in members:
                apply(p, vectors[p.index])
            if epoch >= epochs - max(1, round(epochs * LATE_SHARE)):
                late.append(statistics.fmean(p.task.evaluate(p.task.model)["accuracy"] for p in honest))
        result.accuracy, result.late_accuracy = late[-1], statistics.fmean(late)
        result.caught = sum(1 for peer in liars if any(peer in p.service.checks.banned for p in honest))
        banned = {peer for p in honest for peer in everyone if peer in p.service.checks.banned}
        result.honest_banned = len(banned - liars)
        nursery.cancel_scope.cancel()
    return result
