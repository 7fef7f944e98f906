"""The trainer's share of work around the batches: cheap batches go to its worker thread several at a
time when the optimizer only accumulates them (the gradients it then steps on are exactly those of
one step per batch), and held-out evaluation takes a bounded share of its time."""

from __future__ import annotations

import math

import pytest
import torch

from averaging.progress import SwarmProgress
from peerd import training
from peerd.tasks import ShardSpec, digits_task
from peerd.training import MIN_SLICE_S, Trainer, batches_per_slice


class Recording:
    """An optimizer stand-in: all the trainer reads of it here is whether it accumulates."""

    def __init__(self, params, accumulates: bool):
        self.params = list(params)
        self.accumulates_batches = accumulates


def test_a_slice_of_batches_gives_the_gradient_sum_of_one_step_per_batch():
    task = digits_task(shard=ShardSpec(0, 1))
    trainer = Trainer(task, Recording(task.model.parameters(), accumulates=True))
    batches = [next(task.batches) for _ in range(3)]
    batches[2] = (batches[2][0][:8], batches[2][1][:8])  # uneven sizes weigh as their samples do
    sizes = [len(b[0]) for b in batches]
    params = list(task.model.parameters())

    expected = [torch.zeros_like(p) for p in params]
    for batch, size in zip(batches, sizes, strict=True):
        trainer.forward_backward([batch])
        for total, p in zip(expected, params, strict=True):
            total.add_(p.grad, alpha=size)
            p.grad = None
    loss = trainer.forward_backward(batches)
    for total, p in zip(expected, params, strict=True):
        torch.testing.assert_close(p.grad * sum(sizes), total, rtol=1e-5, atol=1e-6)
    assert loss > 0


class BatchClock:
    """A clock that moves ``batch_s`` per batch the trainer computes (it reads the clock before and
    after a slice of ``batches`` batches)."""

    def __init__(self, batch_s: float, batches: int):
        self.batch_s, self.batches, self.now, self.reads = batch_s, batches, 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += self.batch_s * self.batches
        return self.now


def test_only_an_accumulating_optimizer_gets_several_cheap_batches_per_step():
    task = digits_task(shard=ShardSpec(0, 1))
    cheap = BatchClock(MIN_SLICE_S / 10, batches=2)  # (a digits batch takes about this on an idle core)
    accumulating = Trainer(task, Recording(task.model.parameters(), accumulates=True), clock=cheap)
    assert accumulating.slice_size() == 1  # nothing measured yet
    accumulating.forward_backward([next(task.batches)] * 2)
    assert accumulating.batch_s == pytest.approx(MIN_SLICE_S / 10)  # measured per batch
    assert accumulating.slice_size() == 10
    costly = Trainer(
        task, Recording(task.model.parameters(), accumulates=True), clock=BatchClock(MIN_SLICE_S * 3, batches=1)
    )
    costly.forward_backward([next(task.batches)])
    assert costly.slice_size() == 1  # a batch that costs more than a hop goes alone
    stepping = Trainer(
        task, Recording(task.model.parameters(), accumulates=False), clock=BatchClock(MIN_SLICE_S / 10, 1)
    )
    stepping.forward_backward([next(task.batches)])
    assert stepping.slice_size() == 1
    assert batches_per_slice(MIN_SLICE_S / 10, accumulates=False) == 1
    real = Trainer(task, Recording(task.model.parameters(), accumulates=True))
    real.forward_backward([next(task.batches)])
    assert 0 < real.batch_s < math.inf  # the default clock measures real time


class SteppingEveryBatch(Recording):
    """An optimizer stand-in that ends an epoch at every step."""

    def __init__(self, params):
        super().__init__(params, accumulates=False)
        self.epoch = 0
        self.samples_per_s = 0.0
        self.swarm = SwarmProgress({}, 0)
        self.last_round = None
        self.last_averaging = None

    async def step(self, batch_size: int) -> bool:
        self.epoch += 1
        return True


def trainer_on_a_fake_clock(evaluate) -> Trainer:
    """A digits trainer whose batches and evaluations each cost 10 ms of a fake clock;
    ``evaluate(trainer)`` gives an evaluation's figures."""
    clock = [0.0]
    task = digits_task(shard=ShardSpec(0, 1))
    trainer = Trainer(task, SteppingEveryBatch(task.model.parameters()), clock=lambda: clock[0])
    train_loss = task.loss_fn

    def batch_costing_10ms(model, batch):
        clock[0] += 0.01
        return train_loss(model, batch)

    def evaluation_costing_10ms(model):
        clock[0] += 0.01
        return evaluate(trainer)

    task.loss_fn, task.evaluate = batch_costing_10ms, evaluation_costing_10ms
    return trainer


async def test_held_out_evaluation_takes_a_bounded_share_of_the_time_and_ends_the_run():
    """An evaluation costing as much as a batch (textlm's does) runs every ~1 / EVAL_SHARE epochs
    here, not every epoch; the run's last epoch is always evaluated."""
    evaluated_at: list[int] = []

    def evaluate(trainer):
        evaluated_at.append(trainer.optimizer.epoch)
        return {"accuracy": 0.5, "loss": 1.0}

    trainer = trainer_on_a_fake_clock(evaluate)
    await trainer.run(max_epochs=100)
    assert evaluated_at[0] == 1 and evaluated_at[-1] == 100
    assert trainer.status.evaluated_samples == trainer.status.samples  # what the figures belong to
    assert 3 <= len(evaluated_at) <= 100 * training.EVAL_SHARE + 2, evaluated_at


async def test_a_run_to_a_target_accuracy_stops_at_the_first_epoch_that_reaches_it():
    """With a target the evaluation decides when the run ends, so it is not skipped to save time:
    peers training to a target stop together instead of up to 1 / EVAL_SHARE epochs apart."""
    trainer = trainer_on_a_fake_clock(
        lambda trainer: {"accuracy": 0.95 if trainer.optimizer.epoch >= 10 else 0.5, "loss": 1.0}
    )
    status = await trainer.run(max_epochs=100, target_accuracy=0.9)
    assert status.epoch == 10 and status.accuracy == 0.95
