"""The training loop a peer runs: batches from its task, compute in a worker thread, the
collaborative optimizer in trio, an evaluation every few epochs. It keeps the figures that
``/status`` and ``/metrics`` show.

Each trip to the worker thread and each optimizer step cost the event loop a fraction of a
millisecond, as much as a whole batch of a tiny model. For an optimizer that only accumulates
gradients until the swarm's batch is full (``accumulates_batches``), batches that cheap go to the
thread several at a time, each one's loss weighted by its share of the samples, and the optimizer
steps once for all of them: exactly the gradient sum that one step per batch would accumulate.
An optimizer that steps on every batch (local updates) still gets one batch per step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.worker_threads import run_blocking

from .tasks import Task

__all__ = ["Trainer", "TrainingStatus"]

log = logging.getLogger("peerd.training")

# Batches go to the worker thread in slices of at least this much compute (when they may: see the
# module's docstring): a thread hop and an optimizer step (~0.1-0.3 ms of the loop's CPU) then cost
# a few percent of the compute at most, and the swarm sees our samples at most this much later.
MIN_SLICE_S = 0.005
MAX_SLICE_BATCHES = 64
# Held-out evaluation watches training and is no part of it, so it takes at most this share of
# the trainer's time: after an evaluation that took e seconds, the next comes e / EVAL_SHARE
# seconds later at the earliest. A digits evaluation (~1 ms) still runs every epoch; a textlm one
# costs about a training batch (~0.3 s of a CPU core), which every round of 10-20 local steps
# would lose 5-10% of the compute to. A run to a target accuracy evaluates every ``evaluate_every``
# epochs all the same: there the evaluation decides when it ends.
EVAL_SHARE = 0.03


@dataclass
class TrainingStatus:
    epoch: int = 0
    samples: int = 0
    samples_per_s: float = 0.0
    loss: float = math.nan
    accuracy: float | None = None
    eval_loss: float | None = None
    bits_per_byte: float | None = None  # text tasks report it; lower is better
    evaluated_samples: int | None = None  # this peer's samples when the figures above were taken
    peers_known: int = 1
    last_averaging: dict[str, Any] | None = None
    ranks: dict[str, Any] | None = None  # a machine of several ranks: each one's figures (machine_training.py)
    started: float = field(default_factory=time.time)


def batches_per_slice(batch_s: float, accumulates: bool) -> int:
    """How many batches of ``batch_s`` seconds each go to the worker thread at once: one, unless
    the optimizer only accumulates between steps (then several batches' gradients are one step's)
    and a batch is cheap next to a thread hop (a slice then takes about MIN_SLICE_S)."""
    if not accumulates or batch_s <= 0:
        return 1
    return max(1, min(MAX_SLICE_BATCHES, int(MIN_SLICE_S / batch_s)))


class Trainer:
    """Trains ``task.model`` with ``optimizer`` (a CollaborativeOptimizer or LocalUpdatesOptimizer)."""

    def __init__(
        self, task: Task, optimizer, *, evaluate_every: int = 1, clock: Callable[[], float] = time.perf_counter
    ):
        """``clock``: what batches and evaluations are timed with (seconds; a test gives its own)."""
        self.task = task
        self.clock = clock
        self.optimizer = optimizer
        self.evaluate_every = evaluate_every
        self.status = TrainingStatus()
        # called with each new averaging round's record (AveragingRecord) as the trainer sees it
        # land: the daemon's metrics and dashboard
        self.round_observers: list[Callable[[Any], None]] = []
        self._last_round = None
        self._batch_s = math.inf  # compute time of one batch, as last measured
        self._next_evaluation = -math.inf  # (on ``clock``) not before then: EVAL_SHARE

    @property
    def batch_s(self) -> float:
        """The compute time of one batch, as last measured (infinite before the first)."""
        return self._batch_s

    def forward_backward(self, batches: list) -> float:
        """Gradients of the mean loss over ``batches`` (summed into ``.grad``); returns that loss.

        Values below float32's normal range (~1.2e-38) compute as zeros in this thread: on x86
        each operation on such a subnormal value takes ~100x longer, and local updates' outer
        steps drive textlm's activations and gradients among them. In process, 4 peers' forward
        and backward passes of an int8 local-updates round took 1.7x longer by their 10th round
        (sparse rounds, or the same with subnormals flushed: no slower). The flag is the calling
        thread's own, and a worker thread may run this."""
        torch.set_flush_denormal(True)
        started = self.clock()
        self.task.model.train()
        sizes = [len(batch[0]) for batch in batches]
        total, mean = sum(sizes), 0.0
        for batch, size in zip(batches, sizes, strict=True):
            loss = self.task.loss_fn(self.task.model, batch)
            (loss * (size / total) if len(batches) > 1 else loss).backward()
            mean += loss.item() * size / total
        self._batch_s = (self.clock() - started) / len(batches)
        return mean

    def slice_size(self) -> int:
        """How many batches the next trip to the worker thread takes."""
        return batches_per_slice(self._batch_s, getattr(self.optimizer, "accumulates_batches", False))

    async def compute_slice(self) -> tuple[float, int]:
        """Gradients of the next slice of batches (``slice_size``), in ``.grad`` for the optimizer;
        returns their mean loss and the samples they hold, which the optimizer counts for the swarm
        (a machine of several ranks counts all of its ranks': ``machine_training.py``)."""
        batches = [next(self.task.batches) for _ in range(self.slice_size())]
        loss = await run_blocking(self.forward_backward, batches)
        return loss, sum(len(batch[0]) for batch in batches)

    def _evaluate(self) -> dict[str, float]:
        started = self.clock()
        self.task.model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(self.task.model)
        finished = self.clock()
        self._next_evaluation = finished + (finished - started) * (1 / EVAL_SHARE - 1)
        return metrics

    async def run(self, *, max_epochs: int | None = None, target_accuracy: float | None = None) -> TrainingStatus:
        """Train until ``max_epochs`` or ``target_accuracy`` (whichever first; forever if neither)."""
        status = self.status
        while max_epochs is None or self.optimizer.epoch < max_epochs:
            loss, samples = await self.compute_slice()
            status.loss = loss if math.isnan(status.loss) else 0.9 * status.loss + 0.1 * loss
            stepped = await self.optimizer.step(samples)
            status.samples += samples
            status.samples_per_s = self.optimizer.samples_per_s
            status.peers_known = max(1, len(self.optimizer.swarm.peers))
            record = self.optimizer.last_round
            if record is not None and record is not self._last_round:
                self._last_round = record
                for observe in self.round_observers:
                    observe(record)
            if self.optimizer.epoch != status.epoch:  # stepped, or caught up by loading state
                status.epoch = self.optimizer.epoch
                status.last_averaging = self.optimizer.last_averaging
                last = max_epochs is not None and status.epoch >= max_epochs  # the figures it ends with
                # with a target, the evaluation is what ends the run: never skipped to save time
                spare = target_accuracy is not None or self.clock() >= self._next_evaluation
                due = status.epoch % self.evaluate_every == 0 and spare
                if stepped and (due or last):
                    metrics = await run_blocking(self._evaluate)
                    status.accuracy, status.eval_loss = metrics.get("accuracy"), metrics.get("loss")
                    status.bits_per_byte = metrics.get("bits_per_byte")
                    status.evaluated_samples = status.samples
                    log.info(
                        "epoch %d: loss %.3f, held-out accuracy %.3f%s, %.0f samples/s",
                        status.epoch,
                        status.loss,
                        status.accuracy if status.accuracy is not None else math.nan,
                        "" if status.bits_per_byte is None else f", {status.bits_per_byte:.3f} bits/byte",
                        status.samples_per_s,
                    )
                    if target_accuracy is not None and (status.accuracy or 0.0) >= target_accuracy:
                        break
        return status
