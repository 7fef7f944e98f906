"""A collaborative peer with no other peer's progress in view (the first peer of a swarm, or one
training alone) does not wait out matchmaking's whole deadline every epoch: the deadline is set for
groups on a WAN to form in (``settings.COLLABORATIVE``), and alone it would be all waiting. A read
that comes back empty after others were seen is no news that they left."""

from __future__ import annotations

import pytest
import torch
import trio

from averaging.match_ahead import MatchAhead, MatchAtStep
from averaging.optimizer import ALONE_MATCHMAKING_S, CollaborativeOptimizer
from averaging.progress import PROGRESS_TTL
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm

BATCH = 8
BATCH_S = 0.5
DEADLINE = 10.0  # matchmaking's (the default), within a progress record's lifetime


class ReadsCanFail:
    """A peer's DHT whose reads come back empty while ``failing`` (its key's holders unreachable)."""

    def __init__(self, node):
        self.node, self.failing = node, False

    def __getattr__(self, name):
        return getattr(self.node, name)

    async def get(self, key, latest=False):
        return None if self.failing else await self.node.get(key, latest=latest)


def linear_optimizer(dht, matching=None) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # (no state rounds: each epoch is one gradient round's matchmaking)
    options = {"prefix": "alone", "target_batch_size": 4 * BATCH, "matching": matching, "average_state_every": 0}
    return model, CollaborativeOptimizer(optimizer, dht, matchmaking_timeout=DEADLINE, **options)


async def epoch(model: torch.nn.Module, optimizer: CollaborativeOptimizer) -> float:
    """Train until the swarm steps; how long that took."""
    started = trio.current_time()
    while True:
        model(torch.randn(BATCH, 4)).sum().backward()
        await trio.sleep(BATCH_S)  # (a batch's compute: the swarm's rate, by which groups form ahead)
        if await optimizer.step(BATCH):
            return trio.current_time() - started


@pytest.mark.parametrize("ahead", [False, True])
async def test_a_peer_alone_steps_without_waiting_out_the_matchmaking_deadline(autojump_clock, ahead):
    assert ALONE_MATCHMAKING_S + 4 * BATCH_S + 1.0 < DEADLINE < PROGRESS_TTL - 4 * BATCH_S
    async with open_sim_swarm(SimNetwork(seed=3), 2) as swarm, trio.open_nursery() as background:
        dht = ReadsCanFail(swarm.nodes[0])
        model, optimizer = linear_optimizer(dht, MatchAhead(background) if ahead else MatchAtStep())
        for _ in range(3):
            assert await epoch(model, optimizer) < ALONE_MATCHMAKING_S + 4 * BATCH_S + 1.0
        assert optimizer.last_round.alone and not optimizer.last_round.averaged

        # another peer's progress in view (it trains, but has not reached its step): the whole deadline
        _, other = linear_optimizer(swarm.nodes[1])
        await other.replica.publish(BATCH)
        assert await epoch(model, optimizer) >= DEADLINE - (1.0 if ahead else 0.0)
        assert not optimizer.last_round.averaged
        dht.failing = True  # and reads that come back empty soon after say nothing of it
        assert await epoch(model, optimizer) >= DEADLINE - (1.0 if ahead else 0.0)
        background.cancel_scope.cancel()
