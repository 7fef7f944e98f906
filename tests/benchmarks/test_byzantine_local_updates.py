"""A quiet minority on label-skewed local updates: at the benchmark's outer learning rate the
honest peers hold what they learn; at DiLoCo's 0.7, past this task's stable outer step, the same
bounded pull keeps the swarm swinging (``benchmarks/byzantine_cases/swarm.py``, ``OUTER_LR``)."""

from __future__ import annotations

import torch
import trio

from benchmarks.byzantine_cases.swarm import OUTER_LR, Case, run_swarm

ROUNDS = 50  # 5 inner steps each; at 0.7 two min-max attackers cost 0.12 here, at 0.35 0.011


def accuracy(case: Case) -> float:
    torch.set_num_threads(1)
    return trio.run(run_swarm, case, ROUNDS).accuracy


def test_two_min_max_attackers_of_eight_cost_little_on_skewed_local_updates():
    skewed = dict(sharding="non-iid", mode="local", outer_lr=OUTER_LR)
    clean = accuracy(Case(8, 0, None, **skewed))
    attacked = accuracy(Case(8, 2, "min-max-std", **skewed))
    assert clean > 0.93
    assert clean - attacked <= 0.03, (clean, attacked)
