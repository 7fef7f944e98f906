"""The sans-I/O rules of how long to wait for a peer and how fast this peer's link is
(``averaging/link_speed.py``), and how claimed bandwidths split a round (``partition.py``),
driven with plain numbers: no sockets, no clock."""

from __future__ import annotations

import math

import pytest

from averaging.link_speed import (
    BURST_ALLOWANCE,
    MIN_MEASURED_BYTES,
    BandwidthEstimate,
    DeadlineRules,
    ProgressDeadline,
    ThroughputMeter,
    link_rate,
)
from averaging.partition import MAX_SHARE_RATIO, AllReducePlan, bounded_claims

RULES = DeadlineRules(stall=2.0, min_rate=1000.0, slack=3.0)


def test_a_peer_that_keeps_delivering_keeps_its_place_until_the_cap():
    deadline = ProgressDeadline(RULES, owed_bytes=20_000, now=100.0)  # cap: 3 + 20 s
    deadline.observe(100.0, 5)  # what the connection carried before: not progress
    assert deadline.deadline == 103.0  # the first byte is owed within the slack
    for step in range(1, 20):  # one byte a second: slow, but alive
        now = 100.0 + step
        deadline.observe(now, 5 + step)
        assert not deadline.expired(now)
        assert deadline.deadline == min(now + 2.0, 123.0)
    assert deadline.expired(123.0)
    assert "cap" in deadline.reason(123.0)


def test_a_peer_that_stops_is_given_up_one_stall_interval_after_its_last_byte():
    deadline = ProgressDeadline(RULES, owed_bytes=10**9, now=0.0)
    deadline.observe(0.0, 0)
    deadline.observe(0.5, 1000)
    deadline.observe(1.0, 1000)
    deadline.observe(2.4, 1000)
    assert not deadline.expired(2.4)
    assert deadline.expired(2.5)
    assert deadline.reason(2.5) == "no byte for 2 s"


def test_a_peer_that_never_sends_is_given_up_after_the_slack():
    deadline = ProgressDeadline(RULES, owed_bytes=10**9, now=0.0)
    deadline.observe(0.0, 7)
    deadline.observe(2.9, 7)
    assert not deadline.expired(2.9)
    assert deadline.expired(3.0)
    assert "no byte within 3 s" in deadline.reason(3.0)


def test_a_lost_connection_gives_the_peer_up_at_once():
    deadline = ProgressDeadline(RULES, owed_bytes=10**9, now=0.0)
    deadline.observe(0.1, 50)
    deadline.gone("connection lost: refused")
    assert deadline.deadline == -math.inf and deadline.expired(0.1)
    assert deadline.reason(0.1) == "connection lost: refused"


def test_a_quiet_spell_waits_for_the_cap_only_and_then_bytes_are_owed_again():
    """A reducer that has taken our parts may wait for the other senders before it answers."""
    deadline = ProgressDeadline(RULES, owed_bytes=10_000, now=0.0)  # cap at 13 s
    deadline.observe(0.0, 0)
    deadline.observe(1.0, 100)
    deadline.quiet = True
    assert deadline.deadline == 13.0 and not deadline.expired(9.0)
    deadline.resume(9.0)
    assert deadline.deadline == 11.0


def test_a_senders_wait_for_answers_outlasts_the_reducers_wait_for_a_silent_sender():
    """The reducer gives up on a silent sender at its own cap, counted from when it heard of the
    round: a sender waiting quietly for its answers waits a stall interval more (a caller's cap
    still bounds it)."""
    reducers_wait = ProgressDeadline(RULES, owed_bytes=100, now=0.5)  # heard of the round later
    senders_wait = ProgressDeadline.for_replies(RULES, owed_bytes=100, now=0.0)
    senders_wait.quiet = True
    assert reducers_wait.cap_at == 0.5 + 3.0 + 0.1  # slack + its bytes at the floor rate
    assert senders_wait.deadline == 3.0 + 2.0 + 0.1 > reducers_wait.cap_at  # + a stall interval
    capped = DeadlineRules(stall=2.0, min_rate=1000.0, slack=3.0, cap=4.0)
    assert ProgressDeadline.for_replies(capped, owed_bytes=100, now=10.0).cap_at == 14.0


def test_a_callers_cap_bounds_every_deadline():
    rules = DeadlineRules(stall=2.0, min_rate=1000.0, slack=3.0, cap=4.0)
    deadline = ProgressDeadline(rules, owed_bytes=10**9, now=10.0)
    deadline.observe(10.0, 0)
    deadline.observe(13.5, 1)
    assert deadline.deadline == 14.0


def steady(meter: ThroughputMeter, rate: float, seconds: float, start: float = 0.0, poll: float = 0.05) -> None:
    for step in range(int(seconds / poll) + 1):
        meter.observe(start + step * poll, int(rate * step * poll))


def test_the_meter_measures_a_steady_link_close_to_its_rate():
    meter = ThroughputMeter()
    steady(meter, 625_000.0, 6.0)  # 5 Mbit/s for 6 s
    assert 0.9 * 625_000 < meter.rate() <= 625_000


def test_a_shapers_burst_does_not_pass_for_the_links_rate():
    """A token bucket lets BURST_ALLOWANCE bytes through at once after a quiet spell: a 5 Mbit/s link
    must not measure like a fast one for it."""
    meter = ThroughputMeter()
    meter.observe(0.0, 0)
    meter.observe(0.05, BURST_ALLOWANCE)  # the bucket, in one poll
    for step in range(1, 80):
        meter.observe(0.05 + step * 0.05, BURST_ALLOWANCE + int(625_000 * step * 0.05))
    assert meter.rate() <= 625_000


def test_a_fast_link_that_finishes_early_is_measured_by_its_busy_spell_not_the_rounds_length():
    meter = ThroughputMeter()
    steady(meter, 12_500_000.0, 0.4)  # 100 Mbit/s: 5 MB in 0.4 s
    total = 5_000_000
    for step in range(1, 100):  # then it waits 5 s for the slow peer, idle
        meter.observe(0.4 + step * 0.05, total)
    assert meter.rate() > 0.8 * 12_500_000
    assert meter.observations_kept < 20  # the idle spell costs two samples, not one per poll


def test_tiny_transfers_say_nothing_about_the_link():
    meter = ThroughputMeter()
    meter.observe(0.0, 0)
    meter.observe(0.05, MIN_MEASURED_BYTES - 1)
    assert meter.rate() is None
    up, down = ThroughputMeter(), ThroughputMeter()
    steady(down, 1_000_000.0, 3.0)
    up.observe(0.0, 0)
    assert link_rate(up, down) == down.rate()  # the direction that moved enough bytes
    steady(up, 500_000.0, 3.0)
    assert link_rate(up, down) == up.rate()  # the slower direction


def test_the_meter_keeps_a_bounded_number_of_samples():
    meter = ThroughputMeter()
    steady(meter, 1_000_000.0, 600.0)  # ten minutes of polls
    assert meter.observations_kept <= 128
    assert 0.9 * 1_000_000 < meter.rate() <= 1_000_000


def test_the_estimate_starts_at_the_prior_takes_the_first_measurement_then_averages():
    estimate = BandwidthEstimate(prior=125_000.0, weight=0.5)
    assert estimate.update(None) == 125_000.0 and not estimate.measured
    assert estimate.update(10e6) == 10e6
    assert estimate.update(6e6) == 8e6
    assert estimate.update(float("nan")) == 8e6


def test_a_liars_claim_cannot_take_more_than_the_bound():
    honest = [12.5e6, 12.5e6, 12.5e6]
    claims = honest + [1e12]
    assert bounded_claims(claims) == honest + [MAX_SHARE_RATIO * 12.5e6]
    plan = AllReducePlan.build(1_000_000, claims)
    assert plan.shard_sizes[3] <= MAX_SHARE_RATIO / (MAX_SHARE_RATIO + 3) * 1_000_000 + 1
    # two peers: the median of two would be the liar's half; the lower median is the honest claim
    assert AllReducePlan.build(900, [1e7, 1e12]).shard_sizes == (300, 600)


def test_a_minority_claiming_little_cannot_pull_the_bound_below_the_honest_claims():
    claims = [1.0, 1e7, 1e7, 1e7, 1e7]
    assert bounded_claims(claims) == claims


@pytest.mark.parametrize("n", [3, 4, 8])
def test_a_slow_peer_reduces_a_share_as_small_as_its_link(n):
    claims = [12.5e6] * (n - 1) + [625_000.0]  # 100 Mbit/s peers and one of 5 Mbit/s
    plan = AllReducePlan.build(786_432, claims)
    assert plan.shard_sizes[-1] / plan.total < 625_000 / sum(claims) + 1e-5
