"""A peer that is a whole machine: the ranks of one ``torch.distributed`` job (``torchrun
--nproc-per-node N -m peerd join ...`` or ``peerd join --nproc-per-node N``) train data-parallel,
and rank 0 alone is the swarm's peer.

Why: a volunteer with N GPUs who ran N peers would average over the internet N times, multiplying
the traffic of one uplink by N while the GPUs sit next to each other on a bus many times faster.
Here the machine reduces inside itself first (DDP: NCCL on GPUs, gloo on CPUs), averages once with
the swarm through rank 0, and the swarm sees one peer whose samples are all of its ranks'.

The ranks move in lockstep, one slice of batches at a time, with every collective in one order:

1. rank 0 broadcasts the slice's orders (``SliceOrders``): how many batches, whether to stop,
   whether its parameters changed since the last slice (a swarm step, a donor's state, an outer
   step: rank 0's optimizer is the machine's, followers keep none);
2. if they changed, rank 0 broadcasts its parameters;
3. every rank's samples, last loss and batch time are gathered (``RankReport``): rank 0 gives the
   swarm the machine's samples and shows every rank in ``/status``;
4. every rank computes its batches' gradients under DDP, which averages them over the ranks; each
   rank's loss is scaled so that DDP's mean is the mean over the machine's samples.

Trust: the ranks are one operator's processes (the same trust as the threads of one peer).
Orders, reports and parameters cross between them as raw tensors through ``torch.distributed``,
never pickled, and nothing a rank sends is checked as the swarm's input is: the security model's
boundary is rank 0's network, not the machine's bus.

Failures: every collective is bounded by ``RANK_TIMEOUT_S``. A rank that dies closes its
connections, which fails the next collective of every other rank at once (gloo; NCCL once its
watchdog sees it), and the failure surfaces as ``RankError``: rank 0 then leaves the swarm with one
line and exit 5, a follower exits 5 after logging it.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .ranks import RankError, RankPlace
from .task_types import ShardSpec

__all__ = [
    "RANK_TIMEOUT_S",
    "ParameterWrites",
    "RankError",
    "RankGroup",
    "RankReport",
    "SliceOrders",
    "broadcast_parameters",
    "exchange_orders",
    "gather_reports",
    "join_rank_group",
    "leave_rank_group",
    "machine_forward_backward",
    "rank_shard",
    "share_parameters",
    "share_shard",
    "wrap_model",
]

# A follower waits at step 1 while rank 0 does the swarm's work: bootstrapping (15 s by default),
# choosing a shard and loading the task before the first slice, averaging rounds or downloading a
# donor's state between slices (each bounded by its own deadline, a few minutes at the most). A rank
# that hangs alive is found after this; one that dies, at once (its connections close).
RANK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankGroup:
    """This process's membership of the machine's process group. ``control`` is a gloo group for
    orders and reports (small CPU tensors, whatever the backend of the gradients)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    control: Any
    sharded: bool = False  # FSDP (``machine_sharded.py``): each rank's device holds 1/N of the model

    @property
    def leads(self) -> bool:
        """Rank 0: the one that is the swarm's peer."""
        return self.rank == 0

    @property
    def task_device(self) -> torch.device:
        """Where this rank loads its task: its device, or the host when the model is sharded (rank
        0's whole model lives there, and each rank's shard moves to its device as it is cut)."""
        return torch.device("cpu") if self.sharded else self.device


def rank_device(device: str | None, place: RankPlace, cuda_devices: int) -> torch.device:
    """The device a rank trains on: ``device`` (default: CUDA if the machine has it, else the
    CPU), CUDA ranks each on ``cuda:LOCAL_RANK``. Every rank refuses the same mistakes, so that
    rank 0 says them for the machine: no CUDA, fewer CUDA devices than ranks, or one named CUDA
    device for several ranks (NCCL needs a device per rank)."""
    wanted = device or ("cuda" if cuda_devices else "cpu")
    chosen = torch.device(wanted)
    if chosen.type != "cuda":
        return chosen
    if not cuda_devices:
        raise ValueError(f"--device {wanted}: torch sees no CUDA device on this machine")
    if chosen.index is not None and place.world_size > 1:
        raise ValueError(f"--device {wanted} names one GPU for {place.world_size} ranks: give --device cuda")
    if place.world_size > cuda_devices:
        raise ValueError(f"{place.world_size} ranks need as many CUDA devices; this machine has {cuda_devices}")
    return chosen if chosen.index is not None else torch.device("cuda", place.local_rank)


def join_rank_group(place: RankPlace, device: str | None = None, sharded: bool = False) -> RankGroup:
    """Form the machine's process group from torchrun's variables (``MASTER_ADDR``,
    ``MASTER_PORT``): NCCL when training runs on CUDA (each rank on ``cuda:LOCAL_RANK`` unless
    ``device`` names one), gloo otherwise; ``sharded``: the ranks will hold the model under FSDP."""
    chosen = rank_device(device, place, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    backend = "nccl" if chosen.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
    try:
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        dist.init_process_group(backend, rank=place.rank, world_size=place.world_size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    except (RuntimeError, ValueError) as error:
        raise RankError(f"rank {place.rank} could not join the machine's process group: {_first_line(error)}") from None
    return RankGroup(place.rank, place.world_size, backend, chosen, control, sharded)


def leave_rank_group() -> None:
    """Destroy this process's group once its last collective is done. Left to the interpreter's
    exit, gloo's worker threads can still hold tensors while Python finalizes, and the process
    dies of SIGABRT ("terminate called without an active exception") after a clean stop."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(error: BaseException) -> str:
    """What a collective's error says, in one sentence: gloo's start with the C++ source line
    (``[.../pair.cc:553] Connection closed by peer [IP]:PORT. This is typically ...``)."""
    lines = str(error).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", lines[0]) if lines else type(error).__name__
    return text.split(". ")[0].rstrip(".")


@contextlib.contextmanager
def collectives(what: str):
    """Turn a failed collective (a ``RuntimeError`` from torch.distributed) into a RankError."""
    try:
        yield
    except RuntimeError as error:
        raise RankError(f"a rank of this machine failed while {what}: {_first_line(error)}") from None


def share_shard(group: RankGroup, shard: ShardSpec | None = None) -> ShardSpec:
    """Rank 0's data shard of the swarm's data (``shard``), as every rank learns it."""
    values = torch.tensor([shard.index, shard.count, shard.seed] if shard else [0, 1, 0], dtype=torch.int64)
    with collectives("sharing the data shard"):
        dist.broadcast(values, 0, group=group.control)
    index, count, seed = (int(value) for value in values)
    return ShardSpec(index, count, seed)


def rank_shard(shard: ShardSpec, group: RankGroup) -> ShardSpec:
    """This rank's part of the machine's shard ``I/N``: shard ``I + rank*N`` of ``N*world``. Items
    at positions ``I mod N`` split by ``rank`` exactly, so the ranks together train the machine's
    shard and no item twice (``--data-shard auto`` counts the machine as one peer on ``I/N``)."""
    return ShardSpec(shard.index + group.rank * shard.count, shard.count * group.world_size, shard.seed)


def wrap_model(group: RankGroup, model: nn.Module) -> DistributedDataParallel:
    """The model under DDP (which starts every rank from rank 0's parameters and buffers)."""
    device_ids = [group.device.index] if group.device.type == "cuda" else None
    with collectives("wrapping the model in DistributedDataParallel"):
        return DistributedDataParallel(model, device_ids=device_ids)


@dataclass(frozen=True)
class SliceOrders:
    """What rank 0 tells the machine before each slice."""

    batches: int = 0
    stop: bool = False
    parameters_changed: bool = False


def exchange_orders(group: RankGroup, orders: SliceOrders | None = None) -> SliceOrders:
    """Rank 0 sends ``orders``; the others receive them (and pass None)."""
    values = torch.zeros(3, dtype=torch.int64)
    if orders is not None:
        values[:] = torch.tensor([orders.batches, int(orders.stop), int(orders.parameters_changed)])
    with collectives("sending the slice's orders" if orders is not None else "waiting for rank 0's orders"):
        dist.broadcast(values, 0, group=group.control)
    return SliceOrders(int(values[0]), bool(values[1]), bool(values[2]))


class ParameterWrites:
    """Whether rank 0's parameters were written since they were last shared with the other ranks.

    Every in-place write through autograd's tracked operations (a swarm step's copy, a loaded
    state, an optimizer's default step) bumps the parameter's version counter; a fused optimizer
    kernel (``fused=True``, which the built-in tasks take) writes without bumping it. So the
    optimizer's steps are counted too, by a hook that runs after each of them."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
        self.params = params
        self._steps = 0
        optimizer.register_step_post_hook(self._stepped)
        self._shared = self._version()

    def _stepped(self, *_: Any) -> None:
        self._steps += 1

    def _version(self) -> int:
        return sum(param._version for param in self.params) + self._steps

    def take(self) -> bool:
        """Whether the parameters were written since the last ``take``; from now on they count as
        shared (one reading, so a write that lands meanwhile is the next take's)."""
        version = self._version()
        changed, self._shared = version != self._shared, version
        return changed


def share_parameters(group: RankGroup, model: nn.Module) -> None:
    """Rank 0's parameters, written into every other rank's: one flat broadcast per dtype."""
    broadcast_parameters(list(model.parameters()), group.leads)


def broadcast_parameters(params: list[torch.Tensor], leads: bool, group: Any = None) -> None:
    """``params`` of rank 0 (``leads``) written into every other rank's, over ``group`` (default:
    the whole job), one flat broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        by_dtype.setdefault(param.dtype, []).append(param)
    with torch.no_grad(), collectives("sharing rank 0's parameters"):
        for tensors in by_dtype.values():
            flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
            dist.broadcast(flat, 0, group=group)
            if not leads:
                for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                    tensor.copy_(part.view_as(tensor))


@dataclass(frozen=True)
class RankReport:
    """One rank's slice as rank 0 learns it: the samples it is about to compute, and the loss and
    per-batch time of its previous slice."""

    samples: int
    loss: float = math.nan
    batch_s: float = math.nan


def gather_reports(group: RankGroup, mine: RankReport) -> list[RankReport]:
    """Every rank's report, in rank order (each rank learns all of them)."""
    local = torch.tensor([mine.samples, mine.loss, mine.batch_s], dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(group.world_size)]
    with collectives("gathering the ranks' sample counts"):
        dist.all_gather(gathered, local, group=group.control)
    return [RankReport(int(row[0]), float(row[1]), float(row[2])) for row in gathered]


def machine_forward_backward(
    model: DistributedDataParallel, loss_fn: Any, batches: list, machine_samples: int, world_size: int
) -> float:
    """Gradients of the mean loss over the machine's ``machine_samples`` samples, in every rank's
    ``.grad`` (DDP reduces them at the slice's last backward pass); returns this rank's mean loss."""
    model.train()
    sizes = [len(batch[0]) for batch in batches]
    mine, mean = sum(sizes), 0.0
    with collectives("reducing gradients"):
        for position, (batch, size) in enumerate(zip(batches, sizes, strict=True)):
            last = position == len(batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = loss_fn(model, batch)
                # DDP divides the ranks' sum by world_size: this weight makes it the sample mean
                (loss * (size * world_size / machine_samples)).backward()
            mean += loss.item() * size / mine
    return mean
