"""What a task is: the model, this peer's data shard, the loss and an evaluation (``Task``), which
part of the data a peer trains on (``ShardSpec``), and the error for a task that cannot load."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Task", "ShardSpec", "TaskError", "model_device"]


class TaskError(ValueError):
    """A task name or factory that cannot be loaded; the message says what was tried."""


@dataclass(frozen=True)
class ShardSpec:
    """Which part of the data this peer trains on: shard ``index`` of ``count`` (seeded shuffle)."""

    index: int = 0
    count: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise TaskError(f"shard index {self.index} must be in [0, {self.count})")


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the built-in tasks' losses and evaluations move their batches
    there at each call rather than to the device they were loaded for, so the same task serves
    the whole model on the host and its sharded copy on a GPU (``machine_sharded.py``)."""
    return next(model.parameters()).device


@dataclass
class Task:
    name: str
    model: nn.Module
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]  # endless stream of this peer's batches
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]  # at least {"accuracy": ..., "loss": ...}
    batch_size: int
    target_batch_size: int  # samples the whole swarm accumulates per optimizer step
    # endless batches of data every peer holds alike, never the evaluation's: what this peer scores
    # the others' contributions against (``averaging/contribution_scores.py``); None: it scores none
    validation_batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
