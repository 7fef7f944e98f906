"""Matchmaking cells (``averaging/cells.py``), sans I/O: the census estimate, the cell count,
which key a peer declares under, and what a reader counts as belonging in a cell."""

from __future__ import annotations

import collections
import random
import statistics

import pytest

from averaging.cells import (
    CELL_GROUPS,
    CELL_ROUNDS,
    KEYSPACE,
    MAX_CELLS,
    MIN_CELL_SWARM,
    Cells,
    cell_count,
    census_band,
    crowd_counts,
    crowd_wins,
    larger_swarm,
    more_crowded,
    next_cell_count,
    probe_counts,
    swarm_estimate,
)


def nearest_ids(ids: list[int], target: int, k: int) -> list[int]:
    return sorted(ids, key=lambda node: node ^ target)[:k]


@pytest.mark.parametrize("size", [200, 1000, 5000])
def test_the_census_estimates_the_swarm_size_from_the_k_nearest(size):
    rng = random.Random(size)
    ids = [rng.getrandbits(160) for _ in range(size)]
    estimates = []
    for _ in range(40):
        target = rng.getrandbits(160)
        estimates.append(swarm_estimate(target, nearest_ids(ids, target, 20), 20))
    assert statistics.median(estimates) == pytest.approx(size, rel=0.15)
    # one census is within ~1/sqrt(k) of the truth: cells of 2-4 groups absorb it
    assert sum(0.5 * size <= e <= 2 * size for e in estimates) >= 36


def test_a_census_that_saw_fewer_than_k_nodes_saw_the_whole_swarm():
    assert swarm_estimate(5, [1, 2, 3], 20) == 3.0
    assert swarm_estimate(5, [], 20) == 0.0
    assert swarm_estimate(0, [KEYSPACE - 1] * 20, 20) == pytest.approx(19, rel=1e-6)


def test_cells_hold_two_to_four_groups_and_double_at_most_to_the_cap():
    width = CELL_GROUPS * 16
    assert cell_count(2 * width - 1, 16) == 1  # a small swarm keeps its single key
    assert cell_count(2 * width, 16) == 2
    assert cell_count(MIN_CELL_SWARM - 1, 2) == 1 and cell_count(MIN_CELL_SWARM, 2) > 1
    for size in [200, 1000, 5000, 100_000]:
        count = cell_count(size, 16)
        assert count & (count - 1) == 0 and width <= size / count < 2 * width
    assert cell_count(1e30, 16) == MAX_CELLS
    assert cell_count(float("nan"), 16) == cell_count(float("inf"), 16) == 1


def test_one_cell_is_the_single_matchmaking_key():
    assert Cells("run").key(b"peer", 7) == "run.matchmaking"
    with pytest.raises(ValueError):
        Cells("run", 0)


def test_a_peer_keeps_its_cell_for_a_period_and_the_swarm_spreads_evenly_over_cells():
    cells = Cells("run", 8)
    peers = [random.Random(i).randbytes(32) for i in range(4000)]
    for peer in peers[:50]:
        assert len({cells.key(peer, r) for r in range(CELL_ROUNDS)}) == 1
    moved = sum(cells.cell_of(peer, 0) != cells.cell_of(peer, CELL_ROUNDS) for peer in peers)
    assert 0.8 * 7 / 8 * len(peers) <= moved <= 1.2 * 7 / 8 * len(peers)  # reshuffled, as by chance
    sizes = collections.Counter(cells.cell_of(peer, 3) for peer in peers)
    assert len(sizes) == 8 and max(sizes.values()) < 1.2 * len(peers) / 8
    # every key ends as the DHT's matchmaking lifetime rule expects
    assert all(cells.key(peer, 3).endswith(".matchmaking") for peer in peers[:10])


def test_a_declaration_belongs_only_in_the_cell_its_owner_is_in_for_the_round():
    cells = Cells("run", 4)
    peer = b"p" * 32
    here = cells.key(peer, 5)
    assert cells.belongs(peer, 5, here)
    elsewhere = next(r for r in range(0, 400, CELL_ROUNDS) if cells.key(peer, r) != here)
    assert not cells.belongs(peer, elsewhere, here)  # a stale or a newcomer's lobby declaration


def test_a_census_near_a_boundary_does_not_flip_the_count():
    width = CELL_GROUPS * 16
    # from the single key, a swarm splits once clearly past the boundary (128 peers: ~3.2 widths)
    assert next_cell_count(1, 2.4 * width, 16) == 1 and next_cell_count(1, 3.2 * width, 16) == 2
    # then censuses between 1.33x and 6x width keep 2 cells
    assert all(next_cell_count(2, factor * width, 16) == 2 for factor in (1.4, 2.0, 3.5, 5.9))
    # the swarm clearly grew or shrank: the count follows
    assert next_cell_count(2, 6.1 * width, 16) == cell_count(6.1 * width, 16) == 4
    assert next_cell_count(4, 0.5 * width, 16) == 1


def test_a_count_wins_by_the_swarm_its_cells_show_not_by_the_peers_one_cell_holds():
    # 30 peers in our cell of 4 show ~120; 40 stragglers in the single key show 40: stay
    assert not more_crowded(40, 1, 30, 4)
    # a newcomer alone in the single key finds 3 peers in its cell of the swarm's 4: move
    assert more_crowded(3, 4, 1, 1)
    # a third of a swarm of 1,000 at twice the swarm's count (sparse cells of ~15) rejoins it
    assert more_crowded(30, 16, 14, 32) and not more_crowded(14, 32, 30, 16)
    # a few declarations in a cell of 4x our count pull nobody out of a cell of ours with more
    assert not more_crowded(3, 16, 3, 4)
    assert probe_counts(1) == {2, 4} and probe_counts(16) == {4, 8, 32, 64}
    assert probe_counts(MAX_CELLS) == {MAX_CELLS // 4, MAX_CELLS // 2}


def test_between_counts_the_census_allows_the_larger_swarm_wins_however_full_our_cell():
    # ~90 peers in groups of 16: 1, 2 and 4 cells are all within the census's margin
    assert census_band(90, 16) == {1, 2, 4} and census_band(128, 16) == {2, 4} and census_band(10, 16) == {1}
    # newcomers in a full cell of 2 (24 others) find 21 in their cell of the swarm's 4: move
    assert crowd_wins(21, 4, 24, 2, {2, 4}, 16) and not more_crowded(21, 4, 24, 2)
    # and the swarm's peers, reading the newcomers' count, stay
    assert not crowd_wins(24, 2, 21, 4, {2, 4}, 16)
    # a count the census does not allow, or a cell of stragglers, is no swarm to move to
    assert not crowd_wins(21, 4, 24, 2, {1, 2}, 16) and not larger_swarm(15, 8, 24, 2, 16)
    # what a peer reads: after a census, the other allowed counts; from a sparse cell, those near it
    assert crowd_counts(2, {2, 4}, False, None) == {4}
    assert crowd_counts(4, {2, 4}, True, 8) == {1, 2, 8, 16}
