"""Byzantine peers: 8 in-process peers train the digits task while f of them attack.

    python benchmarks/byzantine.py [--quick] [--peers 8] [--epochs E]

Every peer is a real host with its own all-reduce service on 127.0.0.1 (Noise-encrypted streams,
the real reducers, the real reducer checks), in one process. An epoch: each peer computes its
gradient on one batch (32 samples of its shard of the data: the task's swarm batch of 256 over 8
peers), the peers average their gradients in one all-reduce round, and each applies the average
with its own Adam (the task's optimizer). Every peer starts from the same model.

Attackers (the last f peers; f = 1, 2, 3) each claim weight 2**40 and send, in turn:
``scaled`` (their gradient times 1e4), ``sign-flipped`` (times -10) or ``random`` (Gaussian, 10x
the gradient's norm); and each lies as a reducer: it aggregates as honest ones do and answers every
part of its shard with the aggregate times -10 (``tests/support/hostile_reducers.py``). Groups are formed
as matchmaking forms them once peers ban each other: without any peer that an honest member has
caught (``averaging/verification.py``).

Figures, after the same number of epochs:

* ``accuracy_clean``: held-out accuracy of the honest peers (their mean) with no attacker, with
  centered-clip; ``accuracy_clean_mean``: the same with the plain mean;
* ``accuracy_f1`` .. ``accuracy_f3``: with 1-3 attackers, centered-clip and reducer checks on;
* ``accuracy_f1_mean`` (not with ``--quick``): one attacker against the plain mean (no checks),
  for contrast;
* ``liars_caught`` / ``liars``: attackers that some honest peer caught, over all runs, and how
  many attacked; ``caught_after_epochs``: per run, the epoch by which all its liars were caught;
* ``robust_time_ratio``: median CPU seconds of a round (all 8 peers, this process) with
  centered-clip / with the plain mean, on the clean swarm (a third clean run, checks off);
  ``robust_wall_ratio``, the same in wall-clock seconds (noisier on a shared machine);
* ``checked_time_ratio`` / ``checked_wall_ratio``: the same with the reducer checks on (the
  ``clean`` run): every peer checks every other reducer each round, as the shards of this small
  model fit the check budget (``averaging/reducer_checks.py``), so this is their upper bound.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import trio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from averaging.allreduce import AllReduceService, RoundSettings  # noqa: E402
from averaging.group import AveragingMode, GroupInfo, GroupMember  # noqa: E402
from peer import Identity, open_peer_host  # noqa: E402
from peerd.tasks import ShardSpec, digits_task  # noqa: E402
from tests.support.hostile_reducers import LyingShard  # noqa: E402

ATTACKS = ("scaled", "sign-flipped", "random")
HOSTILE_WEIGHT = float(2**40)
# A round's deadlines: generous for 8 peers sharing 2 cores, only there to catch hangs.
SENDER_TIMEOUT = 20.0
REDUCER_TIMEOUT = 40.0


@dataclass
class SwarmPeer:
    index: int
    host: object
    service: AllReduceService
    task: object
    optimizer: torch.optim.Optimizer
    attack: str | None = None  # None: honest

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


def gradient(peer: SwarmPeer) -> torch.Tensor:
    model, task = peer.task.model, peer.task
    model.zero_grad()
    task.loss_fn(model, next(task.batches)).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if peer.attack == "scaled":
        return flat * 1e4
    if peer.attack == "sign-flipped":
        return flat * -10.0
    if peer.attack == "random":
        noise = torch.randn(flat.numel())
        return noise * (10 * float(flat.norm()) / float(noise.norm()))
    return flat


def apply(peer: SwarmPeer, averaged: torch.Tensor) -> None:
    offset = 0
    for p in peer.task.model.parameters():
        p.grad.copy_(averaged[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    peer.optimizer.step()


async def run_swarm(count: int, attackers: int, epochs: int, aggregation: str, checks: bool = True) -> RunResult:
    torch.manual_seed(1)
    peers: list[SwarmPeer] = []
    async with trio.open_nursery() as nursery:

        async def run_peer(index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with open_peer_host(Identity.generate()) as host:
                hostile = index >= count - attackers
                service = AllReduceService(host, shard_type=LyingShard) if hostile else AllReduceService(host)
                task = digits_task(ShardSpec(index, count))
                attack = ATTACKS[(index - (count - attackers)) % len(ATTACKS)] if hostile else None
                peer = SwarmPeer(index, host, service, task, task.make_optimizer(list(task.model.parameters())), attack)
                task_status.started(peer)
                await trio.sleep_forever()

        for index in range(count):
            peers.append(await nursery.start(run_peer, index))
        honest = [p for p in peers if p.attack is None]
        liars = {p.peer_id for p in peers if p.attack is not None}
        result = RunResult(0.0, 0, len(liars), None)
        for epoch in range(epochs):
            banned = {peer for p in honest for peer in liars if peer in p.service.checks.banned}
            if banned == liars and result.caught_after is None and liars:
                result.caught_after = epoch
            members = [p for p in peers if p.peer_id not in banned]
            group = GroupInfo(
                os.urandom(16),
                tuple(GroupMember(p.peer_id, p.host.listen_address, 1.0, AveragingMode.NODE) for p in members),
            )
            vectors = {p.index: gradient(p) for p in members}
            cpu, wall = time.process_time(), time.perf_counter()

            async def one(p: SwarmPeer, group: GroupInfo, vector: torch.Tensor) -> None:
                weight = HOSTILE_WEIGHT if p.attack else 1.0
                settings = RoundSettings(
                    aggregation=aggregation,
                    check_reducers=checks and aggregation == "centered-clip",
                    sender_timeout=SENDER_TIMEOUT,
                    reducer_timeout=REDUCER_TIMEOUT,
                )
                await p.service.run(group, [vector], weight=weight, settings=settings)

            async with trio.open_nursery() as round_nursery:
                for p in members:
                    round_nursery.start_soon(one, p, group, vectors[p.index])
            result.round_cpu.append(time.process_time() - cpu)
            result.round_wall.append(time.perf_counter() - wall)
            for p in members:
                apply(p, vectors[p.index])
        accuracies = [p.task.evaluate(p.task.model)["accuracy"] for p in honest]
        result.accuracy = statistics.fmean(accuracies)
        result.caught = sum(1 for peer in liars if any(peer in p.service.checks.banned for p in honest))
        nursery.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs, no contrast run (~2 min on 2 cores)")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--epochs", type=int, help="epochs per run (default 100; --quick: 60)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    epochs = args.epochs or (60 if args.quick else 100)
    runs = [  # (name, attackers, aggregation, reducer checks)
        ("clean", 0, "centered-clip", True),
        ("clean_mean", 0, "mean", False),
        ("clean_nochk", 0, "centered-clip", False),
        ("f1", 1, "centered-clip", True),
        ("f2", 2, "centered-clip", True),
        ("f3", 3, "centered-clip", True),
    ]
    if not args.quick:
        runs.append(("f1_mean", 1, "mean", False))
    results: dict[str, RunResult] = {}
    started = time.perf_counter()
    print(f"{args.peers} peers, digits, {epochs} epochs per run; {os.cpu_count()} cores")
    print(f"{'run':<11} {'attackers':>9} {'aggregation':>13} {'accuracy':>9} {'caught':>7} {'cpu/round':>10}")
    for name, attackers, aggregation, checks in runs:
        result = trio.run(run_swarm, args.peers, attackers, epochs, aggregation, checks)
        results[name] = result
        print(
            f"{name:<11} {attackers:>9} {aggregation:>13} {result.accuracy:>9.3f} "
            f"{result.caught:>3}/{result.liars:<3} {statistics.median(result.round_cpu) * 1e3:>8.1f}ms",
            flush=True,
        )
    clean, plain, unchecked = results["clean"], results["clean_mean"], results["clean_nochk"]

    def ratio(run: RunResult, figure: str) -> float:
        return round(statistics.median(getattr(run, figure)) / statistics.median(getattr(plain, figure)), 3)

    summary = {
        "peers": args.peers,
        "epochs": epochs,
        "accuracy_clean": round(clean.accuracy, 4),
        "accuracy_clean_mean": round(plain.accuracy, 4),
        **{f"accuracy_f{f}": round(results[f"f{f}"].accuracy, 4) for f in (1, 2, 3)},
        **({"accuracy_f1_mean": round(results["f1_mean"].accuracy, 4)} if "f1_mean" in results else {}),
        "liars_caught": sum(results[f"f{f}"].caught for f in (1, 2, 3)),
        "liars": sum(results[f"f{f}"].liars for f in (1, 2, 3)),
        "caught_after_epochs": {f"f{f}": results[f"f{f}"].caught_after for f in (1, 2, 3)},
        "robust_time_ratio": ratio(unchecked, "round_cpu"),
        "robust_wall_ratio": ratio(unchecked, "round_wall"),
        "checked_time_ratio": ratio(clean, "round_cpu"),
        "checked_wall_ratio": ratio(clean, "round_wall"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
