"""A Hugging Face ``transformers.Trainer`` as a swarm peer: its optimizer wrapped in a
``SwarmOptimizer`` (``swarm_optimizer.py``), and a ``PeerdCallback`` that shows the swarm's epoch
in the trainer's logs and leaves the swarm when training ends.

    optimizer = hf_swarm_optimizer(model, args, run_id="my-run", initial_peers=["10.0.0.5:31337"])
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None),
                      callbacks=[PeerdCallback(optimizer)])

Each of the trainer's optimizer steps counts ``per_device_train_batch_size x
gradient_accumulation_steps x world_size`` samples toward the swarm's batch; the trainer clips
gradients before the step as usual. Needs the ``hf`` extra (``pip install 'peerd[hf]'``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from averaging.optimizer_state import fused_where_supported

from .swarm_optimizer import SwarmOptimizer

__all__ = ["PeerdCallback", "hf_swarm_optimizer"]


def hf_swarm_optimizer(
    model: torch.nn.Module,
    args: TrainingArguments,
    *,
    run_id: str,
    target_batch_size: int = 256,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> SwarmOptimizer:
    """``optimizer`` (default: AdamW at ``args.learning_rate`` and ``args.weight_decay``) trained with
    the swarm of ``run_id``; ``options``: ``SwarmOptimizer``'s (``initial_peers``, ``mode``...)."""
    if optimizer is None:
        optimizer = fused_where_supported(
            torch.optim.AdamW, model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
        )
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    return SwarmOptimizer(
        optimizer, run_id=run_id, batch_size_per_step=per_step, target_batch_size=target_batch_size, **options
    )


class PeerdCallback(TrainerCallback):
    """Adds ``swarm_epoch`` to the trainer's logs, and leaves the swarm when training ends."""

    def __init__(self, optimizer: SwarmOptimizer):
        self.optimizer = optimizer

    def on_log(self, args: TrainingArguments, state: Any, control: Any, logs: dict | None = None, **kwargs: Any):
        if logs is not None:
            logs["swarm_epoch"] = self.optimizer.epoch

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any):
        self.optimizer.shutdown()
