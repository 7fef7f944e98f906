"""What CPU-only CI cannot run, prepared for a machine with CUDA: run it there as

    python benchmarks/gpu_check.py            # --device cuda when torch sees a GPU

1. ``autocast``: the ``textlm`` and ``hf-lm`` (with transformers) tasks take steps on the device
   under their bf16 autocast: the loss stays finite and falls.
2. ``averaging``: two averagers of this process average CUDA tensors with each other: exactly the
   mean, and the tensors stay on the device.
3. ``experts``: a ``peerd serve-experts`` process hosts experts on the device and a remote mixture
   trains through them.
4. ``machine``: two ranks of a ``torch.distributed`` group (NCCL on two GPUs; gloo with ``--device
   cpu``) compute a slice of unequal sample counts: every rank's gradient is the machine's exact
   mean (``peerd/machine.py``). One GPU cannot hold two NCCL ranks: there one NCCL rank holds all
   the samples (NCCL, DDP on CUDA and the gloo control group still run). ``sharded``: the same
   under FSDP (``--shard-model``), the gradient delivered whole to rank 0's model on the host.
5. ``codecs``: every codec of the averaging wire encodes a CUDA tensor and decodes it back within
   its own error bound (the sparse ones too).
6. ``swarm``: real ``peerd join`` processes on the device: a lone peer and a machine peer (NCCL,
   ``--nproc-per-node`` as many GPUs as there are, up to 2) train digits to 0.9 together, then two
   peers in local-updates mode with the sparse ``topk_2bit`` codec do, in checked (centered-clip) rounds.

``--device cpu`` runs the same checks on the CPU (autocast off, gloo), which is how the benchmark
smoke test keeps this script from rotting. Prints a table, then one JSON line: each check's outcome
(``ok``, ``skipped: why`` or ``failed: why``) and the errors.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from averaging import Averager  # noqa: E402
from dht import DHT  # noqa: E402
from peer import LOCAL_DIFFICULTY  # noqa: E402


def check_autocast(device: str, steps: int, hf: bool) -> str:
    specs = ["textlm"]
    if hf:
        try:
            import transformers  # noqa: F401

            specs.append("hf-lm")
        except ImportError:
            pass
    from peerd.tasks import load_task

    for spec in specs:
        task = load_task(spec, device=device, model_size="tiny")
        optimizer = task.make_optimizer(list(task.model.parameters()))
        batch = next(task.batches)
        losses = []
        for _ in range(steps):
            loss = task.loss_fn(task.model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if not all(torch.isfinite(torch.tensor(losses))) or losses[-1] >= losses[0]:
            return f"failed: {spec} losses {losses[0]:.3f} -> {losses[-1]:.3f}"
        if next(task.model.parameters()).device.type != torch.device(device).type:
            return f"failed: {spec}'s model left {device}"
    return "ok"


def check_averaging(device: str) -> str:
    dhts = [DHT(start=True, run_id="gpu-check")]
    dhts.append(DHT([str(dhts[0].address)], start=True, run_id="gpu-check"))
    tensors = [torch.full((1 << 16,), float(index + 1), device=device) for index in range(2)]
    # the exact mean (CenteredClip's first round keeps each peer's own values: no history of its updates yet)
    options = dict(prefix="gpu-check", target_group_size=2, matchmaking_timeout=10.0, aggregation="mean")
    averagers = [Averager([tensor], dht, **options) for tensor, dht in zip(tensors, dhts, strict=True)]
    try:
        futures = [averager.step(timeout=30, return_future=True) for averager in averagers]
        for future in futures:
            future.result(timeout=60)
        for averager in averagers:
            with averager.get_tensors() as (averaged,):
                if averaged.device.type != torch.device(device).type:
                    return f"failed: the averaged tensor moved to {averaged.device}"
                error = float((averaged.float() - 1.5).abs().max())
                if error > 1e-5:
                    return f"failed: max error {error}"
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    return "ok"


def _pythonpath() -> str:
    """This checkout first, then whatever PYTHONPATH held (packages carried to a bare machine)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def check_experts(device: str, steps: int) -> str:
    from moe.client import MoEClient
    from moe.mixture import RemoteMixtureOfExperts
    from tests.support.processes import PeerdProcess

    args = ["serve-experts", "--experts", "ffn.[0:1].[0:2]", "--hidden-dim", "32", "--device", device]
    args += ["--listen", "127.0.0.1:0", "--node-id-difficulty", str(LOCAL_DIFFICULTY)]
    folder = tempfile.TemporaryDirectory()
    server = PeerdProcess(args, Path(folder.name) / "experts.log", env={"PYTHONPATH": _pythonpath()})
    try:
        address = server.read_line(timeout=60).rsplit(" at ", 1)[-1].strip()
        torch.manual_seed(0)
        x = torch.randn(128, 8)
        y = torch.sin(x[:, :4].sum(dim=1, keepdim=True))
        with MoEClient.start([address]) as client:
            mixture = RemoteMixtureOfExperts(
                in_features=32, grid_size=(1, 2), uid_prefix="ffn", client=client, k_best=2
            )
            model = torch.nn.Sequential(torch.nn.Linear(8, 32), mixture, torch.nn.Linear(32, 1))
            optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
            losses = []
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return "ok" if losses[-1] < losses[0] else f"failed: losses {losses[0]:.3f} -> {losses[-1]:.3f}"
    finally:
        server.stop(timeout=15)
        folder.cleanup()


# The machine check's data: rank 0 holds 8 samples, rank 1 holds 2, in as many batches (a lone
# rank holds all 10).
ROWS = {0: [(0, 3), (3, 8)], 1: [(8, 9), (9, 10)]}


class _Stack(torch.nn.Module):
    """Two blocks in an ``nn.ModuleList``: FSDP shards each on its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def _machine_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(10, 4, generator=generator), torch.randn(10, 3, generator=generator)


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.nn.functional.mse_loss(model(batch[0].to(device)), batch[1].to(device))


def machine_rank(device: str, out: Path, sharded: bool) -> None:
    """One rank of the machine check (run with torchrun's variables set), through the ranks'
    own compute (``peerd/machine_sharded.py``): DDP, or FSDP with ``sharded``."""
    from peerd.machine import RankReport, gather_reports, join_rank_group
    from peerd.machine_sharded import machine_compute
    from peerd.ranks import RankPlace, rank_place

    place = rank_place() or RankPlace(0, 1, 0)  # (a job of one is no machine to peerd)
    group = join_rank_group(place, device, sharded)
    model = _Stack().to(group.task_device)
    compute = machine_compute(group, model)
    inputs, targets = _machine_data()
    rows = ROWS[group.rank] if group.world_size == 2 else ROWS[0] + ROWS[1]  # one rank: all of them
    batches = [(inputs[a:b], targets[a:b]) for a, b in rows]
    reports = gather_reports(group, RankReport(sum(len(batch[0]) for batch in batches)))
    compute.forward_backward(_mse, batches, sum(report.samples for report in reports))
    compute.deliver_gradients()
    if group.leads or not sharded:  # a follower's sharded model keeps no gradients
        torch.save([param.grad.cpu() for param in model.parameters()], out / f"rank{group.rank}.pt")


def check_machine(device: str, sharded: bool = False) -> str:
    world = 1 if device.startswith("cuda") and torch.cuda.device_count() < 2 else 2
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        ranks = []
        for rank in range(world):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=_pythonpath()
            )
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            command = [sys.executable, __file__, "--device", device, "--machine-rank", folder]
            command += ["--sharded"] if sharded else []
            ranks.append(subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
        for process in ranks:
            _, err = process.communicate(timeout=120)
            if process.returncode != 0:
                return f"failed: a rank exited {process.returncode}: {err.strip().splitlines()[-1:]}"
        model = _Stack()
        _mse(model, _machine_data()).backward()
        expected = [param.grad for param in model.parameters()]
        for rank in range(1 if sharded else world):
            got = torch.load(Path(folder) / f"rank{rank}.pt")
            error = max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))
            if error > 1e-5:
                return f"failed: rank {rank}'s gradient is off by {error}"
    return "ok" if world == 2 else "ok (one NCCL rank: this machine has one GPU)"


def check_codecs(device: str) -> str:
    from averaging.compression import codec_names, get_codec

    generator = torch.Generator().manual_seed(2)
    values = torch.randn(3 * 4096 + 17, generator=generator).to(device)
    for name in codec_names():
        codec = get_codec(name)
        decoded = codec.decode(*codec.encode(values), values.numel()).to(device)
        if not torch.isfinite(decoded).all():
            return f"failed: {name} decoded a non-finite value"
        kept = decoded != 0 if codec.sparse else torch.ones_like(values, dtype=torch.bool)
        error = float((decoded - values)[kept].norm() / values[kept].norm())
        if error > 0.35:  # the 2-bit levels are the coarsest: ~0.2 of the kept values' norm
            return f"failed: {name}'s relative error {error:.3f}"
    return f"ok ({len(codec_names())} codecs)"


def _start_peer(folder: Path, name: str, shard: str, initial: str | None, extra: list[str]):
    from tests.support.processes import PeerdProcess

    args = ["join", "--listen", "127.0.0.1:0", "--identity", str(folder / f"{name}.key"), "--run-id", name[:-1]]
    args += ["--task", "digits", "--data-shard", shard, "--status-port", "0", *extra]
    args += ["--initial-peer", initial] if initial else []
    process = PeerdProcess(args, folder / f"{name}.log", env={"PYTHONPATH": _pythonpath()})
    process.read_line(timeout=90)  # listening
    return process, int(process.read_line(timeout=90).rsplit(":", 1)[1].split("/")[0])


def _train_pair(folder: Path, name: str, first: list[str], second: list[str]) -> dict:
    """Two peers of one swarm train digits until both hold 0.9 held-out accuracy: the second's /status."""
    from tests.support.processes import status_of, wait_until

    peers = []
    try:
        peers.append(_start_peer(folder, f"{name}0", "0/2", None, first))
        address = status_of(peers[0][1])["address"]
        peers.append(_start_peer(folder, f"{name}1", "1/2", address, second))
        ports = [port for _, port in peers]
        wait_until(lambda: min((status_of(p) or {}).get("accuracy") or 0 for p in ports) >= 0.9, 180, "0.9")
        wait_until(lambda: ((status_of(ports[1]) or {}).get("last_averaging") or {}).get("group") == 2, 60, "a round")
        return status_of(ports[1])
    except (AssertionError, TimeoutError, EOFError) as error:
        logs = "\n".join(process.log()[-2000:] for process, _ in peers)
        raise RuntimeError(f"{str(error).splitlines()[0]}; logs:\n{logs}") from None
    finally:
        for process, _ in peers:
            process.stop()


def check_swarm(device: str) -> str:
    """On one GPU, ``--nproc-per-node 1`` is a lone peer (a job of one rank is no machine)."""
    ranks = min(2, torch.cuda.device_count()) if device.startswith("cuda") else 2
    with tempfile.TemporaryDirectory() as folder:
        lone = ["--device", device]
        status = _train_pair(Path(folder), "machine", lone, lone + ["--nproc-per-node", str(ranks)])
        backend = (status.get("ranks") or {}).get("backend")
        if ranks > 1 and backend != ("nccl" if device.startswith("cuda") else "gloo"):
            return f"failed: the machine's ranks use {backend}"
        sparse = lone + ["--mode", "local-updates", "--compression", "topk_2bit"]  # a public swarm: checked rounds
        status = _train_pair(Path(folder), "sparse", sparse, sparse)
    machine = f"{ranks} {backend} ranks" if ranks > 1 else "one GPU: two lone peers"
    return f"ok ({machine}; sparse rounds at epoch {status['epoch']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer steps, and autocast on textlm alone")
    parser.add_argument("--machine-rank", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="comma-separated checks to run (default: all)")
    args = parser.parse_args()
    if args.machine_rank:
        machine_rank(args.device, Path(args.machine_rank), args.sharded)
        return
    steps = 5 if args.quick else 20
    checks = {
        "autocast": lambda: check_autocast(args.device, steps, hf=not args.quick),
        "averaging": lambda: check_averaging(args.device),
        "experts": lambda: check_experts(args.device, steps),
        "machine": lambda: check_machine(args.device),
        "sharded": lambda: check_machine(args.device, sharded=True),
        "codecs": lambda: check_codecs(args.device),
        "swarm": lambda: check_swarm(args.device),
    }
    if args.only:
        checks = {name: check for name, check in checks.items() if name in args.only.split(",")}
    outcomes, errors = {}, []
    for name, check in checks.items():
        started = time.monotonic()
        try:
            outcomes[name] = check()
        except Exception as error:  # a check that breaks is reported, and the others still run
            outcomes[name] = f"failed: {type(error).__name__}: {error}"
            errors.append(traceback.format_exc())
        print(f"{name:<10} {time.monotonic() - started:6.1f} s  {outcomes[name]}", flush=True)
    errors += [f"{name}: {outcome}" for name, outcome in outcomes.items() if outcome.startswith("failed")]
    print(json.dumps({"device": args.device, "checks": outcomes, "errors": errors}))


if __name__ == "__main__":
    main()
