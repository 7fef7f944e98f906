"""Reads of the newest value spread over a key's holders (``DHTConfig.latest_read_holders``,
``dht.candidates.spread_order``): each read asks a random draw of the k nearest instead of all of them,
so the holders of a popular key (a matchmaking cell's, read by each of its peers every round)
carry a share of its reads, not every one. Sans I/O: a network of placed contacts answers."""

from __future__ import annotations

import random
import time
from collections import Counter

from dht.lookup import DisjointLookup, IterativeLookup
from dht.node import DHTConfig
from dht.testing import open_swarm, placed_contact

TARGET = 0
K = 20
HOLDERS = [placed_contact((1 << 100) + n * (1 << 90), 2000 + n) for n in range(K)]  # the k nearest
OTHERS = [placed_contact(random.Random(n).getrandbits(160) | (1 << 150), 3000 + n) for n in range(100)]


def read(search: DisjointLookup | IterativeLookup, asked: Counter, failing: frozenset[bytes] = frozenset()) -> None:
    """Drive ``search`` to its end; every node answers with the key's k holders (it knows them)."""
    while not search.done:
        queries = search.next_queries()
        if not queries:
            break
        for contact in queries:
            asked[contact.id] += 1
            if contact.id in failing:
                search.on_failure(contact)
            else:
                search.on_response(contact, HOLDERS)


def reads(count: int, **options) -> Counter:
    rng = random.Random(5)
    asked: Counter = Counter()
    for _ in range(count):
        initial = rng.sample(OTHERS, 10) + rng.sample(HOLDERS, 10)  # a table that knows some holders
        search = DisjointLookup(TARGET, initial, paths=3, k=K, **options)
        read(search, asked)
        assert search.done
    return asked


def test_reads_that_need_a_few_holders_spread_over_all_of_them():
    count = 300
    everyone = reads(count)
    spread = reads(count, quorum=6, salt=None)  # (the salt is drawn per read below)
    rng = random.Random(9)
    drawn: Counter = Counter()
    for _ in range(count):
        initial = rng.sample(OTHERS, 10) + rng.sample(HOLDERS, 10)
        search = DisjointLookup(TARGET, initial, paths=3, k=K, quorum=6, salt=rng.randbytes(8))
        assert search.draws  # (the driver asks spares of a lookup that draws, when answers are slow)
        read(search, drawn)
        assert search.done
    at_holders = {name: [asked[h.id] for h in HOLDERS] for name, asked in [("all", everyone), ("drawn", drawn)]}
    # Reading all k: every read asks (nearly) every holder.
    assert min(at_holders["all"]) >= 0.9 * count
    # A draw of 6: each holder answers about 6 / 20 of the reads, none much more than the others.
    assert sum(at_holders["drawn"]) <= 8 * count
    assert max(at_holders["drawn"]) <= 0.5 * count, at_holders["drawn"]
    assert min(at_holders["drawn"]) >= 0.1 * count, at_holders["drawn"]
    assert not DisjointLookup(TARGET, HOLDERS, paths=3, k=K, quorum=K, salt=b"salt").draws  # (all k)
    # Without a salt the same few (the nearest of each path's share) would answer every read.
    assert max(spread[h.id] for h in HOLDERS) >= 0.9 * count


def test_paths_that_first_walk_through_far_nodes_still_draw_from_every_holder():
    """Each path's share of the k nearest is k less the nodes other paths took that are nearer:
    the far nodes of the first hops (all a table knows near a key in a large swarm) do not shrink
    it, or the draws would fall on the nearest few holders again."""
    rng = random.Random(12)
    asked: Counter = Counter()
    count = 300
    for _ in range(count):
        search = DisjointLookup(TARGET, rng.sample(OTHERS, 20), paths=3, k=K, quorum=6, salt=rng.randbytes(8))
        read(search, asked)
        assert search.done
    at_holders = [asked[h.id] for h in HOLDERS]
    mean = sum(at_holders) / len(at_holders)
    assert max(at_holders) <= 1.5 * mean and min(at_holders) >= 0.5 * mean, at_holders


def test_a_drawn_holder_that_is_slow_gets_a_spare_and_the_first_answers_finish_the_read():
    search = IterativeLookup(TARGET, HOLDERS, k=K, quorum=2, window=K, salt=b"spare-me")
    first = search.next_queries()
    assert len(first) == 2 and search.next_queries() == []  # only those needed
    search.on_response(first[0], HOLDERS)  # the other stays silent (dead, or slow)
    assert not search.done and search.next_queries() == []
    search.spare()  # the driver's hedge: answers are slow
    (extra,) = search.next_queries()
    assert extra not in first
    search.spare()  # still slow: another, though two are in flight and the lookup has widened
    (another,) = search.next_queries()
    assert another not in [*first, extra]
    search.on_response(extra, HOLDERS)
    assert search.done  # two answers: the silent ones are not waited for


def test_a_drawn_holder_that_fails_is_replaced_by_the_next_in_the_draw():
    rng = random.Random(3)
    for _ in range(50):
        salt = rng.randbytes(8)
        quiet = IterativeLookup(TARGET, HOLDERS, k=K, quorum=3, window=K, salt=salt)
        asked: Counter = Counter()
        read(quiet, asked)
        first_draw = set(asked)
        failing = frozenset(list(first_draw)[:1])
        search = IterativeLookup(TARGET, HOLDERS, k=K, quorum=3, window=K, salt=salt)
        asked = Counter()
        read(search, asked, failing)
        assert search.done
        answered = [contact.id for contact in search.closest()]
        assert len(answered) == 3 and not failing & set(answered)
        assert first_draw - failing <= set(answered)  # the rest of the draw stands


async def test_a_read_of_a_few_holders_finds_every_entry_that_reached_them():
    async with open_swarm(24, seed=11, config=DHTConfig(latest_read_holders=3, draw_reads_above=0)) as swarm:
        expiration = time.time() + 60
        for index in range(12):
            assert await swarm.nodes[index].store("crowd", index, expiration, subkey=f"peer{index}")
        served_before = [node.requests_served for node in swarm.nodes]
        for reader in swarm.nodes[12:]:
            merged = await reader.get("crowd", latest=True)
            assert merged is not None
            assert {sub: item.value for sub, item in merged.value.items()} == {f"peer{i}": i for i in range(12)}
        served = [node.requests_served - before for node, before in zip(swarm.nodes, served_before, strict=True)]
        # 12 reads of 3 holders each, one per path (and their lookups' few hops): nobody answers
        # most of them (reading all k, each of the 20 holders answers every one of the 12).
        assert max(served) <= 8, served


async def test_a_small_swarm_reads_every_holder():
    """In a swarm of fewer nodes than ``draw_reads_above`` nearly every node holds every key: a
    draw spreads nothing there, so reads ask every holder."""
    async with open_swarm(24, seed=11, config=DHTConfig(latest_read_holders=3)) as swarm:
        expiration = time.time() + 60
        for index in range(12):
            assert await swarm.nodes[index].store("crowd", index, expiration, subkey=f"peer{index}")
        served_before = [node.requests_served for node in swarm.nodes]
        for reader in swarm.nodes[12:]:
            assert len((await reader.get("crowd", latest=True)).value) == 12
        served = [node.requests_served - before for node, before in zip(swarm.nodes, served_before, strict=True)]
        assert max(served) >= 12, served  # some holder answered every read
