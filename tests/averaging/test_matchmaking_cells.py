"""A swarm that matchmakes in cells (``averaging/cells.py``), on the simulated internet: the census
gives every peer the same count, each peer reads only its own cell, and the swarm still averages
every round and moves toward one mean. The cells are made narrow here (one group each, from any
swarm size) so that 24 peers split as a swarm of hundreds would."""

from __future__ import annotations

import collections

import torch
import trio

import averaging.cells
import averaging.matchmaking
from averaging.averager import GroupAverager
from dht import DHTConfig
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm

PEERS, GROUP = 24, 4


async def test_a_swarm_in_cells_agrees_on_them_reads_only_its_own_and_averages(autojump_clock, monkeypatch):
    monkeypatch.setattr(averaging.cells, "CELL_GROUPS", 1)
    monkeypatch.setattr(averaging.cells, "MIN_CELL_SWARM", 0)
    reads: collections.Counter[str] = collections.Counter()
    declared: dict[tuple[int, str], set[bytes]] = collections.defaultdict(set)  # by round and key
    read_candidates = averaging.matchmaking.Matchmaker.read_candidates

    async def counting_reads(self, me, cells=None):
        found = await read_candidates(self, me, cells)
        reads[self.key(me.round, cells)] += 1
        declared[me.round, self.key(me.round, cells)].update(peer.to_bytes() for peer in found)
        return found

    monkeypatch.setattr(averaging.matchmaking.Matchmaker, "read_candidates", counting_reads)
    async with open_sim_swarm(SimNetwork(seed=3), PEERS, config=DHTConfig()) as swarm:
        values = [torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(PEERS)]
        mean = torch.stack(values).mean(0)
        averagers = [
            GroupAverager([v.clone()], swarm.nodes[i], prefix="cells", target_group_size=GROUP, aggregation="mean")
            for i, v in enumerate(values)
        ]
        spread = [float((torch.stack(values) - mean).abs().max())]
        for number in range(4):
            averaged: list[GroupAverager] = []

            async def step(averager: GroupAverager, averaged: list[GroupAverager] = averaged) -> None:
                await averager.step(timeout=60)
                averaged.append(averager)

            async with trio.open_nursery() as nursery:
                for averager in averagers:
                    nursery.start_soon(step, averager)
            assert len(averaged) == PEERS, f"round {number}: {len(averaged)} of {PEERS} averaged"
            spread.append(max(float((a.tensors[0] - mean).abs().max()) for a in averagers))
            if number == 0:  # the census of the first round sets the cells from the next one on
                assert all(key == "cells.matchmaking" for key in reads)
                reads.clear()
                declared.clear()
        # 24 peers in groups of 4 (one per cell here): four cells, each read by its members only
        assert len(reads) >= 4 and all(".cells4." in key for key in reads), reads

        assert max(len(peers) for peers in declared.values()) <= 2 * PEERS // 4
        # the census: every peer finds the same k nearest node IDs, so all take the same count
        target = averaging.cells.census_target("cells", swarm.clock.time())
        seen = {tuple(await node.nearest_node_ids(target)) for node in swarm.nodes[::5]}
        assert len(seen) == 1 and averaging.cells.swarm_estimate(target, list(seen.pop()), 20) < 2 * PEERS
        # values travel between cells as the periods reshuffle them: the spread shrinks toward the mean
        assert spread[-1] < 0.15 * spread[0], spread
