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


def test_the_peers_averaged_directions_take_nesterovs_step_on_their_averaged_delta():
    """Each peer folds its own delta into its own momentum before averaging (worker momentum):
    with the mean, every replica takes exactly torch's Nesterov step on the averaged delta."""
    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.Parameter(torch.zeros(5))
    nesterov = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    replicas = [torch.nn.Parameter(torch.zeros(5)) for _ in range(4)]
    steps = [OuterStep([param], lr=0.7, momentum=0.9) for param in replicas]
    for _round in range(6):
        moves = [torch.randn(5, generator=generator) for _ in replicas]
        for param, move in zip(replicas, moves, strict=True):
            param.data.sub_(move)
        for step in steps:
            step.compute_deltas()
        averaged = torch.stack([step.deltas[0] for step in steps]).mean(dim=0)
        for step in steps:
            step.deltas[0].copy_(averaged)
            step.apply()
        reference.grad = torch.stack(moves).mean(dim=0)
        nesterov.step()
        for param in replicas:
            assert torch.allclose(param.detach(), reference.detach(), atol=1e-5)


def test_worker_momentum_narrows_the_honest_spread_next_to_the_mean():
    """What a robust aggregator lets attackers pull by is the honest directions' spread: with each
    peer's own momentum, noisy deltas (mean 1, noise 4 per coordinate) are sent as directions
    whose spread next to their mean's norm is under half the deltas' own (about a quarter at
    momentum 0.9, ``outer_step.py``)."""
    generator = torch.Generator().manual_seed(0)
    replicas = [torch.nn.Parameter(torch.zeros(256)) for _ in range(8)]
    steps = [OuterStep([param], lr=0.7, momentum=0.9) for param in replicas]
    for _round in range(30):
        deltas = [1.0 + 4.0 * torch.randn(256, generator=generator) for _ in replicas]
        for param, step, delta in zip(replicas, steps, deltas, strict=True):
            param.data.copy_(step.start[0] - delta)
            step.compute_deltas()
        sent = torch.stack([step.deltas[0] for step in steps])
        averaged = sent.mean(dim=0)
        for step in steps:
            step.deltas[0].copy_(averaged)
            step.apply()
    raw = torch.stack(deltas)
    relative_spread = [float((rows - rows.mean(0)).norm(dim=1).mean() / rows.mean(0).norm()) for rows in (raw, sent)]
    assert relative_spread[1] < 0.5 * relative_spread[0], relative_spread
