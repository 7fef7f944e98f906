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
from averaging.matchmaking import Declaration, Matchmaker, MatchmakingError
from averaging.matchmaking_rules import PassedOver
from averaging.robust import resolve_aggregation
from dht.node import DHTNode
from peer import Identity, PeerAddress, Router

PREFIX = "forged-leader"
# The exact mean of two scalars that never change: with centered-clip, a peer in a group of two
# moves only as far as its own updates allow (tests/averaging/test_small_groups.py), and these have none.
AVERAGING = {"prefix": PREFIX, "settle_time": 0.2, "aggregation": "mean"}


def honest_schema(node, tensors) -> str:
    """The schema honest averagers of ``node``'s swarm declare (their tensors, rule and codec)."""
    return tensor_schema(tensors, resolve_aggregation("auto", node.host.access.private), "none")


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
            identity.peer_id, attacker.address, 1e9, AveragingMode.NODE, honest_schema(attacker, tensors), 0
        )
        await Matchmaker(attacker.host, attacker, PREFIX, router=Router()).declare(declaration, timeout=60)

        averagers = [
            GroupAverager([torch.tensor([float(i)])], node, **AVERAGING, matchmaking_timeout=4.0)
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


ROUNDS = 4


@pytest.mark.parametrize("behaviour", ["client mode", "silent"])
async def test_a_fake_leader_costs_at_most_one_round_while_its_declaration_lives(behaviour: str) -> None:
    """A declaration under the attacker's own signed subkey, with a peer ID that ranks first and a
    lifetime of a minute, names a leader that never serves a join: a client-mode peer (our calls
    reuse its own connection to us, which serves nothing) or one that never answers. Each honest
    peer tries it once, passes it over within that round, and does not elect it again while its
    declaration lives: no round fails, and no round after the first waits for it."""
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        honest = [first, await nursery.start(run_node, [first.address])]
        identity = first_ranked_identity(min(node.peer_id.to_bytes() for node in honest))
        client = behaviour == "client mode"
        attacker = await nursery.start(
            lambda task_status: run_node([first.address], task_status, identity=identity, client_mode=client)
        )
        asked = []

        async def never_answers(request):
            asked.append(request.peer)
            await trio.sleep_forever()

        if not client:
            attacker.host.router.add_unary(f"avg.join.{PREFIX}", never_answers)
        # (a client-mode peer has no address of its own: any address that pins its peer ID reaches
        # its open connection to us)
        address = PeerAddress("127.0.0.1", 9, identity.peer_id) if client else attacker.address
        tensors = [torch.tensor([1.0])]
        declaration = Declaration(
            identity.peer_id, address, 1e9, AveragingMode.NODE, honest_schema(attacker, tensors), 0
        )
        await Matchmaker(attacker.host, attacker, PREFIX, router=Router()).declare(declaration, timeout=60)

        averagers = [
            GroupAverager([torch.tensor([float(i)])], node, **AVERAGING, matchmaking_timeout=2.0)
            for i, node in enumerate(honest)
        ]
        failed, durations = [], []

        async def step(averager: GroupAverager) -> None:
            try:
                await averager.step()
            except MatchmakingError as error:
                failed.append(error)

        for _ in range(ROUNDS):
            started = trio.current_time()
            async with trio.open_nursery() as peers:
                for averager in averagers:
                    peers.start_soon(step, averager)
            durations.append(trio.current_time() - started)
        assert not failed, failed
        assert [float(a.tensors[0]) for a in averagers] == [0.5, 0.5]
        # tried once by each honest peer (in the first round), then passed over: later rounds
        # take the settle time and the exchange, not half of matchmaking's deadline
        assert len(asked) <= len(honest)
        assert max(durations[1:]) < 1.0, durations
        nursery.cancel_scope.cancel()


def test_a_leader_is_passed_over_until_its_declaration_expires_and_the_memory_is_bounded() -> None:
    passed_over = PassedOver(limit=3)
    passed_over.remember(b"a", until=20.0, now=0.0)
    passed_over.remember(b"b", until=5.0, now=0.0)
    passed_over.remember(b"stale", until=1.0, now=2.0)  # expired already: nothing to pass over
    assert passed_over.current(now=4.0) == {b"a", b"b"}
    assert passed_over.current(now=5.0) == {b"a"}  # b's declaration expired: it may lead again
    for name, until in ((b"c", 30.0), (b"d", 40.0), (b"e", 50.0)):
        passed_over.remember(name, until, now=6.0)
    # full: the one whose declaration expires soonest went first
    assert passed_over.current(now=6.0) == {b"c", b"d", b"e"}
