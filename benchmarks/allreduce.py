"""All-reduce benchmark: peerd's butterfly all-reduce against ``torch.distributed`` (gloo).

    python benchmarks/allreduce.py [--quick] [--peers 2 4 8] [--numel N] [--reps R] [--part-size N]
                                   [--aggregation mean|centered-clip [--no-checks]]

What is measured, for each group size (2, 4 and 8 peers; ``--quick``: 4 only), with ``--numel``
float32 values per peer (16M = 2^24 by default, one flat tensor), every peer its own OS process
(this file with ``--worker``) on 127.0.0.1:

* ``gloo_s``: ``torch.distributed.all_reduce`` (backend gloo, SUM) of the peers' tensors. Only the
  collective is timed; the division by the group size that turns the sum into a mean is not, so the
  baseline is the strictest one gloo offers (it has no AVG for CPU tensors).
* ``ours_s``: ``AllReduceService.run`` (codec "none", so exact) of the same tensors, with the group
  already formed: every repetition reuses the members of one matchmaking round under a fresh group
  ID that all peers derive from the same seed. It includes everything a caller waits for:
  flattening, the encrypted streams, reduction and writing the average back into the tensors.
  With ``--aggregation centered-clip`` the reducers use CenteredClip and every peer checks
  reducers before using their averages (``averaging/robust.py``, ``averaging/verification.py``):
  what robustness costs (``--no-checks``: CenteredClip alone); the default is the exact mean.
* ``matchmaking_s``: one DHT matchmaking round (``Matchmaker.form_group``) that formed that group,
  timed once, separately.
* ``max_abs_error``: the largest difference, over every peer and repetition, between what our
  all-reduce left in a peer's tensor and the true mean (computed in float64 by the parent).
* ``ours_cpu_s`` / ``gloo_cpu_s`` and ``*_page_faults``: CPU seconds (all threads) and minor page
  faults of all peers together per round, from the round's start until every peer is done. They
  say where time goes and, unlike wall time, hardly depend on what else the machine is running.
  ``*_kernel_cpu_s`` is the part of the CPU seconds spent in the kernel: both sides move the same
  bytes through loopback TCP, so the difference between them is what framing, encryption and
  Python add, not the socket copies.

Each repetition starts from the peers' original tensors at a gloo barrier; a peer's time runs from
the barrier's release to its own completion, and a round's time is the slowest peer's (the round
is done when the last peer is). gloo and ours alternate (gloo, ours, gloo, ours, ...) so that a
noisy neighbour hits both; one warm-up round of each is discarded and the figures are medians over
the remaining rounds. The machine may be shared and small (2 cores), so only ratios against gloo,
measured in the same processes in the same run, mean anything: ``gloo_ratio = gloo_s / ours_s``
(1.0 = as fast as gloo).

The last line printed is one JSON object (with several group sizes its top-level figures are the
4-peer ones, and ``runs`` lists every size); a human-readable table precedes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from averaging.allreduce import RoundSettings  # noqa: E402
from averaging.averager import GroupAverager, all_reduce_service  # noqa: E402
from averaging.group import GroupInfo  # noqa: E402
from averaging.partition import DEFAULT_PART_SIZE  # noqa: E402
from dht.node import DHTNode  # noqa: E402

HOST = "127.0.0.1"
DEFAULT_NUMEL = 1 << 24  # 16M float32 values = 64 MiB per peer
SEED = 1234  # peer r's tensor is randn from seed SEED + r; group IDs derive from it too
WORKER_FLAG = "--worker"
RESULT_PREFIX = "RESULT "
DHT_ADDRESS_FILE = "dht_address"
MEAN_FILE = "mean.f32"
# Generous bounds: a healthy 4-peer quick run takes ~20 s on 2 cores; these only catch hangs.
STARTUP_TIMEOUT = 60.0  # imports, DHT bootstrap and the gloo rendezvous
MATCHMAKING_TIMEOUT = 15.0
SENDER_TIMEOUT = 60.0  # the all-reduce's own deadlines: long, so a slow round is measured, not cut
REDUCER_TIMEOUT = 120.0


# ---------------------------------------------------------------------------------- shared by both
def peer_tensor(rank: int, numel: int) -> torch.Tensor:
    """Peer ``rank``'s tensor: deterministic, so the parent can compute the true mean."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(SEED + rank))


def group_id_for(repetition: int) -> bytes:
    """The group ID of one repetition: every peer derives the same one without talking."""
    return hashlib.sha256(f"peerd-allreduce-bench:{SEED}:{repetition}".encode()).digest()[:16]


# ---------------------------------------------------------------------------------------- a worker
@dataclass(frozen=True)
class WorkerConfig:
    rank: int
    world: int
    numel: int
    reps: int
    part_size: int
    gloo_port: int
    workdir: Path
    aggregation: str = "mean"
    check_reducers: bool = True


def worker_main(config: WorkerConfig) -> None:
    """One peer: join gloo, then run the trio part (DHT, matchmaking, interleaved rounds)."""
    torch.set_num_threads(1)  # N peer processes already share the cores
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{HOST}:{config.gloo_port}",
        rank=config.rank,
        world_size=config.world,
        timeout=timedelta(seconds=STARTUP_TIMEOUT),
    )
    try:
        report = trio.run(_worker_rounds, config)
    finally:
        dist.destroy_process_group()
    print(RESULT_PREFIX + json.dumps(report), flush=True)


async def _worker_rounds(config: WorkerConfig) -> dict[str, Any]:
    original = peer_tensor(config.rank, config.numel)
    mean = torch.from_file(str(config.workdir / MEAN_FILE), size=config.numel, dtype=torch.float32)
    ours = original.clone()
    theirs = original.clone()

    async def barrier() -> None:
        # In a thread: a blocked event loop would stall replies that other peers still wait for.
        await trio.to_thread.run_sync(dist.barrier)

    async def timed_gloo() -> tuple[float, Usage]:
        theirs.copy_(original)
        await barrier()
        usage = Usage.now()
        seconds = await trio.to_thread.run_sync(_timed_all_reduce, theirs)
        await barrier()
        usage = Usage.now() - usage
        theirs.div_(config.world)
        return seconds, usage

    async with _open_dht_node(config) as node:
        await barrier()  # every peer is in the DHT before anyone declares itself
        averager = GroupAverager(
            [ours],
            node,
            prefix="bench",
            target_group_size=config.world,
            min_group_size=config.world,
            matchmaking_timeout=MATCHMAKING_TIMEOUT,
            allow_state_sharing=False,
        )
        start = time.perf_counter()
        group = (await averager.find_group()).group
        matchmaking_s = time.perf_counter() - start
        service = all_reduce_service(node.host)

        async def timed_ours(repetition: int) -> tuple[float, Usage]:
            ours.copy_(original)
            await barrier()
            usage = Usage.now()
            start = time.perf_counter()
            settings = RoundSettings(
                sender_timeout=SENDER_TIMEOUT,
                reducer_timeout=REDUCER_TIMEOUT,
                part_size=config.part_size,
                aggregation=config.aggregation,
                check_reducers=config.check_reducers and config.aggregation == "centered-clip",
            )
            result = await service.run(GroupInfo(group_id_for(repetition), group.members), [ours], settings=settings)
            seconds = time.perf_counter() - start
            await barrier()  # usage counts until every peer is done (serving others included)
            usage = Usage.now() - usage
            if not result.succeeded:
                raise RuntimeError(f"round {repetition} failed: {result}")
            return seconds, usage

        gloo_s, ours_s, gloo_usage, ours_usage, ours_error, gloo_error = [], [], [], [], 0.0, 0.0
        for repetition in range(config.reps + 1):  # round 0 is the warm-up
            gloo_time, gloo_used = await timed_gloo()
            gloo_error = max(gloo_error, _max_abs_error(theirs, mean))
            ours_time, ours_used = await timed_ours(repetition)
            ours_error = max(ours_error, _max_abs_error(ours, mean))
            if repetition:
                gloo_s.append(gloo_time)
                ours_s.append(ours_time)
                gloo_usage.append(gloo_used)
                ours_usage.append(ours_used)
    return {
        "rank": config.rank,
        "matchmaking_s": matchmaking_s,
        "group_size": len(group.members),
        "gloo_s": gloo_s,
        "ours_s": ours_s,
        "gloo_cpu_s": [u.cpu_s for u in gloo_usage],
        "ours_cpu_s": [u.cpu_s for u in ours_usage],
        "gloo_kernel_cpu_s": [u.kernel_cpu_s for u in gloo_usage],
        "ours_kernel_cpu_s": [u.kernel_cpu_s for u in ours_usage],
        "gloo_faults": [u.faults for u in gloo_usage],
        "ours_faults": [u.faults for u in ours_usage],
        "max_abs_error": ours_error,
        "gloo_max_abs_error": gloo_error,
    }


@dataclass(frozen=True)
class Usage:
    """CPU seconds (all threads) and minor page faults of this process."""

    cpu_s: float
    kernel_cpu_s: float  # the part of cpu_s spent in the kernel (socket copies, TCP, scheduling)
    faults: int

    @classmethod
    def now(cls) -> Usage:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return cls(r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt)

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu_s - other.cpu_s, self.kernel_cpu_s - other.kernel_cpu_s, self.faults - other.faults)


def _timed_all_reduce(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    dist.all_reduce(tensor)
    return time.perf_counter() - start


def _max_abs_error(values: torch.Tensor, mean: torch.Tensor) -> float:
    return float((values - mean).abs_().max())


@asynccontextmanager
async def _open_dht_node(config: WorkerConfig) -> AsyncIterator[DHTNode]:
    """Rank 0 starts the swarm and publishes its address in the work directory; the others wait
    for that file and bootstrap from it."""
    address_file = config.workdir / DHT_ADDRESS_FILE
    if config.rank == 0:
        async with DHTNode.open(identity=None, listen=(HOST, 0)) as node:
            staging = address_file.with_suffix(".tmp")
            staging.write_text(str(node.address))
            staging.rename(address_file)  # atomic: readers never see half an address
            yield node
        return
    with trio.fail_after(STARTUP_TIMEOUT):
        while not address_file.exists():
            await trio.sleep(0.05)
    async with DHTNode.open(identity=None, listen=(HOST, 0), initial_peers=[address_file.read_text()]) as node:
        yield node


# ---------------------------------------------------------------------------------------- the parent
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def write_true_mean(path: Path, world: int, numel: int) -> None:
    """The mean of every peer's tensor, accumulated in float64, stored as float32 for the workers."""
    total = torch.zeros(numel, dtype=torch.float64)
    for rank in range(world):
        total += peer_tensor(rank, numel)
    (total / world).to(torch.float32).numpy().tofile(path)


def run_group(
    world: int,
    numel: int,
    reps: int,
    part_size: int,
    timeout: float,
    aggregation: str = "mean",
    checks: bool = True,
) -> dict[str, Any]:
    """Spawn ``world`` workers, collect their reports, and reduce them to one row of figures."""
    with tempfile.TemporaryDirectory(prefix="peerd-allreduce-") as tmp:
        workdir = Path(tmp)
        write_true_mean(workdir / MEAN_FILE, world, numel)
        port = free_port()
        workers: list[subprocess.Popen] = []
        logs = []
        try:
            for rank in range(world):
                command = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(rank), str(world)]
                command += ["--numel", str(numel), "--reps", str(reps), "--part-size", str(part_size)]
                command += ["--port", str(port), "--dir", tmp, "--aggregation", aggregation]
                command += [] if checks else ["--no-checks"]
                logs.append(open(workdir / f"worker{rank}.err", "wb"))  # noqa: SIM115 (closed below)
                workers.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=logs[-1], text=True))
            deadline = time.monotonic() + timeout
            reports = [_collect(worker, rank, workdir, deadline) for rank, worker in enumerate(workers)]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                worker.wait()
            for log in logs:
                log.close()
    summary = summarize(world, numel, reps, reports)
    return {**summary, "part_size": part_size, "aggregation": aggregation, "checks": checks}


def _collect(worker: subprocess.Popen, rank: int, workdir: Path, deadline: float) -> dict[str, Any]:
    try:
        stdout, _ = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.communicate()
        raise RuntimeError(f"worker {rank} timed out\n{_tail(workdir / f'worker{rank}.err')}") from None
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"worker {rank} exited with {worker.returncode}\n{_tail(workdir / f'worker{rank}.err')}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no stderr)"


def summarize(world: int, numel: int, reps: int, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repetition the slowest peer's time; then the median over repetitions."""
    gloo_rounds = [max(r["gloo_s"][i] for r in reports) for i in range(reps)]
    ours_rounds = [max(r["ours_s"][i] for r in reports) for i in range(reps)]
    gloo_s, ours_s = statistics.median(gloo_rounds), statistics.median(ours_rounds)

    # CPU seconds of all peers together per round: what a round costs, whatever the neighbours do
    def per_round(key: str) -> float:  # all peers together, median over rounds
        return statistics.median(sum(r[key][i] for r in reports) for i in range(reps))

    return {
        "peers": world,
        "numel": numel,
        "ours_s": ours_s,
        "gloo_s": gloo_s,
        "gloo_ratio": gloo_s / ours_s,
        "matchmaking_s": max(r["matchmaking_s"] for r in reports),
        "max_abs_error": max(r["max_abs_error"] for r in reports),
        "gloo_max_abs_error": max(r["gloo_max_abs_error"] for r in reports),
        "ours_cpu_s": per_round("ours_cpu_s"),
        "gloo_cpu_s": per_round("gloo_cpu_s"),
        "ours_kernel_cpu_s": per_round("ours_kernel_cpu_s"),
        "gloo_kernel_cpu_s": per_round("gloo_kernel_cpu_s"),
        "ours_page_faults": int(per_round("ours_faults")),
        "gloo_page_faults": int(per_round("gloo_faults")),
        "reps": reps,
        "ours_rounds_s": ours_rounds,
        "gloo_rounds_s": gloo_rounds,
    }


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"all-reduce of float32 tensors, codec none, {os.cpu_count()} cores; median of the slowest peer per round")
    header = (
        f"{'peers':>5} {'numel':>10} {'gloo s':>8} {'ours s':>8} {'gloo/ours':>9} {'match s':>8} {'max err':>9}"
        f" {'gloo cpu':>9} {'ours cpu':>9} {'gloo sys':>9} {'ours sys':>9} {'gloo flt':>9} {'ours flt':>9}"
    )
    print(header)
    print("-" * len(header))
    for run in runs:
        print(
            f"{run['peers']:>5} {run['numel']:>10} {run['gloo_s']:>8.3f} {run['ours_s']:>8.3f} "
            f"{run['gloo_ratio']:>9.2f} {run['matchmaking_s']:>8.2f} {run['max_abs_error']:>9.2e}"
            f" {run['gloo_cpu_s']:>9.3f} {run['ours_cpu_s']:>9.3f}"
            f" {run['gloo_kernel_cpu_s']:>9.3f} {run['ours_kernel_cpu_s']:>9.3f}"
            f" {run['gloo_page_faults']:>9} {run['ours_page_faults']:>9}"
        )
    for run in runs:
        rounds = ", ".join(f"{o:.3f}/{g:.3f}" for o, g in zip(run["ours_rounds_s"], run["gloo_rounds_s"], strict=True))
        print(f"  {run['peers']} peers, ours/gloo per round: {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 peers only, 3 rounds")
    parser.add_argument("--peers", type=int, nargs="+", help="group sizes (default 2 4 8; --quick: 4)")
    parser.add_argument("--numel", type=int, default=DEFAULT_NUMEL, help="float32 values per peer")
    parser.add_argument("--reps", type=int, help="timed rounds per group size (default 5; --quick: 3)")
    parser.add_argument("--part-size", type=int, default=DEFAULT_PART_SIZE, help="values per streamed part")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per group size")
    parser.add_argument(
        "--aggregation",
        choices=["mean", "centered-clip"],
        default="mean",
        help="how reducers aggregate (centered-clip is robust, not exact: max_abs_error grows)",
    )
    parser.add_argument("--no-checks", action="store_true", help="centered-clip without the reducer checks")
    args = parser.parse_args()
    peer_counts = args.peers or ([4] if args.quick else [2, 4, 8])
    reps = args.reps or (3 if args.quick else 5)
    runs = [
        run_group(world, args.numel, reps, args.part_size, args.timeout, args.aggregation, not args.no_checks)
        for world in peer_counts
    ]
    print_table(runs)
    headline = next((run for run in runs if run["peers"] == 4), runs[0])
    summary = dict(headline)
    if len(runs) > 1:
        summary["runs"] = runs
    print(json.dumps(summary))


def parse_worker(argv: list[str]) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    parser.add_argument(WORKER_FLAG, nargs=2, type=int, metavar=("RANK", "WORLD"))
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--part-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--aggregation", default="mean")
    parser.add_argument("--no-checks", action="store_true")
    args = parser.parse_args(argv)
    rank, world = args.worker
    return WorkerConfig(
        rank, world, args.numel, args.reps, args.part_size, args.port, args.dir, args.aggregation, not args.no_checks
    )


if __name__ == "__main__":
    if WORKER_FLAG in sys.argv:
        worker_main(parse_worker(sys.argv[1:]))
    else:
        main()
