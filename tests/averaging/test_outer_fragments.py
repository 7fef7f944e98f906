"""Streamed fragments (``averaging/outer_fragments.py``): how a model is dealt into fragments, and
in-process peers whose rounds take turns averaging them, with either schedule."""

from __future__ import annotations

import inspect
import subprocess

import pytest
import torch
import trio

from averaging.local_rounds import OverlappedRounds, SequentialRounds
from averaging.local_updates import MAX_KEPT_TURNS, LocalUpdatesOptimizer
from averaging.outer_fragments import OuterFragments, deal_fragments
from averaging.progress import PeerProgress, SwarmProgress
from averaging.replica import AveragingRecord
from peer import PeerID
from peerd.exit_codes import EXIT_BAD_INPUT, EXIT_USAGE
from peerd.join_arguments import FRAGMENTS
from tests.daemon.test_training import make_local_updates_trainer, open_swarm, train_to_target
from tests.support.processes import PEERD


def test_fragments_hold_every_tensor_once_in_even_sizes_and_stride_a_stack_of_blocks():
    sizes = [30, 100, 10, 100, 10, 100, 10, 100, 10, 100, 10, 100, 10]  # an embedding, then six blocks
    fragments = deal_fragments(sizes, 3)
    assert sorted(i for fragment in fragments for i in fragment) == list(range(len(sizes)))
    assert all(fragment == sorted(fragment) for fragment in fragments)  # each in the model's order
    assert [sum(sizes[i] for i in fragment) for fragment in fragments] == [230, 230, 230]
    assert [[i for i in fragment if sizes[i] == 100] for fragment in fragments] == [[1, 7], [3, 9], [5, 11]]
    assert deal_fragments(sizes, 3) == fragments  # every peer deals the same model the same way
    assert deal_fragments(sizes, 1) == [list(range(len(sizes)))]


@pytest.mark.parametrize("count", [0, 9])
def test_a_fragment_count_the_model_cannot_fill_is_refused(count):
    with pytest.raises(ValueError, match="give 1 to 8"):
        deal_fragments([1] * 8, count)


def test_the_start_and_momentum_are_in_the_models_order_whatever_the_fragments():
    """What newcomers download and the start averaging averages: four tensors of one shape (a
    layer's q, k, v, o) dealt into two fragments must not come back as q, v, k, o."""
    params = [torch.nn.Parameter(torch.full((8, 8), float(i))) for i in range(4)]
    for count in (1, 2, 4):
        outer = OuterFragments(params, count, lr=0.7, momentum=0.9)
        assert [float(tensor[0, 0]) for tensor in outer.start] == [0.0, 1.0, 2.0, 3.0]
        assert [tensor.shape for tensor in outer.momentum] == [(8, 8)] * 4
        assert [p is q for p, q in zip(outer.params, params, strict=True)] == [True] * 4
        flat = torch.cat([piece for pieces in outer.start_fragments(3) for piece in pieces])
        assert torch.equal(flat, torch.cat([torch.full((64,), float(i)) for i in range(4)]))


class _Fragment:
    """One fragment's round whose group declared ``declared`` (a member may claim any round)."""

    def __init__(self, declared: int):
        self.declared = declared

    async def average(self, epoch, weight):
        return AveragingRecord(self.declared, averaged=True)

    async def settle(self, record, keep_owed):
        pass


async def test_a_group_that_declares_another_fragments_turn_does_not_move_the_epoch():
    """On fragment 0's key every honest peer declares an even round; a member declaring round 1
    there would have its group count round 1 as done, and fragment 1 would miss its turn."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
        optimizer = LocalUpdatesOptimizer(
            torch.optim.SGD(params, lr=0.1), node, prefix="turns", local_steps=2, fragments=2
        )
        optimizer.fragments[0] = _Fragment(declared=1)
        assert (await optimizer.average_deltas(0, 1.0)).epoch == 0
        optimizer.fragments[0] = _Fragment(declared=2)  # a peer a whole turn ahead: as one fragment's rounds are
        assert (await optimizer.average_deltas(0, 1.0)).epoch == 2
        nursery.cancel_scope.cancel()


def test_rounds_of_fragments_must_split_the_local_steps_evenly():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    with pytest.raises(ValueError, match="3 fragments must divide local_steps"):
        LocalUpdatesOptimizer(torch.optim.SGD(params, lr=0.1), object(), prefix="x", local_steps=20, fragments=3)


class _MovingRound:
    """A LocalRound whose epoch moves while a round is in flight (a group's declared round, a
    state load), so that ``outer_step`` names another fragment by the time the round lands."""

    def __init__(self):
        self.epoch = 0
        self.landed: list[str] = []
        self.averaged = trio.Event()

    @property
    def outer_step(self):
        round_ = self

        class Moves:
            name = f"fragment {round_.epoch % 2}"

            def compute_deltas_and_anchor(self):
                return []

            def apply_delayed(self, anchor):
                round_.landed.append(self.name)

        return Moves()

    async def average_deltas(self, epoch, weight):
        self.averaged.set()
        return AveragingRecord(epoch, averaged=True)

    async def advance(self, apply, record):
        apply()

    async def finish_round(self):
        pass

    def restart_round(self):
        pass


async def test_an_overlapped_round_lands_on_the_fragment_whose_delta_it_took():
    run = _MovingRound()
    async with trio.open_nursery() as background:
        rounds = OverlappedRounds(background)
        assert await rounds.end_round(run, 1.0) is False  # fragment 0's delta goes out
        await run.averaged.wait()
        run.epoch = 1  # meanwhile the epoch moved: the current round is fragment 1's
        assert await rounds.end_round(run, 1.0) is True
        assert run.landed == ["fragment 0"]
        background.cancel_scope.cancel()


def two_peers_in_fragments(nodes, prefix: str, schedule: str, background, matchmaking_timeout: float):
    """Two peers' models of two tensors (4 and 3 values), averaged in two fragments taking turns,
    two inner SGD steps each (``local_steps=4``), by the exact mean; their optimizers."""
    models = [[torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))] for _ in nodes]
    optimizers = [
        LocalUpdatesOptimizer(
            torch.optim.SGD(params, lr=0.1),
            node,
            prefix=prefix,
            local_steps=4,
            fragments=2,
            codec="none",
            aggregation="mean",
            target_group_size=2,
            settle_time=0.1,
            matchmaking_timeout=matchmaking_timeout,
            averaging_timeout=6.0,
            average_state_every=0,
            rounds=SequentialRounds() if schedule == "sequential" else OverlappedRounds(background),
        )
        for params, node in zip(models, nodes, strict=True)
    ]
    return models, optimizers


@pytest.mark.parametrize("schedule", ["sequential", "overlapped"])
async def test_rounds_take_turns_averaging_the_fragments(schedule):
    """Two peers, a model of two tensors dealt into two fragments, two inner steps per fragment's
    turn (``local_steps=4``): each round averages one fragment, the other's start stays as its last
    round left it, and every fragment is averaged every other round."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        async with trio.open_nursery() as background:
            models, optimizers = two_peers_in_fragments(nodes, "fragments", schedule, background, 2.0)
            assert [optimizers[0].round_steps, len(optimizers[0].fragments)] == [2, 2]
            starts: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}  # per peer, after each epoch

            async def train(i: int) -> None:
                optimizer = optimizers[i]
                while optimizer.epoch < 4:
                    for param in models[i]:
                        param.grad = torch.full_like(param, float(i + 1))  # the peers' updates differ
                    if await optimizer.step(1):
                        starts[i].append([tensor.clone() for tensor in optimizer.snapshot])

            with trio.fail_after(60):
                async with trio.open_nursery() as peers:
                    for i in range(2):
                        peers.start_soon(train, i)
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    for epoch in range(4):
        averaged = epoch % 2  # the round that ended at this epoch averaged this fragment
        mine, theirs = starts[0][epoch], starts[1][epoch]
        torch.testing.assert_close(mine[averaged], theirs[averaged])  # the shared start, shared
        assert mine[averaged].abs().sum() > 0  # and moved
        before = starts[0][epoch - 1][1 - averaged] if epoch else torch.zeros(4 if averaged else 3)
        assert torch.equal(mine[1 - averaged], before)  # the other fragment's waits for its turn


async def test_three_peers_reach_the_digits_target_averaging_in_fragments():
    """As ``peerd join --mode local-updates --fragments 2`` trains: overlapped rounds of 10 inner
    steps, each averaging half of the model (the digits model's two linear layers' tensors)."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        async with trio.open_nursery() as background:
            averaged = {0: 0, 1: 0}  # rounds each fragment averaged with a group, over all peers

            def counted(index: int, step):
                async def counted_step(*args, **kwargs):
                    result = await step(*args, **kwargs)
                    averaged[index] += 1
                    return result

                return counted_step

            def make(node, index, count):
                rounds = OverlappedRounds(background)
                trainer = make_local_updates_trainer(node, index, count, rounds, prefix="digits-fragments", fragments=2)
                for number, fragment in enumerate(trainer.optimizer.fragments):
                    fragment.averager.step = counted(number, fragment.averager.step)
                return trainer

            with trio.fail_after(120):
                trainers, statuses = await train_to_target(nodes, make, max_epochs=60)
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    assert max(s.accuracy for s in statuses.values()) >= 0.9
    assert averaged[0] > 0 and averaged[1] > 0, averaged  # both fragments' averagers met their groups
    assert len({fragment.averager.prefix for fragment in trainers[0].optimizer.fragments}) == 2


def test_peerd_join_refuses_fragments_it_cannot_take_in_one_line(tmp_path):
    for extra, code, line in [
        (
            ["--fragments", "2"],
            EXIT_BAD_INPUT,
            "peerd: --fragments 2 averages local updates in turns: give --mode local-updates",
        ),
        (
            ["--fragments", "3", "--mode", "local-updates"],
            EXIT_BAD_INPUT,
            "peerd: --fragments 3 must divide --local-steps 20 into equal rounds",
        ),
        (
            ["--fragments", "0", "--mode", "local-updates"],
            EXIT_USAGE,
            "peerd join: error: argument --fragments: must be a whole number above 0: '0'",
        ),
    ]:
        identity = str(tmp_path / "id.key")
        result = subprocess.run(
            PEERD + ["join", "--listen", "127.0.0.1:0", "--identity", identity, "--task", "digits", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == code, result.stderr
        said = result.stderr.strip().splitlines()
        assert said == [line] if code == EXIT_BAD_INPUT else line in said  # argparse adds its usage line


def test_the_fragments_default_is_the_optimizers():
    assert FRAGMENTS.default == inspect.signature(LocalUpdatesOptimizer).parameters["fragments"].default == 1


@pytest.mark.parametrize("schedule", ["sequential", "overlapped"])
async def test_peers_a_round_apart_meet_on_one_fragments_turn(schedule):
    """A peer one round behind the other (it loaded state while its donor's round was in flight,
    say) averages another fragment under another key: were failed rounds counted as rounds, both
    would move on in step, a fragment apart, and never meet again (each round clocked by the
    matchmaking deadline, as in ``peerd join`` with quick inner steps). The one ahead keeps the
    round it failed while the other claims the one before, and they meet."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        async with trio.open_nursery() as background:
            models, optimizers = two_peers_in_fragments(nodes, "fragments-apart", schedule, background, 1.5)
            optimizers[0].replica.epoch = 1  # a round ahead
            records: dict[int, list[AveragingRecord]] = {0: [], 1: []}

            async def train(i: int) -> None:
                optimizer = optimizers[i]
                while len(records[i]) < 6:
                    for param in models[i]:
                        param.grad = torch.full_like(param, float(i + 1))
                    if await optimizer.step(1):
                        records[i].append(optimizer.replica.last_round)

            with trio.fail_after(90):
                async with trio.open_nursery() as peers:
                    for i in range(2):
                        peers.start_soon(train, i)
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    for i in range(2):
        assert any(record.averaged and record.group == 2 for record in records[i][2:]), records[i]


async def test_a_failed_round_keeps_its_turn_only_for_a_peer_a_round_behind_and_not_for_long():
    """What ``_keeps_turn`` reads: peers at our own epoch say nothing of a peer behind (they may
    have averaged it without us, and move on: keeping would leave us a fragment behind them for
    good); a round whose group formed and failed later is not a missed meeting; and a record
    claiming the epoch before ours, kept fresh by a saboteur or left by a peer that stopped,
    holds us back ``MAX_KEPT_TURNS`` rounds in a row at most."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
        optimizer = LocalUpdatesOptimizer(
            torch.optim.SGD(params, lr=0.1), node, prefix="kept", local_steps=4, fragments=2, codec="none"
        )
        replica = optimizer.replica
        replica.epoch = 5
        missed = AveragingRecord(epoch=5, failure="no_group")
        formed = AveragingRecord(epoch=5, failure="allreduce", matchmaking_s=0.2)

        def claims(*epochs: int) -> None:
            others = {PeerID(bytes([i]) * 20): PeerProgress(epoch, 10, 1.0) for i, epoch in enumerate(epochs, 1)}
            replica.swarm = SwarmProgress(others, None, replica.tracker.me)

        claims(5, 5)
        assert not optimizer._keeps_turn(missed)
        claims(4, 6)
        assert not optimizer._keeps_turn(missed)
        claims(4, 5)
        assert optimizer._keeps_turn(missed) and not optimizer._keeps_turn(formed)
        for _ in range(MAX_KEPT_TURNS):
            await optimizer.advance(lambda: None, missed)
        assert replica.epoch == 5
        await optimizer.advance(lambda: None, missed)
        assert replica.epoch == 6  # counted at last
        nursery.cancel_scope.cancel()
