"""Beam search over the expert grid agrees with exhaustive search; announcements and ID patterns."""

from __future__ import annotations

import random
import time

import pytest

from dht.node import DHTNode
from moe.announce import announcement_records, declare_experts, prefix_key
from moe.batching import BatchQueue, Job
from moe.beam_search import GridBeamSearch, exhaustive_top_k, find_best_experts
from moe.protocol import expand_expert_pattern, split_uid
from moe.quorum import QuorumTracker


def random_scores(rng: random.Random, grid: tuple[int, ...], batch: int) -> list[list[list[float]]]:
    return [[[rng.gauss(0, 1) for _ in range(size)] for _ in range(batch)] for size in grid]


def run_offline(live: dict[tuple[int, ...], str], scores, k: int, beam: int | None = None):
    """Drive the search with an in-memory 'DHT' built from the live experts."""
    children: dict[str, dict[int, str]] = {}
    for key, subkey, value in announcement_records([f"e.{'.'.join(map(str, c))}" for c in live], "addr"):
        children.setdefault(key, {})[subkey] = value
    search = GridBeamSearch("e", scores, k, beam)
    asked = []
    while not search.done:
        keys = search.keys()
        asked.append(keys)
        search.advance({key: children.get(key, {}) for key in keys})
    return search.result(), asked


@pytest.mark.parametrize("seed", range(5))
def test_beam_search_matches_exhaustive_on_a_full_grid(seed: int) -> None:
    rng = random.Random(seed)
    grid = (5, 4, 3)
    live = {(i, j, k): "addr" for i in range(5) for j in range(4) for k in range(3)}
    scores = random_scores(rng, grid, batch=6)
    found, asked = run_offline(live, scores, k=4)
    expected = exhaustive_top_k("e", live, scores, 4)
    assert [[m.uid for m in row] for row in found] == [[m.uid for m in row] for row in expected]
    assert [[round(m.score, 9) for m in row] for row in found] == [[round(m.score, 9) for m in row] for row in expected]
    assert asked[0] == ["e."]  # one dimension at a time, starting from the root prefix


@pytest.mark.parametrize("seed", range(5))
def test_beam_search_on_a_sparse_grid_with_a_wide_beam(seed: int) -> None:
    rng = random.Random(seed)
    grid = (4, 4)
    live = {(i, j): "addr" for i in range(4) for j in range(4) if rng.random() < 0.4}
    scores = random_scores(rng, grid, batch=5)
    found, _ = run_offline(live, scores, k=3, beam=4)  # beam >= first grid dimension: exact
    expected = exhaustive_top_k("e", live, scores, 3)
    assert [[m.uid for m in row] for row in found] == [[m.uid for m in row] for row in expected]


def test_beam_search_skips_dead_prefixes_and_returns_fewer_when_few_are_live() -> None:
    live = {(2, 1): "a", (2, 3): "b"}
    scores = [[[10.0, 9.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 5.0]]]
    found, asked = run_offline(live, scores, k=3)
    assert [m.uid for m in found[0]] == ["e.2.3", "e.2.1"]
    assert asked == [["e."], ["e.2."]]  # never asked about prefixes with no live experts


async def test_beam_search_through_the_dht_matches_exhaustive() -> None:
    rng = random.Random(7)
    grid = (3, 3)
    live_uids = [uid for uid in expand_expert_pattern("ffn.[0:3].[0:3]") if rng.random() < 0.7]
    async with DHTNode.open() as first, DHTNode.open(initial_peers=[first.address]) as second:
        assert await declare_experts(first, live_uids[: len(live_uids) // 2], first.address, time.time() + 30)
        assert await declare_experts(second, live_uids[len(live_uids) // 2 :], second.address, time.time() + 30)
        async with DHTNode.open(initial_peers=[second.address], client_mode=True) as client:
            scores = random_scores(rng, grid, batch=4)
            found = await find_best_experts(client, "ffn", scores, k_best=3, beam_size=3)
    live = {split_uid(uid)[1]: None for uid in live_uids}
    expected = exhaustive_top_k("ffn", live, scores, 3)
    assert [[m.uid for m in row] for row in found] == [[m.uid for m in row] for row in expected]
    owner = {uid: (first.address if i < len(live_uids) // 2 else second.address) for i, uid in enumerate(live_uids)}
    assert all(m.value == owner[m.uid] for row in found for m in row)


def test_expert_patterns_and_ids() -> None:
    assert expand_expert_pattern("ffn.[0:2].[1:3]") == ["ffn.0.1", "ffn.0.2", "ffn.1.1", "ffn.1.2"]
    assert expand_expert_pattern("x.3.[0:2]") == ["x.3.0", "x.3.1"]
    assert split_uid("ffn.3.17") == ("ffn", (3, 17))
    assert prefix_key("ffn", (3,)) == "ffn.3."
    for bad in ["ffn", "ffn.[2:1]", "ffn.a", "a.b.[0:2]", "ffn.[0:2"]:
        with pytest.raises(ValueError):
            expand_expert_pattern(bad)
    for bad in ["ffn", "ffn.-1", "ffn.x", ".1", "ffn.1.", 7]:
        with pytest.raises(ValueError):
            split_uid(bad)


def test_batch_queue_takes_same_kind_up_to_the_limit() -> None:
    queue = BatchQueue(max_batch_size=10)
    jobs = [Job("forward", 4), Job("backward", 3), Job("forward", 5), Job("forward", 2), Job("backward", 9)]
    for job in jobs:
        queue.add(job)
    with pytest.raises(ValueError, match="outside 1..10"):
        queue.add(Job("forward", 11))
    assert queue.remove(jobs[2]) and not queue.remove(jobs[2])
    assert queue.next_batch() == [jobs[0], jobs[3]]
    assert queue.next_batch() == [jobs[1]]  # 3 + 9 > 10
    assert queue.next_batch() == [jobs[4]]
    assert queue.next_batch() == [] and len(queue) == 0


def test_quorum_tracker() -> None:
    # Calls 0 and 1 serve sample 0; call 2 serves samples 0 and 1.
    tracker = QuorumTracker([[0], [0], [0, 1]], batch_size=2, k_min=2)
    assert not tracker.satisfied
    tracker.finished(0, ok=True)
    assert not tracker.satisfied
    tracker.finished(2, ok=True)
    # Sample 0 has its 2 answers; sample 1 cannot get more (nothing outstanding): no point waiting.
    assert tracker.satisfied and tracker.short_samples() == [1]
    tracker.finished(1, ok=False)
    assert tracker.satisfied and tracker.answers == [2, 1]
