"""The outer step's arithmetic (``averaging/outer_step.py``), without a swarm."""

from __future__ import annotations

import torch

from averaging.outer_step import OuterStep


def test_outer_momentum_zero_at_lr_one_moves_every_replica_to_the_replicas_average():
    """Momentum 0 is a valid outer optimizer (plain averaging at lr 1, which beat Nesterov 0.9 in
    ``benchmarks/diloco_sim.py``); torch refuses Nesterov without momentum, so it used to raise."""
    start = torch.tensor([1.0, 2.0, 3.0])
    ends = [torch.tensor([0.0, 2.0, 5.0]), torch.tensor([2.0, 4.0, 3.0])]
    replicas = [torch.nn.Parameter(start.clone()) for _ in ends]
    steps = [OuterStep([param], lr=1.0, momentum=0.0) for param in replicas]
    for param, end in zip(replicas, ends, strict=True):
        param.data.copy_(end)
    for step in steps:
        step.compute_deltas()
    averaged = torch.stack([step.deltas[0] for step in steps]).mean(dim=0)
    for round_ in range(2):  # twice: no momentum carries the first step into the second
        for step in steps:
            step.deltas[0].copy_(averaged if round_ == 0 else torch.zeros(3))
            step.apply()
        for param, step in zip(replicas, steps, strict=True):
            assert torch.allclose(param.detach(), torch.tensor([1.0, 3.0, 4.0]))
            assert torch.allclose(step.start[0], torch.tensor([1.0, 3.0, 4.0]))


def test_outer_momentum_keeps_nesterov():
    step = OuterStep([torch.nn.Parameter(torch.zeros(2))], lr=0.7, momentum=0.9)
    assert step.optimizer.param_groups[0]["nesterov"] is True
