"""How the ranks of a machine (``machine.py``) hold the model while they compute a slice: each
rank the whole model under DDP (``ReplicatedCompute``), or each rank a 1/N shard of it under FSDP
(``ShardedCompute``, ``peerd join --shard-model``) for a model whose parameters, gradients and
optimizer state do not fit one device.

Both answer the same three calls, in the same order on every rank (each is a collective):
``receive_parameters`` (rank 0's parameters into every rank's compute copy),
``forward_backward`` (the slice's gradients of the mean loss over the machine's samples) and
``deliver_gradients`` (those gradients into rank 0's model, where its optimizer reads them).

With FSDP, rank 0's model (the swarm's: its optimizer, averaging, state downloads and held-out
evaluation) stays whole in host memory and its optimizer steps there, ZeRO-Offload's trade: the
devices hold only shards (and one block's gathered parameters at a time), the host holds the
model once more, and each parameter crosses the bus once per slice each way. The swarm's view is
the same either way: one peer, the machine's samples, rank 0's parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .machine import RankGroup, collectives, machine_forward_backward, share_parameters, wrap_model
from .ranks import RankError

__all__ = ["ReplicatedCompute", "ShardedCompute", "machine_compute"]


class ReplicatedCompute:
    """DDP: every rank holds the whole model; rank 0's ``model`` is the swarm's model itself, so
    its gradients are already where its optimizer reads them."""

    kind = "ddp"

    def __init__(self, group: RankGroup, model: nn.Module):
        self.group = group
        self.model = model
        self.ddp = wrap_model(group, model)  # DDP starts every rank from rank 0's parameters

    def receive_parameters(self) -> None:
        share_parameters(self.group, self.model)

    def forward_backward(self, loss_fn: Any, batches: list, machine_samples: int) -> float:
        if not self.group.leads:  # followers keep no optimizer: each slice's gradients are new
            for param in self.model.parameters():
                param.grad = None
        return machine_forward_backward(self.ddp, loss_fn, batches, machine_samples, self.group.world_size)

    def deliver_gradients(self) -> None:
        """Nothing to move: DDP left the machine's gradients in every rank's model."""


class ShardedCompute:
    """FSDP2: each rank holds a 1/N shard of every parameter on its device; the blocks of every
    ``nn.ModuleList`` (a transformer's layers) are gathered one at a time during a pass. ``model``
    is this rank's copy to shard in place; ``host`` is rank 0's whole model (None elsewhere), whose
    parameters the machine starts from at once and whose ``.grad`` receives each slice's gradients."""

    kind = "fsdp"

    def __init__(self, group: RankGroup, model: nn.Module, host: nn.Module | None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if group.leads != (host is not None):
            raise ValueError("rank 0, and only rank 0, holds the whole model")
        self.group = group
        self.host = host
        try:
            with collectives("sharding the model"):
                mesh = init_device_mesh(group.device.type, (group.world_size,))
                for block in _blocks(model):
                    fully_shard(block, mesh=mesh)
                self.model = fully_shard(model, mesh=mesh)
        except (ValueError, TypeError, NotImplementedError, AssertionError) as error:  # what FSDP refuses
            raise RankError(f"rank {group.rank} could not shard the model (--shard-model): {error}") from None
        self.receive_parameters()  # the followers loaded their own initial parameters

    def receive_parameters(self) -> None:
        """Rank 0's parameters, one at a time, scattered from its whole copy so that each rank
        keeps its shard (raw tensors, never pickled), and its buffers broadcast whole (FSDP keeps
        buffers whole on every rank)."""
        from torch.distributed.tensor import distribute_tensor

        device = self.group.device
        host = self.host
        with torch.no_grad(), collectives("sharing rank 0's parameters"):
            for name, param in self.model.named_parameters():
                if host is not None:
                    whole = host.get_parameter(name).detach().to(device, param.dtype)
                else:  # only its shape counts: rank 0's values are scattered into it
                    whole = torch.empty(param.shape, dtype=param.dtype, device=device)
                shard = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=0)
                param.to_local().copy_(shard.to_local())
            for name, buffer in self.model.named_buffers():
                if host is not None:
                    buffer.copy_(host.get_buffer(name))
                dist.broadcast(buffer, 0)

    def forward_backward(self, loss_fn: Any, batches: list, machine_samples: int) -> float:
        """As ``machine_forward_backward``, except that each batch's gradients are reduce-scattered
        as it ends (FSDP's mean over the ranks), so no rank ever holds a whole gradient; every rank
        runs as many batches (a slice's orders say how many), their sizes may differ."""
        self.model.train()
        sizes = [len(batch[0]) for batch in batches]
        mine, mean = sum(sizes), 0.0
        with collectives("reducing gradients"):
            for batch, size in zip(batches, sizes, strict=True):
                loss = loss_fn(self.model, batch)
                (loss * (size * self.group.world_size / machine_samples)).backward()
                mean += loss.item() * size / mine
        return mean

    def deliver_gradients(self) -> None:
        """Each trained parameter's gradient gathered whole, added to rank 0's ``.grad`` on the host
        (as a backward pass would accumulate it), and rank 0's buffers (running statistics) copied
        there; every rank's gradient shards are then cleared for the next slice."""
        host = self.host
        with torch.no_grad(), collectives("gathering gradients on rank 0"):
            for name, param in self.model.named_parameters():
                if not param.requires_grad:  # frozen: no gradient, as on a lone peer
                    continue
                grad = param.grad if param.grad is not None else torch.zeros_like(param)  # unused this slice
                whole = grad.full_tensor()
                param.grad = None
                if host is not None:
                    target = host.get_parameter(name)
                    whole = whole.to(target.device, target.dtype)
                    target.grad = whole if target.grad is None else target.grad.add_(whole)
            if host is not None:  # running statistics: rank 0's, as DDP broadcasts them
                for name, buffer in self.model.named_buffers():
                    host.get_buffer(name).copy_(buffer)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own, innermost first: every element of every ``nn.ModuleList``."""
    blocks = [child for module in model.modules() if isinstance(module, nn.ModuleList) for child in module]
    return list(reversed(blocks))


def machine_compute(group: RankGroup, model: nn.Module) -> ReplicatedCompute | ShardedCompute:
    """How this rank computes slices: ``model`` is its task's model (rank 0's is the swarm's; with
    ``group.sharded`` it was loaded on the host and rank 0 shards a copy of it)."""
    if not group.sharded:
        return ReplicatedCompute(group, model)
    if group.leads:
        return ShardedCompute(group, copy.deepcopy(model), host=model)
    return ShardedCompute(group, model, host=None)
