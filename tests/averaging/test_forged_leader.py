"""A peer that declares itself (with its own signed declaration) and, with a peer ID that ranks
first, is elected leader, but then never answers or answers garbage: the followers pass it over
and form their group without it, within the same round. It used to fail every round."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from averaging.averager import GroupAverager, tensor_schema
from averaging.group import AveragingMode
from averaging.matchmaking import Declaration, Matchmaker
from dht.node import DHTNode
from peer import Identity, Router

PREFIX = "forged-leader"


def first_ranked_identity(below: bytes) -> Identity:
    """An identity whose peer ID sorts before ``below``: a few hundred key generations."""
    while True:
        identity = Identity.generate()
        if identity.peer_id.to_bytes() < below:
            return identity


async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED, **options):
    async with DHTNode.open(initial_peers=initial, **options) as node:
        task_status.started(node)
        await trio.sleep(math.inf)


@pytest.mark.parametrize("behaviour", ["silent", "garbage", "leaves us out"])
async def test_followers_pass_over_a_leader_that_never_answers_or_answers_garbage(behaviour: str) -> None:
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        honest = [first, await nursery.start(run_node, [first.address])]
        lowest = min(node.peer_id.to_bytes() for node in honest)
        identity = first_ranked_identity(lowest)
        attacker = await nursery.start(lambda task_status: run_node([first.address], task_status, identity=identity))

        async def join(request):
            if behaviour == "silent":
                await trio.sleep_forever()
            if behaviour == "garbage":
                return {"group_id": "no", "members": 7}
            return {"group_id": b"\0" * 16, "members": [[identity.peer_id.to_bytes(), None, 0.0, "client"]]}

        attacker.host.router.add_unary(f"avg.join.{PREFIX}", join)
        tensors = [torch.tensor([1.0])]
        declaration = Declaration(
            identity.peer_id, attacker.address, 1e9, AveragingMode.NODE, tensor_schema(tensors), 0
        )
        await Matchmaker(attacker.host, attacker, PREFIX, router=Router()).declare(declaration, timeout=60)

        averagers = [
            GroupAverager([torch.tensor([float(i)])], node, prefix=PREFIX, matchmaking_timeout=4.0, settle_time=0.2)
            for i, node in enumerate(honest)
        ]
        results = {}

        async def step(i: int) -> None:
            results[i] = await averagers[i].step()

        with trio.fail_after(15):
            async with trio.open_nursery() as peers:
                for i in range(2):
                    peers.start_soon(step, i)
        for result in results.values():
            assert {m.peer_id for m in result.group.members} == {node.peer_id for node in honest}
        assert [float(a.tensors[0]) for a in averagers] == [0.5, 0.5]
        nursery.cancel_scope.cancel()
