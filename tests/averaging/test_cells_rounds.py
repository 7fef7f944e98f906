"""Peers that are not in step with a swarm in cells still matchmake where it does: a newcomer
from its first round, a peer whose round formed no group from its next one. The cells are made
narrow here (one group each, from any swarm size), as in ``test_matchmaking_cells.py``."""

from __future__ import annotations

import collections

import pytest
import torch
import trio

import averaging.cells
import averaging.matchmaking
from averaging.averager import GroupAverager
from averaging.cells import Cells
from averaging.group import AveragingMode
from averaging.matchmaking import Declaration, MatchmakingError
from peer import PeerID
from peer.simnet import SimNetwork
from tests.support.sim_swarm import SimSwarm, open_sim_swarm

PEERS, GROUP, NEWCOMERS = 24, 4, 6


@pytest.fixture
def narrow_cells(monkeypatch) -> dict[PeerID, list[str]]:
    """Cells of one group each, and the keys each peer reads, in order."""
    monkeypatch.setattr(averaging.cells, "CELL_GROUPS", 1)
    monkeypatch.setattr(averaging.cells, "MIN_CELL_SWARM", 0)
    reads: dict[PeerID, list[str]] = collections.defaultdict(list)
    read_candidates = averaging.matchmaking.Matchmaker.read_candidates

    async def recording_reads(self, me, cells=None):
        reads[self.host.peer_id].append(self.key(me.round, cells))
        return await read_candidates(self, me, cells)

    monkeypatch.setattr(averaging.matchmaking.Matchmaker, "read_candidates", recording_reads)
    return reads


def averagers_of(swarm: SimSwarm, nodes=None) -> list[GroupAverager]:
    nodes = swarm.nodes if nodes is None else nodes
    return [
        GroupAverager([torch.full((8,), float(i))], node, prefix="cells", target_group_size=GROUP, aggregation="mean")
        for i, node in enumerate(nodes)
    ]


async def step_all(averagers: list[GroupAverager], timeout: float = 60.0) -> set[GroupAverager]:
    averaged: set[GroupAverager] = set()

    async def step(averager: GroupAverager) -> None:
        try:
            await averager.step(timeout=timeout)
        except MatchmakingError:
            return
        averaged.add(averager)

    async with trio.open_nursery() as nursery:
        for averager in averagers:
            nursery.start_soon(step, averager)
    return averaged


def cell_count_read(reads: dict[PeerID, list[str]]) -> int:
    """The count of the cells most reads of the last round went to."""
    counts = collections.Counter(key.split(".")[1] for keys in reads.values() for key in keys if ".cells" in key)
    return int(counts.most_common(1)[0][0].removeprefix("cells"))


async def test_newcomers_that_load_state_matchmake_in_the_swarms_cells_from_their_first_round(
    autojump_clock, narrow_cells
):
    """Their own census comes in only during their first round: until then they would declare in
    the single key, where enough of them would average among themselves, apart from the swarm."""
    async with open_sim_swarm(SimNetwork(seed=5), PEERS) as swarm:
        veterans = averagers_of(swarm)
        for _ in range(2):  # the first round's census splits the swarm into cells from the next on
            assert await step_all(veterans) == set(veterans)
        count = cell_count_read(narrow_cells)
        assert count > 1
        newcomers = []
        for index in range(NEWCOMERS):
            node = await swarm.add([swarm.nodes[index].address, swarm.nodes[-1].address])
            newcomer = averagers_of(swarm, [node])[0]
            await newcomer.load_state_from_peers(timeout=30.0)
            newcomers.append(newcomer)
        narrow_cells.clear()
        assert await step_all(veterans + newcomers) == set(veterans + newcomers)
        for newcomer in newcomers:  # (its first read; then one look at the single key: the donor's count is a claim)
            keys = narrow_cells[newcomer.host.peer_id]
            assert keys and f".cells{count}." in keys[0], keys


async def test_a_peer_whose_round_formed_no_group_matchmakes_with_the_swarm_across_a_period(
    autojump_clock, narrow_cells
):
    """Its cell is drawn from its round's period: kept at the round that failed, it would read the
    cell of a period the swarm has left, where nobody declares the rounds it could join."""
    async with open_sim_swarm(SimNetwork(seed=5), PEERS) as swarm:
        averagers = averagers_of(swarm)
        for _ in range(3):  # rounds 0-2: the swarm is in cells, its next round 3 the last of a period
            assert await step_all(averagers) == set(averagers)
        cells = Cells("cells", cell_count_read(narrow_cells))
        assert {averager.round for averager in averagers} == {3}
        assert 3 // averaging.cells.CELL_ROUNDS != 4 // averaging.cells.CELL_ROUNDS  # (round 4 starts a period)

        def cell(averager: GroupAverager, round_number: int) -> int:
            return cells.cell_of(averager.host.peer_id.to_bytes(), round_number)

        # one whose old cell no other peer's next round lands in (where it could catch up by chance)
        lagging = next(
            a for a in averagers if not any(cell(b, 3) == cell(a, 3) == cell(b, 4) for b in averagers if b is not a)
        )
        others = [averager for averager in averagers if averager is not lagging]
        with pytest.raises(MatchmakingError):
            await lagging.step(timeout=5.0)  # alone: the others are not matchmaking now
        assert await step_all(others) == set(others)
        assert await step_all(averagers) == set(averagers)


async def test_a_peer_that_moves_cells_withdraws_from_the_old_one_while_it_declares_in_the_new(autojump_clock):
    """Under churn a store takes seconds (dead holders answer nothing until the RPC times out):
    one after the other, a move after a census cost every peer two of them from its round."""
    async with open_sim_swarm(SimNetwork(seed=2), 4) as swarm:
        node, stores = swarm.nodes[0], []

        class SlowStores:
            def __getattr__(self, name):
                return getattr(node, name)

            async def store(self, key, value, expiration_time, subkey=None, majority=False):
                stores.append(key)
                await trio.sleep(1.0)
                return await node.store(key, value, expiration_time, subkey=subkey, majority=majority)

        matchmaker = averaging.matchmaking.Matchmaker(node.host, SlowStores(), "moves")
        me = Declaration(node.host.peer_id, node.host.listen_address, 1.0, AveragingMode.NODE, "s", 3)
        await matchmaker.declare(me, timeout=30.0)
        matchmaker.cells = Cells("moves", 2)
        started = trio.current_time()
        await matchmaker.declare(me, timeout=30.0)
        assert stores[0] == "moves.matchmaking" and set(stores[1:]) == {stores[0], matchmaker.key(3)}
        assert trio.current_time() - started < 1.8
