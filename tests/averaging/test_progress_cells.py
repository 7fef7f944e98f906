"""Progress records in cells (``averaging/progress.py``): a large swarm's peers each read one cell
of ~64-128 records instead of everyone's, and scale what they see to the swarm. The rule alone
(sans I/O), then a simulated swarm whose cells are made narrow so that a few dozen peers split as
a swarm of thousands would: the census gives everyone one count, each read is of the reader's own
cell, the scaled estimate is near the swarm's total, and a peer that counted differently finds the
swarm's cells."""

from __future__ import annotations

import collections
import math
import statistics

import trio

import averaging.cells
import averaging.progress
from averaging.epoch_evidence import EpochEvidence
from averaging.progress import PeerProgress, ProgressTracker, SwarmProgress, progress_cell, progress_key
from averaging.round_length import round_over
from dht import DHTConfig
from peer import LOCAL_DIFFICULTY, Identity, NodeIDProof, PeerID
from peer.node_id import NONCE_BYTES
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm

ME, A, B = (PeerID(bytes([i]) * 20) for i in (1, 2, 3))


def test_one_cell_is_the_single_key_and_peers_spread_over_many():
    assert progress_key("run", 1, progress_cell(bytes(20), 1)) == "run.progress"
    nodes = [NodeIDProof.solve(Identity.generate().peer_id, 4).node_id for _ in range(800)]
    counts = collections.Counter(progress_cell(node, 8) for node in nodes)
    assert sorted(counts) == list(range(8)) and max(counts.values()) < 2 * 800 / 8
    assert progress_key("run", 8, 3) == "run.progress.cells8.3"


def test_a_cell_view_is_scaled_to_the_swarm():
    peers = {ME: PeerProgress(4, 10, 2.0), A: PeerProgress(4, 20, 3.0), B: PeerProgress(3, 99, 5.0)}
    whole, cell = SwarmProgress(peers, me=ME), SwarmProgress(peers, me=ME, scale=8)
    assert whole.samples_at(4) == 30 and cell.samples_at(4) == 8 * 30
    assert cell.samples_per_s == 8 * whole.samples_per_s
    assert not whole.ready_to_step(4, 200) and cell.ready_to_step(4, 200)
    # a local-updates round: two peers of the cell each took 10 steps of 1 sample; the swarm is 8
    # such cells, so the round is over when the samples say 8 x 2 peers took them
    mine = PeerProgress(4, 10, 1.0)
    view = SwarmProgress({ME: mine, A: PeerProgress(4, 10, 1.0)}, me=ME, scale=8)
    assert round_over(view, 4, 10, 10, local_steps=10)
    assert not round_over(SwarmProgress({ME: mine, A: PeerProgress(4, 9, 1.0)}, me=ME, scale=8), 4, 10, 10, 10)


def test_a_cell_view_allows_claims_to_advance_at_the_swarms_rate_not_the_cells():
    def jump(scale: int) -> int:
        evidence = EpochEvidence(ME, samples_per_epoch=1000)
        claims = {A: PeerProgress(5, 0, 100.0), B: PeerProgress(5, 0, 100.0)}
        evidence.evidenced({ME: PeerProgress(5, 0, 100.0), **claims}, 5, now=0.0, scale=scale)
        # 10 s later both claim 5 + 1 + 30 epochs: 200 samples/s in view buy 4 x 2 epochs (slack 4)
        later = {A: PeerProgress(36, 0, 100.0), B: PeerProgress(36, 0, 100.0)}
        return evidence.evidenced({ME: PeerProgress(5, 0, 100.0), **later}, 5, now=10.0, scale=scale)

    assert jump(1) == 5  # implausible for the two peers in view
    assert jump(8) == 36  # plausible for a swarm eight times their rate


async def test_a_swarm_in_progress_cells_reads_its_own_cell_and_estimates_the_whole(autojump_clock, monkeypatch):
    monkeypatch.setattr(averaging.cells, "MIN_CELL_SWARM", 0)
    monkeypatch.setattr(averaging.progress, "CELL_GROUP", 2)  # cells of 4-8 peers
    monkeypatch.setattr(averaging.progress, "SPARSE_PROGRESS_CELL", 2)
    peers = 32
    reads: collections.Counter[str] = collections.Counter()

    class CountingReads:
        def __init__(self, node):
            self.node, self.host, self.clock, self.config = node, node.host, node.clock, node.config

        async def get(self, key, latest=False):
            reads[key] += 1
            return await self.node.get(key, latest=latest)

        async def store(self, *args, **kwargs):
            return await self.node.store(*args, **kwargs)

        async def nearest_node_ids(self, target, k=None):
            return await self.node.nearest_node_ids(target, k)

    async with open_sim_swarm(SimNetwork(seed=5), peers, config=DHTConfig()) as swarm:
        trackers = [ProgressTracker(CountingReads(node), "cells") for node in swarm.nodes]
        samples = {tracker.me: 10 + index for index, tracker in enumerate(trackers)}
        node_ids = {tracker.me: tracker.node_id for tracker in trackers}
        total = sum(samples.values())
        for _ in range(2):  # the first exchange takes the census; the second publishes in cells
            async with trio.open_nursery() as nursery:
                for tracker in trackers:
                    nursery.start_soon(tracker.publish, PeerProgress(1, samples[tracker.me], 1.0))
            await trio.sleep(1.0)
            views: list[SwarmProgress] = []

            async def fetch(tracker: ProgressTracker, views: list[SwarmProgress] = views) -> None:
                views.append(await tracker.fetch(PeerProgress(1, samples[tracker.me], 1.0)))

            reads.clear()
            async with trio.open_nursery() as nursery:
                for tracker in trackers:
                    nursery.start_soon(fetch, tracker)
        counts = {tracker.count for tracker in trackers}
        assert len(counts) == 1 and (count := counts.pop()) >= 4, counts
        # every read was of the reader's own cell, and saw its cell's peers only
        assert set(reads) <= {progress_key("cells", count, cell) for cell in range(count)}
        assert sum(reads.values()) == peers
        for view in views:
            assert view.scale == count and len(view.peers) < peers / 2
            assert {progress_cell(node_ids[peer], count) for peer in view.peers} == {
                progress_cell(node_ids[view.me], count)
            }
        estimates = [view.samples_at(1) for view in views]
        assert abs(statistics.mean(estimates) - total) < 0.25 * total, (estimates, total)

        # a peer that counts one cell where the swarm counts eight (its census's margin spans
        # several counts) finds nobody where it reads, probes the counts a swarm of its estimate
        # may hold and moves to the swarm's (a probe period later, records renewed)
        await trio.sleep(averaging.progress.PROBE_PERIOD_S)
        async with trio.open_nursery() as nursery:
            for tracker in trackers:
                nursery.start_soon(tracker.publish, PeerProgress(1, samples[tracker.me], 1.0))
        odd = trackers[0]
        odd.count, odd.census.counted = 1, None
        odd.census.target = averaging.cells.census_target(odd.census.prefix, odd.dht.clock.time())  # (no recount)
        view = await odd.fetch(PeerProgress(1, samples[odd.me], 1.0))
        assert odd.count == count and view.scale == count and len(view.peers) > 1
        assert math.isfinite(view.samples_at(1))


async def test_records_without_their_writers_node_id_proof_are_dropped(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=6), 3, config=DHTConfig()) as swarm:
        honest, forger, reader = (ProgressTracker(node, "proofs") for node in swarm.nodes)
        await honest.publish(PeerProgress(2, 20, 1.0))
        unsolved = next(  # the right length, but no solution of the puzzle (a free signing key's claim)
            nonce
            for n in range(1000)
            if not NodeIDProof(forger.me, nonce := n.to_bytes(NONCE_BYTES, "big")).satisfies(LOCAL_DIFFICULTY)
        )
        for nonce in (None, b"short", 7, unsolved):  # the forger's own signed records, without a valid nonce
            body = {**PeerProgress(9, 10**6, 1e6).to_wire(), **({} if nonce is None else {"nonce": nonce})}
            await forger.dht.store(forger.key, body, forger.dht.clock.time() + 10, subkey=forger.subkey)
            assert set(await reader.records()) == {honest.me}


def settle_count(tracker: ProgressTracker, count: int) -> None:
    """Make ``tracker`` count ``count`` cells without a census (its census of this period is taken)."""
    tracker.count, tracker.census.counted = count, None
    tracker.census.target = averaging.cells.census_target(tracker.census.prefix, tracker.dht.clock.time())


async def test_a_record_stored_in_a_cell_that_is_not_its_writers_is_dropped(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=8), 3, config=DHTConfig()) as swarm:
        trackers = [ProgressTracker(node, "misplaced") for node in swarm.nodes]
        # a count at which two of the three peers share a cell and the third is in another
        for count in (2, 4, 8, 16, 32, 64):
            cells = [progress_cell(tracker.node_id, count) for tracker in trackers]
            if len(set(cells)) == 2:
                break
        lone = next(i for i, cell in enumerate(cells) if cells.count(cell) == 1)
        forger = trackers[lone]
        reader, neighbour = (tracker for i, tracker in enumerate(trackers) if i != lone)
        for tracker in (reader, forger, neighbour):
            settle_count(tracker, count)
        await neighbour.publish(PeerProgress(1, 10, 1.0))  # into its own cell, the reader's
        # the forger's valid record (its own nonce, its own signed subkey), under the reader's cell
        body = {**PeerProgress(9, 10**6, 1e6).to_wire(), "nonce": forger.dht.host.node_id.nonce}
        await forger.dht.store(reader.key, body, forger.dht.clock.time() + 10, subkey=forger.subkey)
        assert set(await reader.records()) == {neighbour.me}


async def test_a_peer_alone_in_its_cell_does_not_scale_its_own_samples_up(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=9), 2, config=DHTConfig()) as swarm:
        lone = ProgressTracker(swarm.nodes[0], "alone")
        settle_count(lone, 8)  # the swarm's count, while our cell's reads find nobody
        view = await lone.fetch(PeerProgress(1, 10, 1.0))
        assert view.scale == 1 and view.samples_at(1) == 10  # not 8 x 10: we would step 8x early


async def test_a_census_that_fails_is_retried_once_a_minute_not_at_every_read(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=7), 2, config=DHTConfig()) as swarm:
        tries = []

        class FailingCensus:
            def __init__(self, node):
                self.node, self.host, self.clock, self.config = node, node.host, node.clock, node.config

            async def get(self, key, latest=False):
                return await self.node.get(key, latest=latest)

            async def nearest_node_ids(self, target, k=None):
                tries.append(trio.current_time())
                raise RuntimeError("no lookup now")

        tracker = ProgressTracker(FailingCensus(swarm.nodes[0]), "failing")
        for _ in range(30):  # a read a second for half a minute
            await tracker.records()
            await trio.sleep(1.0)
        assert len(tries) == 1
        await trio.sleep(averaging.progress.CENSUS_RETRY_S)
        await tracker.records()
        assert len(tries) == 2
