"""The census (``averaging/census.py``) with a DHT that answers as told: a count comes in for the
rounds after the one that took it, once per census period, and a census that fails or runs out of
time keeps the cells as they were and is taken again."""

from __future__ import annotations

import random
import types

import pytest
import trio
import trio.testing

from averaging.cells import CENSUS_PERIOD_S, Cells, census_target
from averaging.census import CENSUS_TIMEOUT, Census


class CountedDHT:
    """A DHT of ``size`` uniformly drawn node IDs whose lookups are counted; ``delay`` simulated
    seconds per lookup, ``error`` raised by every lookup when set."""

    def __init__(self, size: int, *, delay: float = 0.0, error: Exception | None = None):
        rng = random.Random(size)
        self.ids = [rng.getrandbits(160) for _ in range(size)]
        self.config = types.SimpleNamespace(k=20)
        self.clock = types.SimpleNamespace(time=lambda: self.wall_time)
        self.wall_time = 1000.0 * CENSUS_PERIOD_S
        self.delay, self.error, self.lookups = delay, error, 0

    async def nearest_node_ids(self, target: int) -> list[int]:
        self.lookups += 1
        await trio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return sorted(self.ids, key=lambda node: node ^ target)[: self.config.k]


def run(function, *args):
    return trio.run(function, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_census_sets_the_cells_of_the_next_round_once_per_period():
    dht, census, single = CountedDHT(4000), Census("avg"), Cells("avg")

    async def main():
        await census.take(dht, lambda: single, group_size=16, timeout=30.0)
        await census.take(dht, lambda: single, group_size=16, timeout=30.0)  # same period: no lookup
        assert dht.lookups == 1
        assert census.target == census_target("avg", dht.wall_time)
        assert census.estimate == pytest.approx(4000, rel=0.5)
        counted = census.next_round(single)
        assert counted.prefix == "avg" and counted.count > 1
        assert census.next_round(counted) is counted  # taken once: later rounds keep their own
        dht.wall_time += CENSUS_PERIOD_S
        await census.take(dht, lambda: counted, group_size=16, timeout=30.0)
        assert dht.lookups == 2

    run(main)


def test_a_census_that_fails_keeps_the_cells_and_is_taken_again():
    dht, census, single = CountedDHT(4000, error=OSError("no route")), Census("avg"), Cells("avg")

    async def main():
        await census.take(dht, lambda: single, group_size=16, timeout=30.0)
        assert census.next_round(single) is single and census.target is None
        dht.error = None
        await census.take(dht, lambda: single, group_size=16, timeout=30.0)
        assert dht.lookups == 2 and census.next_round(single).count > 1

    run(main)


def test_a_census_takes_at_most_its_share_of_the_round():
    dht, census, single = CountedDHT(4000, delay=CENSUS_TIMEOUT + 1), Census("avg"), Cells("avg")

    async def main():
        started = trio.current_time()
        await census.take(dht, lambda: single, group_size=16, timeout=8.0)
        assert trio.current_time() - started == pytest.approx(8.0 * 0.25)
        assert census.next_round(single) is single and census.target is None
        started = trio.current_time()
        await census.take(dht, lambda: single, group_size=16, timeout=1000.0)
        assert trio.current_time() - started == pytest.approx(CENSUS_TIMEOUT)

    run(main)


def test_a_first_census_within_the_margin_keeps_the_single_key():
    """A peer starts in the single key and its first census keeps it while the estimate allows
    one cell: a DHT of 84 nodes, counted 80-96, stays in one key (two cells of 32 average worse), and a
    newcomer that counts the swarm low finds its cells by looking around after the census."""
    dht, census = CountedDHT(84), Census("avg")
    run(census.take, dht, lambda: Cells("avg"), 16, 30.0)
    assert 80 < census.estimate < 96 and census.band == {1, 2, 4}
    assert census.next_round(Cells("avg")).count == 1
