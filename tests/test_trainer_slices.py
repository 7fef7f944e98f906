"""The trainer hands cheap batches to its worker thread several at a time, when the optimizer only
accumulates them: the gradients it then steps on are exactly those of one step per batch."""

from __future__ import annotations

import math

import torch

from peer.daemon.tasks import ShardSpec, digits_task
from peer.daemon.training import MIN_SLICE_S, Trainer


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
        trainer._forward_backward([batch])
        for total, p in zip(expected, params, strict=True):
            total.add_(p.grad, alpha=size)
            p.grad = None
    loss = trainer._forward_backward(batches)
    for total, p in zip(expected, params, strict=True):
        torch.testing.assert_close(p.grad * sum(sizes), total, rtol=1e-5, atol=1e-6)
    assert loss > 0


def test_only_an_accumulating_optimizer_gets_several_cheap_batches_per_step():
    task = digits_task(shard=ShardSpec(0, 1))
    accumulating = Trainer(task, Recording(task.model.parameters(), accumulates=True))
    assert accumulating._slice() == 1  # nothing measured yet
    accumulating._forward_backward([next(task.batches)] * 2)
    assert 0 < accumulating._batch_s < math.inf  # measured per batch
    accumulating._batch_s = MIN_SLICE_S / 10  # (a digits batch takes about this on an idle core)
    assert accumulating._slice() == 10
    accumulating._batch_s = MIN_SLICE_S * 3  # a batch that costs more than a hop goes alone
    assert accumulating._slice() == 1
    stepping = Trainer(task, Recording(task.model.parameters(), accumulates=False))
    stepping._batch_s = MIN_SLICE_S / 10
    assert stepping._slice() == 1
