"""Disjoint lookup paths (S/Kademlia), sans I/O: a simulated network of plain positions answers each
query, so a path poisoned by hostile nodes can be built exactly."""

from __future__ import annotations

import random
from collections import Counter

from dht.lookup import DisjointLookup
from dht.routing import Contact
from dht.testing import placed_contact

TARGET = 0
K = 20
SPACING = 1 << 100  # initial candidates sit at multiples of this distance from the target


class Network:
    """Honest nodes answer with the honest nodes nearest the target (holders with the value too);
    hostile nodes answer only with hostile contacts nearer still, and never with the value."""

    def __init__(self, honest: list[Contact], holders: list[Contact], hostile: list[Contact]):
        self.honest = honest + holders
        self.holders = {c.id for c in holders}
        self.hostile = {c.id for c in hostile}
        self.hostile_contacts = hostile
        self.queried: list[Contact] = []

    def answer(self, contact: Contact) -> tuple[list[Contact], bool]:
        self.queried.append(contact)
        if contact.id in self.hostile:
            return self.hostile_contacts[:K], False
        nearest = sorted(self.honest, key=lambda c: c.long_id ^ TARGET)[:K]
        return nearest, contact.id in self.holders


def walk(search: DisjointLookup, network: Network) -> bool:
    """Drive ``search`` as the trio driver would; True once any path finds the value."""
    while not search.done:
        queries = search.next_queries()
        if not queries:
            break
        for contact in queries:
            neighbours, has_value = network.answer(contact)
            search.on_response(contact, neighbours)
            if has_value:
                return True
    return False


def poisoned_network() -> tuple[Network, list[Contact]]:
    """Initial candidates in the order hostile, honest, honest, ... so that dealing them out among
    three paths gives the first path only hostile nodes. Hostile contacts lie nearer to the target
    than any honest node (as keys ground without a puzzle would), so a single path is captured."""
    initial = []
    for index in range(9):
        position = (index + 1) * SPACING
        initial.append(placed_contact(position | (1 << 99) if index % 3 == 0 else position, 2000 + index))
    hostile_initial = initial[0::3]
    hostile = [placed_contact(1 + n, 3000 + n) for n in range(K)] + hostile_initial
    holders = [placed_contact((1 << 90) + n, 4000 + n) for n in range(3)]
    others = [placed_contact(random.Random(n).getrandbits(160) | (1 << 159), 5000 + n) for n in range(40)]
    honest = [c for c in initial if c not in hostile_initial] + others
    return Network(honest, holders, hostile), initial


def test_the_initial_candidates_are_dealt_out_nearest_first():
    initial = [placed_contact((n + 1) * SPACING, 2000 + n) for n in range(7)]
    search = DisjointLookup(TARGET, reversed(initial), paths=3, k=K)
    starts = [path.next_queries() for path in search.paths]
    assert [[c.port for c in start] for start in starts] == [[2000, 2003, 2006], [2001, 2004], [2002, 2005]]


def test_a_fully_poisoned_path_does_not_hide_the_value():
    network, initial = poisoned_network()
    assert not walk(DisjointLookup(TARGET, initial, paths=1, k=K), network)  # one path: captured
    network.queried.clear()
    search = DisjointLookup(TARGET, initial, paths=3, k=K)
    assert walk(search, network)
    # The hostile path only ever asked hostile nodes; the honest ones never heard of them.
    hostile_asked = [c for c in network.queried if c.id in network.hostile]
    assert hostile_asked and all(search.paths[0].responded(c) for c in hostile_asked)
    assert not any(path.responded(c) for path in search.paths[1:] for c in hostile_asked)


def test_no_node_is_queried_by_two_paths():
    rng = random.Random(5)
    nodes = [placed_contact(rng.getrandbits(160), 6000 + n) for n in range(120)]
    network = Network(nodes, [], [])  # nobody holds the value: every path runs to the end
    search = DisjointLookup(rng.getrandbits(160), nodes[:20], paths=3, k=K)
    assert not walk(search, network)
    assert search.done
    counts = Counter(c.id for c in network.queried)
    assert counts and max(counts.values()) == 1
    assert search.rpcs == len(network.queried)
    nearest = search.closest()
    assert nearest == sorted(nearest, key=lambda c: c.long_id ^ search.target) and len(nearest) == K


def test_a_narrow_start_asks_one_node_until_it_answers():
    initial = [placed_contact((n + 1) * SPACING, 2000 + n) for n in range(9)]
    search = DisjointLookup(TARGET, initial, paths=3, k=K)
    search.start_narrow()
    [first] = search.next_queries()
    assert first.port == 2000 and search.next_queries() == []
    search.on_response(first, [])
    assert len(search.next_queries()) == 2 + 3 + 3  # then every path opens, alpha requests each


def test_a_hedge_asks_one_node_per_other_path_until_something_returns():
    initial = [placed_contact((n + 1) * SPACING, 2000 + n) for n in range(9)]
    search = DisjointLookup(TARGET, initial, paths=3, k=K)
    search.start_narrow()
    [first] = search.next_queries()
    search.hedge()  # the nearest is slow: the next nearest of the other paths, not alpha per path
    hedged = search.next_queries()
    assert sorted(c.port for c in hedged) == [2001, 2002] and search.next_queries() == []
    search.on_response(hedged[0], [])
    # that path and the first (still waiting on its slow peer) open, with their other two candidates
    # each; the third path waits for its own answer
    assert len(search.next_queries()) == 2 + 2 and search.in_flight == 3 + 2 + 1


def test_after_a_narrow_start_no_node_is_queried_by_two_paths_either():
    """A value lookup starts on the first path alone and builds the others only once they are
    needed; its first answer names their candidates too, and still no node is asked twice."""
    rng = random.Random(7)
    nodes = [placed_contact(rng.getrandbits(160), 6000 + n) for n in range(120)]
    network = Network(nodes, [], [])
    search = DisjointLookup(rng.getrandbits(160), nodes[:20], paths=3, k=K)
    search.start_narrow()
    [first] = search.next_queries()
    search.on_response(first, network.answer(first)[0])
    assert not walk(search, network)
    assert search.done
    counts = Counter(c.id for c in network.queried)
    assert max(counts.values()) == 1 and search.rpcs == len(network.queried)
    assert all(sum(path.responded(c) for path in search.paths) == 1 for c in network.queried)


def kademlia_swarm(seed: int, size: int) -> tuple[list[Contact], dict[bytes, list[Contact]]]:
    """``size`` nodes at random positions, each knowing up to K random nodes per bucket."""
    rng = random.Random(seed)
    nodes = [placed_contact(rng.getrandbits(160), 6000 + n) for n in range(size)]
    tables = {}
    for node in nodes:
        buckets: dict[int, list[Contact]] = {}
        for other in nodes:
            if other is not node:
                buckets.setdefault((node.long_id ^ other.long_id).bit_length(), []).append(other)
        tables[node.id] = [o for bucket in buckets.values() for o in rng.sample(bucket, min(K, len(bucket)))]
    return nodes, tables


class RoutedNetwork(Network):
    """Every node answers with the K nodes of its own table nearest the target."""

    def __init__(self, tables: dict[bytes, list[Contact]], target: int):
        super().__init__([], [], [])
        self.tables, self.target = tables, target

    def answer(self, contact: Contact) -> tuple[list[Contact], bool]:
        self.queried.append(contact)
        return sorted(self.tables[contact.id], key=lambda o: o.long_id ^ self.target)[:K], False


def test_disjoint_paths_share_the_k_nearest_instead_of_each_waiting_for_k_answers():
    """In a swarm of 1,000 nodes every path finds k nodes near any key; waiting for k answers on
    each of three paths cost ~2.8 times one path's requests. Dealt out, the paths together still
    hear every one of the k nearest, at less than 2.5 times one path's requests."""
    single, disjoint = 0, 0
    for seed in range(6):
        nodes, tables = kademlia_swarm(seed, 1000)
        target = random.Random(seed).getrandbits(160)

        start = random.Random(seed).choice(nodes)
        initial = sorted(tables[start.id], key=lambda o: o.long_id ^ target)[:K]
        nearest = {c.id for c in sorted(nodes, key=lambda c: c.long_id ^ target)[:K]}
        for paths in (1, 3):
            network = RoutedNetwork(tables, target)
            search = DisjointLookup(target, initial, paths=paths, k=K)
            walk(search, network)
            assert search.done and nearest <= {c.id for c in network.queried}, (seed, paths)
            if paths == 1:
                single += search.rpcs
            else:
                disjoint += search.rpcs
    assert disjoint < 2.5 * single, (disjoint, single)
