"""State from donors is verified before it is loaded: a hostile donor is skipped, the next one tried.

An unsigned donor entry with version 2**62 used to be the only donor anyone picked, and a newcomer
loaded its NaN parameters at epoch 10**9. Entries are signed now, but any identity can still
announce itself at the highest version and serve what it likes.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from averaging.averager import GroupAverager
from averaging.group import MAX_COUNTER
from averaging.state_checks import check_state, disagreement, sample_indices
from averaging.state_sharing import StateSharing
from dht.node import DHTNode

PREFIX = "checked.state"


class HostileState:
    """A donor that serves ``tensors`` and claims epoch 10**9."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    @asynccontextmanager
    async def locked_tensors(self) -> AsyncIterator[list[torch.Tensor]]:
        yield self.tensors

    def state_metadata(self) -> dict:
        return {"round": 10**9, "epoch": 10**9}


async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(initial_peers=initial) as node:
        task_status.started(node)
        await trio.sleep(math.inf)


def model_state(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(64, 32) * 0.1, torch.zeros(64), torch.full((1,), 12.0)]


def poisoned(kind: str, honest: list[torch.Tensor]) -> list[torch.Tensor]:
    if kind == "nan":
        return [torch.full_like(t, math.nan) for t in honest]
    if kind == "huge":
        return [t + 1e30 for t in honest]
    return [-t * 3 for t in honest]  # sign-flipped and scaled: finite, within bounds


@pytest.mark.parametrize("kind", ["nan", "huge", "flipped"])
async def test_a_hostile_donor_at_the_highest_version_is_skipped_for_an_honest_one(kind: str) -> None:
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        nodes = [first] + [await nursery.start(run_node, [first.address]) for _ in range(3)]
        honest = model_state(0)
        donors = [GroupAverager([t.clone() for t in honest], node, prefix=PREFIX) for node in nodes[:2]]
        for donor in donors:
            await donor.state_sharing.announce(5)
        attacker = StateSharing(nodes[2].host, nodes[2], PREFIX, HostileState(poisoned(kind, honest)))
        await attacker.announce(MAX_COUNTER)
        newcomer = GroupAverager(model_state(1), nodes[3], prefix=PREFIX)  # its own fresh model
        with trio.fail_after(20):
            metadata = await newcomer.load_state_from_peers(timeout=15)
        assert metadata["round"] != 10**9
        for ours, theirs in zip(newcomer.tensors, honest, strict=True):
            assert torch.equal(ours, theirs)
        nursery.cancel_scope.cancel()


async def test_two_donors_that_disagree_load_neither() -> None:
    """One honest donor and one liar: nothing tells them apart, so the newcomer keeps its own state
    (and the optimizer goes on from the swarm's epoch with it) rather than guess."""
    from averaging.state_sharing import StateUnavailable

    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        nodes = [first] + [await nursery.start(run_node, [first.address]) for _ in range(2)]
        honest = model_state(0)
        donor = GroupAverager([t.clone() for t in honest], nodes[0], prefix=PREFIX)
        await donor.state_sharing.announce(5)
        attacker = StateSharing(nodes[1].host, nodes[1], PREFIX, HostileState(poisoned("flipped", honest)))
        await attacker.announce(MAX_COUNTER)
        fresh = model_state(1)
        newcomer = GroupAverager([t.clone() for t in fresh], nodes[2], prefix=PREFIX)
        with trio.fail_after(20), pytest.raises(StateUnavailable, match="disagrees with other donors"):
            await newcomer.load_state_from_peers(timeout=15)
        assert all(torch.equal(ours, mine) for ours, mine in zip(newcomer.tensors, fresh, strict=True))
        nursery.cancel_scope.cancel()


async def test_witnesses_compare_only_the_tensors_replicas_share() -> None:
    """Worker momentum is each peer's own: two honest donors' momentum buffers point different ways
    while their starts agree. A witness that sampled the momentum took an honest donor for a liar
    (0.71 apart) and a newcomer in local-updates mode loaded nothing; with ``replicated`` it compares
    the start alone, and a donor whose start is sign-flipped is still refused."""
    start = [torch.linspace(-1.0, 1.0, 8)]
    momenta = [torch.ones(56), -torch.ones(56)]  # 7 times the start's values: sampled alone half the time
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        nodes = [first] + [await nursery.start(run_node, [first.address]) for _ in range(3)]
        donors = [
            GroupAverager([start[0].clone(), momentum], node, prefix=PREFIX, replicated=1)
            for node, momentum in zip(nodes[:2], momenta, strict=True)
        ]
        for donor in donors:
            await donor.state_sharing.announce(5)
        newcomer = GroupAverager([torch.zeros(8), torch.zeros(56)], nodes[3], prefix=PREFIX, replicated=1)
        for _ in range(6):  # each load samples afresh
            with trio.fail_after(20):
                await newcomer.load_state_from_peers(timeout=15)
            assert torch.equal(newcomer.tensors[0], start[0])
            assert any(torch.equal(newcomer.tensors[1], momentum) for momentum in momenta)

        liar = StateSharing(nodes[2].host, nodes[2], PREFIX, HostileState([-3 * start[0], momenta[0]]), replicated=1)
        await liar.announce(MAX_COUNTER)  # offered first, refused by the witnesses' starts
        with trio.fail_after(20):
            metadata = await newcomer.load_state_from_peers(timeout=15)
        assert metadata["round"] != 10**9 and torch.equal(newcomer.tensors[0], start[0])
        nursery.cancel_scope.cancel()


def test_the_checks_and_their_bounds() -> None:
    reference = model_state(1)
    check_state(model_state(0), reference)
    check_state([t * 500 for t in model_state(0)], reference)  # trained far from init: still sane
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_state([torch.full((64, 32), math.inf), *reference[1:]], reference)
    with pytest.raises(ValueError, match="beyond the bound"):
        check_state([reference[0], torch.full((64,), 1e8), reference[2]], reference)
    a, b = model_state(0), model_state(1)
    assert disagreement(a, a) == 0 and disagreement(a, [-t for t in a]) == 1
    assert disagreement(a, [t * 1.02 for t in a]) < 0.25 < disagreement(a, b)
    picked = sample_indices([100, 100, 100, 100, 100, 100, 100, 100, 100, 100], random.Random(0))
    assert len(picked) == 1


async def test_a_sample_request_cannot_ask_for_the_whole_state() -> None:
    """The witness method serves about an eighth of the state: naming every tensor is refused, so it
    is not a second way to make a donor copy its whole state under its lock."""
    from peer import RemoteError

    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        second = await nursery.start(run_node, [first.address])
        state = [torch.randn(100), torch.randn(100), torch.randn(100), torch.randn(100)]
        donor = GroupAverager(state, first, prefix=PREFIX)
        connection = await second.host.connect(first.host.listen_address)
        with trio.fail_after(10):
            async with connection.stream(donor.state_sharing.sample_method, timeout=5) as stream:
                await stream.send({"tensors": [0, 1, 2, 3]})
                with pytest.raises(RemoteError, match="about an eighth of the state"):
                    await stream.receive()
            async with connection.stream(donor.state_sharing.sample_method, timeout=5) as stream:
                await stream.send({"tensors": [2]})  # one tensor of four: the most a sample may name
                header = (await stream.receive()).body
                assert isinstance(header, dict) and len(header["tensors"]) == 1
        nursery.cancel_scope.cancel()
