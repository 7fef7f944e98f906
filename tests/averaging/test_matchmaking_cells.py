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
from averaging.cells import Cells, census_target
from averaging.group import AveragingMode
from averaging.matchmaking import Declaration, Matchmaker, MatchmakingError
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
        # 24 peers in groups of 4 (one per cell here): four cells, each read by its members only,
        # but once per census, when a peer reads its cell under the other counts the census allows
        own = {key: count for key, count in reads.items() if ".cells4." in key}
        assert len(own) >= 4 and 0 < sum(reads.values()) - sum(own.values()) <= 2 * PEERS, reads

        assert max(len(peers) for (_, key), peers in declared.items() if key in own) <= 2 * PEERS // 4
        # the census: every peer finds the same k nearest node IDs, so all take the same count
        target = averaging.cells.census_target("cells", swarm.clock.time())
        seen = {tuple(await node.nearest_node_ids(target)) for node in swarm.nodes[::5]}
        assert len(seen) == 1 and averaging.cells.swarm_estimate(target, list(seen.pop()), 20) < 2 * PEERS
        # values travel between cells as the periods reshuffle them: the spread shrinks toward the mean
        assert spread[-1] < 0.15 * spread[0], spread


async def test_peers_in_full_cells_of_another_count_the_census_allows_move_to_the_larger_swarm(autojump_clock):
    """Newcomers in 2 cells where the swarm keeps 4 (both within their census's margin), enough of
    them in one cell that it is not sparse: once their census is in, they read their cell under
    the swarm's count too and move there, instead of averaging among themselves for good."""
    async with open_sim_swarm(SimNetwork(seed=11), 80) as swarm:
        quarters = Cells("split", 4)
        by_quarter = collections.defaultdict(list)
        for node in swarm.nodes:
            by_quarter[quarters.cell_of(node.host.peer_id.to_bytes(), 1)].append(node)
        # eleven newcomers in one cell of 2 (one cell of 4 within it), where the swarm's 4 cells
        # hold 8 of its peers (twelve each elsewhere): fewer than the newcomers' own cell, so only
        # the larger swarm behind those moves them, not a fuller cell
        theirs = max(by_quarter, key=lambda cell: len(by_quarter[cell]))
        newcomers = by_quarter[theirs][:11]
        veterans = [
            node for cell, nodes in by_quarter.items() for node in (nodes[11:19] if cell == theirs else nodes[:12])
        ]
        assert len(by_quarter[theirs]) >= 19
        target = census_target("split", swarm.clock.time())
        matchmakers = {}
        for node in newcomers + veterans:
            matchmaker = matchmakers[node] = Matchmaker(node.host, node, "split")
            matchmaker.census.target = target  # (this period's census is in: none taken now)
            matchmaker.cells = Cells("split", 4)
            if node in newcomers:
                matchmaker.cells = Cells("split", 2)
                matchmaker.census.counted, matchmaker.census.band = Cells("split", 2), {2, 4}
        groups = {}

        async def form(node, round_number: int) -> None:
            me = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", round_number)
            try:
                match = await matchmakers[node].form_group(
                    me, target_group_size=4, min_group_size=2, timeout=30.0, settle_time=2.0
                )
            except MatchmakingError:  # (a peer that moves may miss the groups formed meanwhile)
                assert round_number == 1
                return
            groups[node] = {member.peer_id for member in match.group.members}

        for round_number in (1, 2):
            groups.clear()
            async with trio.open_nursery() as nursery:
                for node in newcomers + veterans:
                    nursery.start_soon(form, node, round_number)
            assert {matchmakers[node].cells.count for node in newcomers} == {4}
        veteran_ids = {node.host.peer_id for node in veterans}
        assert all(groups[node] & veteran_ids for node in newcomers), [groups[node] for node in newcomers]
