"""The collaborative optimizer at scale on the simulated internet (``tests/support/sim_training.py``):
real hosts, DHT nodes and optimizers on a tiny model, under trio's virtual clock, with peers
replaced while they train, 30% of them behind NAT, and the swarm split in two for a while.

Asserted, of the peers that stayed: every one trained through every epoch (the swarm's progress
records carried each epoch to its end); the share of their epochs (outside the partition) whose
gradients averaged; every newcomer averaged within a bound of its join; and, as a check that
nothing diverged, their weights ten times closer to the truth and to each other than the truth was
at the start (every peer draws from the same distribution, so this holds for a peer on its own too:
the averaged share is what says the swarm averaged). The scale target for that share is 0.99;
this swarm reaches 0.88-0.99 in runs of 24 peers (trio's order among tasks ready at one virtual
instant is not seeded), so the test holds it to 0.8 (0.70 with LAN deadlines) and the gap is
stated in the README's scale row; at 64 peers in groups of 16 it is 0.56-0.69 (``benchmarks/scale.py
--optimizer-peers 64``), not asserted until it is fixed. Groups form at the step here; ``peerd join`` forms them ahead
(``MatchAhead``), which reached 0.92 in one run and is not asserted."""

from __future__ import annotations

import pytest

from averaging.settings import AveragingSettings
from dht import DHTConfig
from tests.support.sim_scale import JOIN_RETRY_S, JOIN_TRIES
from tests.support.sim_training import TrainingScenario, run_training

BOOTSTRAP_S = DHTConfig().bootstrap_timeout  # for each try
LOAD_STATE_S = AveragingSettings().load_state_timeout


def newcomer_bound(scenario: TrainingScenario) -> float:
    """A DHT bootstrap and its retries past a partition, a state download, then an epoch that
    may fail (matchmaking and all-reduce, each under its deadline) before one that averages."""
    join = JOIN_TRIES * (BOOTSTRAP_S + JOIN_RETRY_S)
    return join + LOAD_STATE_S + 2 * (scenario.matchmaking_timeout + scenario.averaging_timeout)


@pytest.mark.timeout(300)
async def test_a_churning_partitioned_swarm_trains_with_the_collaborative_optimizer(autojump_clock):
    scenario = TrainingScenario(
        peers=24,
        group_size=8,
        epochs=12,
        nat_fraction=0.3,
        churn_per_minute=0.1,
        partition_at=30.0,
        seed=24,
    )
    report = await run_training(scenario)
    summary = vars(report)
    assert report.least_epoch >= scenario.epochs and report.partition_healed, summary
    assert report.departures >= 1 and report.join_failures == 0, summary
    assert report.newcomers + report.newcomers_joining == report.departures, summary
    assert report.averaged_fraction >= 0.8, summary
    assert report.averaged_fraction_of_epochs >= 0.8, summary  # (a round it skipped: one it took no part in)
    assert report.error_after <= report.error_before / 10, summary
    assert report.spread <= report.error_before / 10, summary
    waited = report.newcomer_first_average_s + report.newcomers_unaveraged_s
    assert len(waited) == report.newcomers and max(waited) <= newcomer_bound(scenario), summary
