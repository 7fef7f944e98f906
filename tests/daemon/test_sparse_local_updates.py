"""Local updates with a sparse codec (``topk_2bit``): the outer step applies only the largest values
of each chunk of the average, every peer keeps the rest of its own progress in its parameters (all
that is lost is the rounding of the reducers' replies), and real peers reach the digits target that
way, in both schedules; robust rounds refuse sparse codecs until their checks can verify them."""

from __future__ import annotations

import dataclasses
import subprocess
from types import SimpleNamespace

import pytest
import torch
import trio

from averaging.local_rounds import OverlappedRounds, SequentialRounds
from averaging.local_updates import LocalUpdatesOptimizer, start_pieces
from averaging.matchmaking_errors import MatchmakingError, NoOtherPeers
from averaging.optimizer import CollaborativeOptimizer
from averaging.outer_step import OuterStep
from averaging.progress import PeerProgress, SwarmProgress
from peerd.exit_codes import EXIT_BAD_INPUT
from tests.daemon.test_training import make_local_updates_trainer, open_swarm, train_to_target
from tests.support.processes import PEERD


def sparse_local_updates(node, weight, **options) -> LocalUpdatesOptimizer:
    defaults = {
        "prefix": "sparse",
        "local_steps": 1,
        "codec": "topk_2bit",
        "target_group_size": 2,
        "aggregation": "mean",
        "settle_time": 0.05,
        "matchmaking_timeout": 3.0,
        "averaging_timeout": 6.0,
        "rounds": SequentialRounds(),
    }
    return LocalUpdatesOptimizer(torch.optim.SGD([weight], lr=1.0), node, **{**defaults, **options})


async def test_a_sparse_round_applies_a_few_values_and_each_peer_keeps_the_rest_of_its_progress():
    """Two peers, one SGD step (lr 1) per round on 128 values: the all-reduce cuts them into two
    shards of one 64-value chunk each, and each chunk's average keeps one value (exact: a chunk
    whose only kept value is its own bounds decodes exactly). The shared start moves at those two
    values; every peer's parameters are the start less what it still owes, and together the peers'
    parameters moved by exactly what they trained."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        generator = torch.Generator().manual_seed(3)
        grads = [torch.randn(128, generator=generator) for _ in range(2)]
        weights = [torch.nn.Parameter(torch.zeros(128)) for _ in range(2)]
        optimizers = [sparse_local_updates(node, weight) for node, weight in zip(nodes, weights, strict=True)]

        async def one_round(i: int) -> None:
            weights[i].grad = grads[i].clone()
            assert await optimizers[i].step(1) is True

        with trio.fail_after(30):
            async with trio.open_nursery() as rounds:
                for i in range(2):
                    rounds.start_soon(one_round, i)
        assert all(o.last_averaging["averaged"] for o in optimizers)
        start = optimizers[0].snapshot[0]
        assert torch.equal(start, optimizers[1].snapshot[0])  # the shared start is shared
        assert int((start != 0).sum()) == 2  # one value of each shard's chunk
        for weight, optimizer in zip(weights, optimizers, strict=True):
            assert not optimizer.error_feedback.residual.any()  # what it owes is in its parameters
            assert (weight.detach() != start).sum() >= 126  # its own progress, kept
        trained = -(grads[0] + grads[1])  # one SGD step each from zero
        assert torch.allclose(weights[0].detach() + weights[1].detach(), trained, atol=1e-5)
        nursery.cancel_scope.cancel()


class _FailingAverager:
    """An averager whose every round fails with ``error`` (no group formed)."""

    def __init__(self, error: Exception):
        self.error = error
        self.host = SimpleNamespace(traffic=SimpleNamespace(bytes_sent=0, bytes_received=0))

    async def step(self, **kwargs):
        raise self.error


async def test_a_sparse_round_that_averages_nothing_moves_the_start_only_for_a_peer_on_its_own():
    """Others train on without us (no group formed; or matchmaking saw nobody, while their progress
    records are live): our start must stay where theirs is and our parameters where our training
    took them, all of the round's delta owed. Applying the whole delta, as a dense round's fallback
    does, moved our start by all our unsent progress. On our own (no one else's progress, or more
    than MAX_OWED_ROUNDS such rounds in a row), our start is the swarm's: it takes our progress,
    and newcomers download it."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        weight = torch.nn.Parameter(torch.zeros(128))
        optimizer = sparse_local_updates(node, weight)
        generator = torch.Generator().manual_seed(5)

        async def failed_round(error: Exception, others: bool) -> bool:
            """One round whose averaging fails with ``error``: whether the start moved."""
            optimizer.fragments[0] = dataclasses.replace(optimizer.fragments[0], averager=_FailingAverager(error))
            optimizer.replica.swarm = SwarmProgress({"another peer": PeerProgress(0, 10, 1.0)} if others else {})
            with torch.no_grad():
                weight.add_(torch.randn(128, generator=generator))
            trained, start = weight.detach().clone(), optimizer.snapshot[0].clone()
            moves = optimizer.outer_step
            moves.compute_deltas()
            record = await optimizer.average_deltas(optimizer.epoch, 1.0)
            await optimizer.advance(moves.apply, record)
            assert not record.averaged
            torch.testing.assert_close(weight.detach(), trained)  # all of its own progress, kept
            moved = not torch.equal(optimizer.snapshot[0], start)
            assert not moved or torch.allclose(optimizer.snapshot[0], trained)  # nothing, or all of it
            return moved

        no_group, nobody = MatchmakingError("no averaging group formed"), NoOtherPeers("nobody declared")
        assert await failed_round(nobody, others=False) is True
        assert await failed_round(nobody, others=True) is False  # declarations missed each other
        assert await failed_round(no_group, others=True) is False
        assert await failed_round(no_group, others=True) is True  # the 4th in a row: on its own
        nursery.cancel_scope.cancel()


def test_a_sparse_codec_needs_outer_lr_one_without_momentum():
    weight = torch.nn.Parameter(torch.zeros(4))
    node = type("Node", (), {})()
    with pytest.raises(ValueError, match="outer_lr 1 and outer_momentum 0"):
        LocalUpdatesOptimizer(
            torch.optim.SGD([weight], lr=1.0), node, prefix="x", codec="topk_2bit", outer_momentum=0.9
        )


@pytest.mark.parametrize(("overlapped", "aggregation"), [(False, "mean"), (True, "mean"), (True, "centered-clip")])
async def test_three_peers_reach_the_digits_target_with_sparse_outer_rounds(overlapped, aggregation):
    """Centered-clip rounds are checked: every sender checks every reducer's sparse reply (a small
    model: ``CHECK_ALL_BELOW``), and no honest one is caught."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        async with trio.open_nursery() as background:

            def make(node, index, count):
                rounds = OverlappedRounds(background) if overlapped else None
                return make_local_updates_trainer(
                    node, index, count, rounds, prefix="digits-sparse", codec="topk_2bit", aggregation=aggregation
                )

            with trio.fail_after(90):
                trainers, statuses = await train_to_target(nodes, make, max_epochs=30)
            background.cancel_scope.cancel()
        assert max(s.accuracy for s in statuses.values()) >= 0.9
        assert any(t.optimizer.last_averaging and t.optimizer.last_averaging["averaged"] for t in trainers)
        services = [t.optimizer.delta_averager.all_reduce for t in trainers]
        assert all(service.checks.caught == 0 and not len(service.checks.banned) for service in services)
        assert (sum(service.checks.passed for service in services) > 0) == (aggregation == "centered-clip")
        nursery.cancel_scope.cancel()


def test_peerd_join_refuses_a_sparse_codec_outside_local_updates_in_one_line(tmp_path):
    result = subprocess.run(
        PEERD + ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "id.key"),
                 "--task", "digits", "--compression", "topk_2bit"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.strip().splitlines() == [
        "peerd: --compression topk_2bit is sparse: it needs --mode local-updates"
    ]


def test_peerd_join_refuses_an_outer_lr_it_cannot_take_in_one_line(tmp_path):
    for extra, line in [
        (
            ["--outer-lr", "0.35"],
            "peerd: --outer-lr 0.35 is the outer step of local updates: give --mode local-updates",
        ),
        (
            ["--outer-lr", "0.5", "--mode", "local-updates", "--compression", "topk_2bit"],
            "peerd: --compression topk_2bit keeps unsent progress in the parameters: it takes --outer-lr 1, not 0.5",
        ),
    ]:
        result = subprocess.run(
            PEERD + ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "id.key"), "--task", "digits",
                     *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == EXIT_BAD_INPUT, result.stderr
        assert result.stderr.strip().splitlines() == [line]


def test_the_collaborative_optimizer_refuses_a_sparse_codec():
    weight = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="topk_4bit is sparse"):
        CollaborativeOptimizer(
            torch.optim.SGD([weight], lr=1.0), object(), prefix="x", target_batch_size=4, codec="topk_4bit"
        )


def test_the_start_cuts_into_fragments_that_cover_it_once_and_write_through():
    outer = OuterStep([torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))], lr=1.0, momentum=0.0)
    fragments = outer.start_fragments(4)
    assert [sum(piece.numel() for piece in fragment) for fragment in fragments] == [5, 6, 5, 6]
    for number, fragment in enumerate(fragments):
        for piece in fragment:
            piece.fill_(number + 1)
    flat = torch.cat([tensor.reshape(-1) for tensor in outer.start_average])
    assert flat.tolist() == [1.0] * 5 + [2.0] * 6 + [3.0] * 5 + [4.0] * 6


@pytest.mark.parametrize(("codec", "pieces"), [("topk_2bit", 64), ("blockwise_8bit", 8), ("none", 2)])
async def test_the_start_is_averaged_a_piece_at_a_time(codec, pieces):
    """Two peers whose starts differ everywhere: the round's start averaging pulls together the
    piece that the round's epoch names, and only it; each peer's parameters move with it. Dense
    codecs too: in line, the whole start in float32 held training for as long as it took to send
    (12-18 s of every ~70 s at 10 Mbit/s in the lab, with int8 deltas)."""
    assert start_pieces(codec) == pieces
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        size = 2 * pieces
        weights = [torch.nn.Parameter(torch.full((size,), float(i))) for i in range(2)]
        optimizers = [
            sparse_local_updates(node, weight, average_state_every=1, codec=codec, local_steps=1)
            for node, weight in zip(nodes, weights, strict=True)
        ]
        assert len(optimizers[0].start_averagers) == pieces
        assert optimizers[0].start_averagers[1].prefix == f"sparse.start.1of{pieces}"  # the count in the key

        async def one_round(i: int) -> None:
            weights[i].grad = torch.zeros(size)
            assert await optimizers[i].step(1) is True

        with trio.fail_after(30):
            async with trio.open_nursery() as rounds:
                for i in range(2):
                    rounds.start_soon(one_round, i)
        epoch = optimizers[0].epoch
        assert epoch == optimizers[1].epoch == 1
        fragment = slice(2 * (epoch % pieces), 2 * (epoch % pieces) + 2)
        starts = [o.snapshot[0] for o in optimizers]
        assert torch.equal(starts[0][fragment], torch.full((2,), 0.5)) and torch.equal(
            starts[1][fragment], starts[0][fragment]
        )
        others = torch.ones(size, dtype=torch.bool)
        others[fragment] = False
        assert torch.equal(starts[0][others], torch.zeros(size - 2)) and torch.equal(
            starts[1][others], torch.ones(size - 2)
        )
        assert torch.equal(weights[0].detach(), starts[0]) and torch.equal(weights[1].detach(), starts[1])
        nursery.cancel_scope.cancel()
