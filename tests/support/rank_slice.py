"""One rank of a two-rank gloo group, for tests/daemon/test_machine_slices.py (run with torchrun's
variables set): a slice whose ranks hold different sample counts, reduced by
``machine_forward_backward``, then parameters that rank 0 changed and shares. Writes what this rank
ended with to ``OUT/rank{R}.pt`` (a file of the test's own). With ``sharded`` after OUT, the same
slice under FSDP (``ShardedCompute``): its gradients delivered to rank 0's whole model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from peerd.machine import (
    RankReport,
    SliceOrders,
    exchange_orders,
    gather_reports,
    join_rank_group,
    leave_rank_group,
    machine_forward_backward,
    share_parameters,
    wrap_model,
)
from peerd.machine_sharded import machine_compute
from peerd.ranks import rank_place

# rows of the data each rank's batches hold: 8 samples on rank 0, 2 on rank 1
BATCHES = {0: [(0, 3), (3, 8)], 1: [(8, 10)]}
# under FSDP every rank runs as many backward passes (a slice's orders say how many batches)
SHARDED_BATCHES = {0: [(0, 3), (3, 8)], 1: [(8, 9), (9, 10)]}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(10, 4, generator=generator), torch.randn(10, 3, generator=generator)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


class Stack(nn.Module):
    """``model()`` as a list of blocks (FSDP shards each on its own), with the same parameters,
    a frozen one, and a buffer that counts forward passes (as running statistics change)."""

    def __init__(self):
        super().__init__()
        first, _, last = model()
        self.blocks = nn.ModuleList([first, last])
        self.scale = nn.Parameter(torch.full((3,), 0.5), requires_grad=False)
        self.register_buffer("passes", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        return self.blocks[1](torch.tanh(self.blocks[0](x))) * self.scale


def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(module(batch[0]), batch[1])


def _differ_on_rank_1(rank: int, net: nn.Module) -> None:
    """Rank 1's parameters start elsewhere than rank 0's."""
    if rank == 1:
        with torch.no_grad():
            for param in net.parameters():
                param.add_(5.0)


def _step_on_rank_0(rank: int, net: nn.Module) -> None:
    """Rank 0 changes its parameters, as its optimizer would (to -2x)."""
    if rank == 0:
        with torch.no_grad():
            for param in net.parameters():
                param.mul_(-2.0)


def _rank_batches(group, rows: dict[int, list[tuple[int, int]]]) -> tuple[list, list[RankReport]]:
    """This rank's batches (``rows`` of the data, by rank), and every rank's sample count."""
    inputs, targets = data()
    batches = [(inputs[a:b], targets[a:b]) for a, b in rows[group.rank]]
    return batches, gather_reports(group, RankReport(sum(len(batch[0]) for batch in batches)))


def main(out: Path) -> None:
    group = join_rank_group(rank_place(), "cpu")
    net = model()
    _differ_on_rank_1(group.rank, net)  # DDP must start it from rank 0's parameters
    ddp = wrap_model(group, net)
    batches, reports = _rank_batches(group, BATCHES)
    machine_forward_backward(ddp, loss_fn, batches, sum(r.samples for r in reports), group.world_size)
    grads = [param.grad.clone() for param in net.parameters()]
    _step_on_rank_0(group.rank, net)
    orders = exchange_orders(group, SliceOrders(batches=3, parameters_changed=True) if group.rank == 0 else None)
    share_parameters(group, net)
    params = [param.detach().clone() for param in net.parameters()]
    samples = [report.samples for report in reports]
    torch.save(
        {"grads": grads, "params": params, "orders": orders.batches, "samples": samples}, out / f"rank{group.rank}.pt"
    )
    leave_rank_group()


def main_sharded(out: Path) -> None:
    group = join_rank_group(rank_place(), "cpu", sharded=True)
    net = Stack()
    _differ_on_rank_1(group.rank, net)  # the machine must start from rank 0's parameters
    compute = machine_compute(group, net)
    batches, reports = _rank_batches(group, SHARDED_BATCHES)
    for _ in range(2):  # two slices: rank 0's gradients add up, as backward passes' do
        compute.forward_backward(loss_fn, batches, sum(r.samples for r in reports))
        compute.deliver_gradients()
    grads = [None if param.grad is None else param.grad.clone() for param in net.parameters()]
    _step_on_rank_0(group.rank, net)
    passes = float(net.passes)  # rank 0's: its host model's, as the slices left it
    if group.rank == 1:
        compute.model.passes.fill_(77.0)  # rank 0's buffers must replace it
    compute.receive_parameters()
    params = [param.full_tensor().detach().clone() for param in compute.model.parameters()]
    kept = {"grads": grads, "params": params, "kind": compute.kind, "passes": passes}
    torch.save({**kept, "received_passes": float(compute.model.passes)}, out / f"rank{group.rank}.pt")
    leave_rank_group()


if __name__ == "__main__":
    (main_sharded if sys.argv[2:] == ["sharded"] else main)(Path(sys.argv[1]))


def unshardable_digits(shard, device):
    """``--task tests.support.rank_slice:unshardable_digits``: digits with a scalar parameter,
    which FSDP refuses to shard."""
    from peerd.tasks import digits_task

    task = digits_task(shard=shard, device=device)
    task.model.register_parameter("scalar", nn.Parameter(torch.tensor(1.0)))
    return task
