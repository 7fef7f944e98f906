"""A collaborative peer with no other peer's progress in view (the first peer of a swarm, or one
training alone) does not wait out matchmaking's whole deadline every epoch: the deadline is set for
groups on a WAN to form in (``settings.COLLABORATIVE``), and alone it would be all waiting."""

from __future__ import annotations

import pytest
import torch
import trio

from averaging.match_ahead import MatchAhead, MatchAtStep
from averaging.optimizer import ALONE_MATCHMAKING_S, CollaborativeOptimizer
from averaging.settings import COLLABORATIVE
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm

BATCH = 8
BATCH_S = 0.5


def linear_optimizer(node, matching=None) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"prefix": "alone", "target_batch_size": 4 * BATCH, "matching": matching}
    return model, CollaborativeOptimizer(optimizer, node, **options)


async def epoch(model: torch.nn.Module, optimizer: CollaborativeOptimizer) -> None:
    while True:
        model(torch.randn(BATCH, 4)).sum().backward()
        await trio.sleep(BATCH_S)  # (a batch's compute: the swarm's rate, by which groups form ahead)
        if await optimizer.step(BATCH):
            return


@pytest.mark.parametrize("ahead", [False, True])
async def test_a_peer_alone_steps_without_waiting_out_the_matchmaking_deadline(autojump_clock, ahead):
    assert COLLABORATIVE.matchmaking_timeout > 2 * ALONE_MATCHMAKING_S
    async with open_sim_swarm(SimNetwork(seed=3), 2) as swarm, trio.open_nursery() as background:
        model, optimizer = linear_optimizer(swarm.nodes[0], MatchAhead(background) if ahead else MatchAtStep())
        started = trio.current_time()
        for _ in range(3):
            await epoch(model, optimizer)
        assert optimizer.last_round.alone and not optimizer.last_round.averaged
        assert trio.current_time() - started < 3 * (ALONE_MATCHMAKING_S + 4 * BATCH_S + 1.0)

        # another peer's progress in view (it trains, but has not reached its step): the whole deadline
        _, other = linear_optimizer(swarm.nodes[1])
        await other.replica.publish(BATCH)
        started = trio.current_time()
        await epoch(model, optimizer)
        assert not optimizer.last_round.averaged
        assert trio.current_time() - started >= COLLABORATIVE.matchmaking_timeout - (1.0 if ahead else 0.0)
        background.cancel_scope.cancel()
