"""The gradient of a task's held-out loss at given parameter values: what a peer that scores
contributions (``peerd join --score-contributions``, ``averaging/contribution_scores.py``) scores
them against.

It runs on a copy of the task's model, so that the averager's worker thread never touches the
parameters that training changes meanwhile (local updates keep training while a round averages,
and the point scored at is the shared start, not the live parameters); one lock serialises the
copy and the batches between rounds that overlap.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

import torch

from averaging.contribution_scores import HeldOutGradient

from .task_types import Task

__all__ = ["held_out_gradient"]


def held_out_gradient(task: Task) -> HeldOutGradient | None:
    """The task's held-out gradient function, or None if it has no held-out batches. It takes the
    values of the model's parameters in ``model.parameters()`` order (the order ``peerd join``
    gives the optimizer) and runs the copy in eval mode (no dropout noise), with the live
    model's buffers (batch-norm statistics) as they are when it is called."""
    batches = task.validation_batches
    if batches is None:
        return None
    scratch = copy.deepcopy(task.model).eval()
    params = list(scratch.parameters())
    lock = threading.Lock()

    def gradient(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(values) != len(params):
            raise ValueError(f"{len(values)} values for a model of {len(params)} parameters")
        with lock:
            with torch.no_grad():
                for param, value in zip(params, values, strict=True):
                    param.copy_(value)
                for mine, live in zip(scratch.buffers(), task.model.buffers(), strict=True):
                    mine.copy_(live)
            loss = task.loss_fn(scratch, next(batches))
            found = torch.autograd.grad(loss, params, allow_unused=True)
            return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, found, strict=True)]

    return gradient
