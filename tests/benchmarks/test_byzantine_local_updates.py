"""A quiet minority on label-skewed local updates: at the benchmark's outer learning rate
(``benchmarks/byzantine_cases/swarm.py``, ``OUTER_LR``) the honest peers hold what they learn."""

from __future__ import annotations

import trio

from benchmarks.byzantine_cases.swarm import Case, run_swarm

ROUNDS = 50  # of 5 inner steps: two min-max attackers cost 0.011 here at the outer lr 0.35 (0.12 at 0.7)


def accuracy(case: Case) -> float:
    return trio.run(run_swarm, case, ROUNDS).accuracy


def test_two_min_max_attackers_of_eight_cost_little_on_skewed_local_updates():
    skewed = dict(sharding="non-iid", mode="local")
    clean = accuracy(Case(8, 0, None, **skewed))
    attacked = accuracy(Case(8, 2, "min-max-std", **skewed))
    assert clean > 0.93
    assert clean - attacked <= 0.03, (clean, attacked)
