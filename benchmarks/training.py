"""Collaborative training benchmark: a 4-peer swarm against the same 4 processes training alone.

    python benchmarks/training.py [--quick] [--peers 4] [--target-batch-sizes 256 131072] [--repeats R]
                                  [--solo-s S] [--collab-s S] [--settle-time S] [--target-accuracy A]

What is measured. ``--peers`` OS processes (this file with ``--worker``, torch limited to one
thread each) train the built-in ``digits`` task (``peerd.tasks.digits_task``: a 64-128-10 MLP, Adam,
batches of 32, peer i on data shard i of N) on 127.0.0.1. They go through the same phases together,
every phase starting at one wall-clock instant in all processes, each phase with fresh models:

* ``solo``: a plain PyTorch loop with no peerd code in it - forward, backward and the task's own
  optimizer step on every batch. Samples/s = samples processed by all peers together / phase length.
* ``collab``, once per ``--target-batch-sizes`` entry (and per repeat): exactly what ``peerd join``
  runs - ``peerd.training.Trainer`` around a ``CollaborativeOptimizer`` built as ``peerd/daemon.py``
  builds it (groups of up to 4, matchmaking timeout 10 s, the default settle time, parameter
  averaging every 5 epochs, no compression; delayed parameter updates with ``--delay-updates``), the peers connected
  through one DHT. Each peer accumulates gradients until the swarm has seen ``target_batch_size``
  samples, then averages them with a group in the background and keeps accumulating the next
  epoch; the averaged step lands at the first batch after the round is done. An epoch that is
  ready while the last round still averages keeps accumulating (the target is a minimum), so at a
  small target batch size epochs hold many more samples than the target. ``collab_samples_per_s``
  = the sum over peers of the samples each processed up to the end of its last whole epoch / the
  time that took: every sample counted went into a gradient that was averaged and stepped on
  (the last epoch's round may still be in flight at the cut), pauses count against it, and the
  phase's cut (mid-computation or mid-averaging) biases nothing.

Solo phases bracket every collaborative one (solo, collab, solo, collab, ..., solo) and each
collaborative phase (a trial) is compared with the mean of the two solo phases around it; a run
(one target batch size) averages its trials: ``overhead_ratio = collab_samples_per_s /
solo_samples_per_s`` (1.0: collaboration costs nothing; the target is >= 0.8). The same in CPU
time, which other load on a shared machine disturbs far less: ``cpu_ratio`` = samples per CPU
second of the workers' processes (all their threads) in the collaborative phase, every sample
processed in it, / the same in the solo phases around it.
``seconds_to_target`` is the wall time from the start of a collaborative phase until the first
peer's held-out accuracy (evaluated by the Trainer after every epoch) reaches ``--target-accuracy``
(0.9); null if no peer got there before the phase ended. ``solo_seconds_to_target`` is the same for
a lone peer on its quarter of the data (evaluated every 256 of its samples), for comparison.

The digits model is tiny: a batch of 32 costs about a millisecond of CPU, so with the task's
default ``target_batch_size`` of 256 an epoch is a few milliseconds of compute against a fixed
cost per epoch (progress records read every 0.25 s, the matchmaking settle time, the all-reduce,
and every 5th epoch a parameter-averaging round): communication dominates. A large target batch
size amortises that cost as a real model's slower batches would. Every configuration is in
``runs``; the headline figures are those of the largest target batch size (``config`` names it).
Defaults: target batch sizes 256 and 131072, 1 repeat, 120 s collaborative phases (at 131072 an
epoch takes 4-5 s here and the target takes about 20 epochs) and 15 s solo phases: about 5 minutes.
``--quick``: 8 s and 2 s phases (about 40 s), too short to reach the target accuracy. The machine
may be shared and small, so only ratios measured in the same run mean anything, and short phases
are noisy. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.training_report import print_table, summarize  # noqa: E402

if TYPE_CHECKING:  # torch and peerd are imported by the workers only: the parent starts them sooner
    from dht.node import DHTNode
    from peerd.tasks import Task
    from peerd.training import Trainer

HOST = "127.0.0.1"
WORKER_FLAG = "--worker"
ADDRESS_PREFIX = "ADDRESS "
READY_LINE = "READY"
RESULT_PREFIX = "RESULT "
STARTUP_TIMEOUT = 60.0  # importing torch and scikit-learn on a busy 2-core machine
FINISH_TIMEOUT = 30.0  # after the last phase: reports and shutdown
START_MARGIN = 0.5  # seconds between "go" and the first phase, so every worker is waiting for it
PHASE_GAP = 0.5  # between phases: building the next models, cancelled averaging rounds winding down
SOLO_EVAL_EVERY = 8  # batches between held-out evaluations in the solo loop (256 samples)
WATCH_INTERVAL = 0.005  # seconds between looks at the Trainer's status


# ------------------------------------------------------------------------------------------ a worker
@dataclass(frozen=True)
class Phase:
    name: str
    kind: str  # "solo" or "collab"
    seconds: float
    target_batch_size: int = 0  # collab only


@dataclass(frozen=True)
class WorkerConfig:
    rank: int
    world: int
    run_id: str
    target_accuracy: float
    settle_time: float | None
    phases: tuple[Phase, ...]
    delay_updates: bool = False


def worker_main(config: WorkerConfig) -> None:
    """Protocol on stdin/stdout: rank 0 prints ``ADDRESS addr``, the others read the address of rank 0
    on stdin; all print ``READY``, read the start time on stdin, and finally print ``RESULT {json}``."""
    import torch

    torch.set_num_threads(1)  # N peer processes already share the cores
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    report = trio.run(_worker, config)
    print(RESULT_PREFIX + json.dumps(report), flush=True)


async def _read_stdin_line() -> str:
    with trio.fail_after(STARTUP_TIMEOUT):
        return (await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)).strip()


async def _worker(config: WorkerConfig) -> dict[str, Any]:
    from dht.node import DHTNode

    await trio.to_thread.run_sync(_warm_up, config.rank, config.world)
    initial_peers = [await _read_stdin_line()] if config.rank else []
    async with DHTNode.open(listen=(HOST, 0), initial_peers=initial_peers, run_id=config.run_id) as node:
        if config.rank == 0:
            print(ADDRESS_PREFIX + str(node.address), flush=True)
        print(READY_LINE, flush=True)
        start = float(await _read_stdin_line())  # time.time() of the first phase, the same in every worker
        results = []
        for phase in config.phases:
            results.append({"phase": phase.name, **await _run_phase(config, node, phase, start)})
            start += phase.seconds + PHASE_GAP
    return {"rank": config.rank, "phases": results}


async def _run_phase(config: WorkerConfig, node: DHTNode, phase: Phase, start: float) -> dict[str, Any]:
    from averaging import CollaborativeOptimizer
    from averaging.match_ahead import MatchAhead
    from averaging.update_schedules import DelayedUpdates, ImmediateUpdates
    from peerd.training import Trainer

    end = start + phase.seconds
    task = await trio.to_thread.run_sync(_make_task, config.rank, config.world)  # a fresh model, ahead of time
    cpu = time.process_time()  # waiting for the start costs none
    if phase.kind == "solo":
        result = await trio.to_thread.run_sync(_solo_phase, task, start, end, config.target_accuracy)
        return {**result, "cpu_s": time.process_time() - cpu}
    async with trio.open_nursery() as background:
        optimizer = CollaborativeOptimizer(  # as peerd/daemon.py builds it, but for the target batch size
            task.make_optimizer(list(task.model.parameters())),
            node,
            prefix=f"{config.run_id}.{phase.name}",
            target_batch_size=phase.target_batch_size,
            target_group_size=config.world,
            settle_time=config.settle_time,
            # `peerd join --delay-updates`
            updates=DelayedUpdates(background) if config.delay_updates else ImmediateUpdates(),
            matching=MatchAhead(background),
        )
        result = await _collab_phase(Trainer(task, optimizer), start, end, config.target_accuracy)
        result["cpu_s"] = time.process_time() - cpu
        background.cancel_scope.cancel()
    return result


def _make_task(rank: int, world: int) -> Task:
    from peerd.tasks import ShardSpec, digits_task

    return digits_task(shard=ShardSpec(rank, world), device="cpu")


def _warm_up(rank: int, world: int) -> None:
    """Pay the one-time costs before any clock runs: importing scikit-learn and loading the data, and
    the first ``torch.optim`` optimizer (its lazy imports take seconds on a busy machine)."""
    _solo_phase(_make_task(rank, world), time.time(), time.time() + 0.2, target_accuracy=math.inf)


def _solo_phase(task: Task, start: float, end: float, target_accuracy: float) -> dict[str, Any]:
    """The baseline: a plain local training loop (run in one worker thread, start to end)."""
    model, loss_fn = task.model, task.loss_fn
    optimizer = task.make_optimizer(list(model.parameters()))
    samples, steps, reached_at, accuracy = 0, 0, None, None
    time.sleep(max(0.0, start - time.time()))
    late = time.time() - start
    while (now := time.time()) < end:
        batch = next(task.batches)
        model.train()
        loss = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        samples += len(batch[0])
        steps += 1
        if steps % SOLO_EVAL_EVERY == 0 and reached_at is None:
            model.eval()
            accuracy = task.evaluate(model)["accuracy"]
            if accuracy >= target_accuracy:
                reached_at = now - start
    return {"samples": samples, "seconds_to_target": reached_at, "accuracy": accuracy, "late_s": late}


async def _collab_phase(trainer: Trainer, start: float, end: float, target_accuracy: float) -> dict[str, Any]:
    """What ``peerd join`` runs (``Trainer.run``), started at ``start`` and cancelled at ``end``."""
    await trio.sleep(max(0.0, start - time.time()))
    late = time.time() - start
    watch = _Watch(start, target_accuracy)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run, trainer)
        with trio.move_on_after(end - time.time()):
            await trainer.run()
        nursery.cancel_scope.cancel()
    rounds = list(watch.rounds.values())
    return {
        "samples": trainer.status.samples,  # batches whose optimizer.step returned before the end
        "epochs": trainer.status.epoch,
        "last_epoch_at": watch.last_epoch_at,  # (seconds, samples) when this peer last finished an epoch
        "rounds": len(rounds),
        "averaged": sum(1 for r in rounds if r.get("averaged")),
        "group_sizes": [r.get("group", 0) for r in rounds if r.get("averaged")],
        "seconds_to_target": watch.reached_at,
        "accuracy": trainer.status.accuracy,
        "late_s": late,
    }


class _Watch:
    """Looks at the Trainer's status every few milliseconds: when each epoch ended and with how many
    samples, how its averaging went, and when the held-out accuracy first reached the target."""

    def __init__(self, start: float, target_accuracy: float):
        self.start = start
        self.target_accuracy = target_accuracy
        self.reached_at: float | None = None
        self.last_epoch_at: tuple[float, int] | None = None
        self.rounds: dict[int, dict[str, Any]] = {}

    async def run(self, trainer: Trainer) -> None:
        epoch = 0
        while True:
            status = trainer.status
            if status.epoch != epoch:
                epoch = status.epoch
                self.last_epoch_at = (time.time() - self.start, status.samples)
            if status.last_averaging is not None:
                self.rounds[status.last_averaging["epoch"]] = status.last_averaging
            if self.reached_at is None and (status.accuracy or 0.0) >= self.target_accuracy:
                self.reached_at = time.time() - self.start
            await trio.sleep(WATCH_INTERVAL)


# ------------------------------------------------------------------------------------------ the parent
class Worker:
    """One worker process; its stderr goes to a log file that error messages quote."""

    def __init__(self, command: list[str], rank: int, log_path: Path):
        self.rank = rank
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def read_line(self, prefix: str) -> str:
        """The rest of the next stdout line that starts with ``prefix``. A hang ends when the watchdog
        kills the process (its stdout then closes)."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"worker {self.rank} exited with {self.process.wait()}; its stderr:\n{self.tail()}")

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()


class Watchdog:
    """Kills every worker if the run outlives ``seconds``, so that no read waits forever."""

    def __init__(self, workers: list[Worker], seconds: float):
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(workers, seconds), daemon=True)
        self._thread.start()

    def _run(self, workers: list[Worker], seconds: float) -> None:
        if not self._done.wait(seconds):
            for worker in list(workers):
                if worker.process.poll() is None:
                    worker.process.kill()

    def cancel(self) -> None:
        self._done.set()
        self._thread.join()


def worker_command(rank: int, world: int, run_id: str, args: argparse.Namespace, phases: list[Phase]) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(rank), str(world), run_id]
    command += ["--target-accuracy", str(args.target_accuracy), "--phases", json.dumps([asdict(p) for p in phases])]
    if args.settle_time is not None:
        command += ["--settle-time", str(args.settle_time)]
    if args.delay_updates:
        command.append("--delay-updates")
    return command


def run_workers(args: argparse.Namespace, phases: list[Phase]) -> list[dict[str, Any]]:
    """Start every worker at once (rank 0's DHT address is handed to the others when it has one), start
    the first phase at the same instant in all of them, and return their reports."""
    run_id = f"bench-training-{os.getpid()}"
    schedule = START_MARGIN + sum(phase.seconds + PHASE_GAP for phase in phases)
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory(prefix="peerd-training-") as tmp:
        watchdog = Watchdog(workers, STARTUP_TIMEOUT + schedule + FINISH_TIMEOUT)
        try:
            for rank in range(args.peers):
                command = worker_command(rank, args.peers, run_id, args, phases)
                workers.append(Worker(command, rank, Path(tmp) / f"worker{rank}.err"))
            address = workers[0].read_line(ADDRESS_PREFIX)
            for worker in workers[1:]:
                worker.send(address)
            for worker in workers:
                worker.read_line(READY_LINE)
            start = time.time() + START_MARGIN
            for worker in workers:
                worker.send(repr(start))
            return [json.loads(worker.read_line(RESULT_PREFIX)) for worker in workers]
        finally:
            watchdog.cancel()
            for worker in workers:
                worker.stop()


def make_phases(target_batch_sizes: list[int], repeats: int, solo_s: float, collab_s: float) -> list[Phase]:
    """solo, collab, solo, collab, ..., solo: a solo phase on each side of every collaborative one;
    the sequence of target batch sizes is run ``repeats`` times."""
    phases = [Phase("solo-0", "solo", solo_s)]
    for repeat in range(repeats):
        for batch_size in target_batch_sizes:
            phases.append(Phase(f"collab-{batch_size}-{repeat}", "collab", collab_s, batch_size))
            phases.append(Phase(f"solo-{len(phases) // 2}", "solo", solo_s))
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (under 50 s in all)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target-batch-sizes", type=int, nargs="+", default=[256, 131072])
    parser.add_argument("--solo-s", type=float, help="length of each solo phase (default 15; --quick: 2)")
    parser.add_argument("--collab-s", type=float, help="length of each collaborative phase (default 120; --quick: 8)")
    parser.add_argument("--repeats", type=int, help="times each target batch size is run (default 1)")
    parser.add_argument("--settle-time", type=float, help="matchmaking settle time (default: the optimizer's)")
    parser.add_argument("--target-accuracy", type=float, default=0.9)
    parser.add_argument(
        "--delay-updates", action="store_true", help="collaborative phases as `peerd join --delay-updates` runs them"
    )
    args = parser.parse_args()
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    solo_s = args.solo_s or (2.0 if args.quick else 15.0)
    collab_s = args.collab_s or (8.0 if args.quick else 120.0)
    repeats = args.repeats or 1
    phases = make_phases(args.target_batch_sizes, repeats, solo_s, collab_s)
    summary = summarize(phases, run_workers(args, phases), args.target_accuracy)
    print_table(summary, args.settle_time)
    print(json.dumps(summary))


def parse_worker(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument(WORKER_FLAG, nargs=3, metavar=("RANK", "WORLD", "RUN_ID"))
    parser.add_argument("--target-accuracy", type=float, required=True)
    parser.add_argument("--settle-time", type=float)
    parser.add_argument("--phases", required=True, help="JSON list of phases")
    parser.add_argument("--delay-updates", action="store_true")
    args = parser.parse_args(argv)
    rank, world, run_id = args.worker
    phases = tuple(Phase(**phase) for phase in json.loads(args.phases))
    return WorkerConfig(
        int(rank), int(world), run_id, args.target_accuracy, args.settle_time, phases, args.delay_updates
    )


if __name__ == "__main__":
    if WORKER_FLAG in sys.argv:
        worker_main(parse_worker(sys.argv[1:]))
    else:
        main()
