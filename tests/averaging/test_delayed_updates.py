"""Delayed parameter updates in collaborative mode: an epoch's gradients are averaged in the
background while the next epoch accumulates, and the swarm still converges together."""

from __future__ import annotations

import pytest
import torch
import trio

from averaging.match_ahead import MatchAhead
from averaging.matchmaking import MatchmakingError
from averaging.optimizer import CollaborativeOptimizer
from averaging.progress import SwarmProgress
from averaging.update_schedules import DelayedUpdates, ImmediateUpdates
from dht.node import DHTNode
from tests.daemon.test_training import FAST, make_trainer, open_swarm, single_process_accuracy, train_to_target
from tests.support.newcomer import run_newcomer


async def test_three_peers_with_delayed_updates_reach_the_target_and_accumulate_while_averaging():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        async with trio.open_nursery() as background:
            trainers = [make_trainer(node, i, 3, **delayed_in(background)) for i, node in enumerate(nodes)]
            overlapped = [0, 0, 0]  # batches accumulated while this peer's round ran in the background
            statuses = {}

            async def train(i):
                trainer = trainers[i]
                original = trainer.optimizer.step

                async def counting_step(batch_size):
                    optimizer = trainer.optimizer
                    if optimizer.averaging_in_background:
                        overlapped[i] += 1
                    stepped = await original(batch_size)
                    if stepped:  # launched: the epoch counts, its step has not landed, and donors
                        # must not label the parameters before it with the new epoch
                        assert optimizer.replica.state.state_metadata()["epoch"] == optimizer.epoch - 1
                    return stepped

                trainer.optimizer.step = counting_step
                statuses[i] = await trainer.run(max_epochs=60, target_accuracy=0.9)

            with trio.fail_after(120):
                async with trio.open_nursery() as inner:
                    for i in range(3):
                        inner.start_soon(train, i)
            background.cancel_scope.cancel()
        assert max(s.accuracy for s in statuses.values()) >= 0.9
        assert all(count > 0 for count in overlapped), overlapped
        averaged = [t.optimizer.last_averaging for t in trainers]
        assert any(record and record["averaged"] and record["group"] >= 2 for record in averaged), averaged
        epochs = [t.optimizer.epoch for t in trainers]
        assert max(epochs) - min(epochs) <= 1, epochs
        nursery.cancel_scope.cancel()


async def test_delayed_updates_learn_per_epoch_at_least_as_well_as_one_process_at_the_target_batch():
    """``peerd join --delay-updates``: steps one epoch stale, and epochs that take more samples than
    the target while a round is in flight, must not cost accuracy per epoch against one process
    stepping on the target batch."""
    epochs, last = 40, 5
    # Held-out accuracy after one epoch is one draw (a peer's, 0.916-0.944 over 20 runs at epoch
    # 40; one process's over data orders 0.928-0.944): compared is the mean after each of the last
    # 5 epochs, against one process's over as many steps and 4 orders of the data.
    after_epoch: list[dict[int, float]] = []
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 4)
        async with trio.open_nursery() as background:

            def make(node, index, count):
                trainer = make_trainer(node, index, count, **delayed_in(background))
                after_epoch.append(evaluated_after_epochs(trainer, range(epochs - last + 1, epochs + 1)))
                return trainer

            with trio.fail_after(120):
                trainers, _ = await train_to_target(nodes, make, target=None, max_epochs=epochs)
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    accuracies = [sum(found.values()) / len(found) for found in after_epoch if found]
    assert len(accuracies) == 4, after_epoch  # every peer stepped through the last epochs
    single_accuracy = single_process_accuracy(trainers[0].task.target_batch_size, epochs, orders=4, last=last)
    assert single_accuracy > 0.85  # it learned: a bound below an untrained model's proves nothing
    assert min(accuracies) >= single_accuracy - 0.02, (accuracies, single_accuracy)


async def test_a_newcomer_with_delayed_updates_averages_with_the_swarm_in_its_next_epochs():
    """A peer that joins a training swarm loads a donor's state and averages within a few epochs.
    A donor with a round in flight serves the parameters of the epoch before its own, whose round
    is out of the newcomer's reach: a newcomer that joins at that epoch matches for it, fails,
    finds itself behind and loads again, for as long as its loads meet rounds in flight."""
    joined_at, epochs = 5, 30
    run = await run_newcomer(delayed_in, veterans=3, joined_at=joined_at, epochs=epochs, timeout=120)
    rounds = [(epoch, last) for epoch, last, _ in run.rounds]  # (the newcomer's epoch, its last round) per step
    first_epoch = next(epoch for epoch, _ in rounds if epoch > 0)  # where loading the state put it
    averaged = [epoch for epoch, last in rounds if last.get("averaged") and last.get("group", 0) >= 2]
    assert first_epoch >= joined_at and averaged, rounds
    # (2-3 epochs on an idle machine; a bound that two swarms on 2 cores keep too)
    assert averaged[0] - first_epoch <= 16, (first_epoch, averaged[0])
    averaged_rounds = {last["epoch"] for _, last in rounds if last.get("averaged") and last.get("group", 0) >= 2}
    assert len(averaged_rounds) >= 3, averaged_rounds  # it stays in the swarm's rounds


async def test_a_joiner_takes_the_donor_s_count_or_the_swarm_s_epoch_with_delayed_updates_and_the_loaded_one_without():
    reads = []

    def swarm_at(epoch):
        async def read():
            reads.append(epoch)
            return SwarmProgress({}, epoch)

        return read

    async with trio.open_nursery() as background:
        delayed = DelayedUpdates(background)
        # the donor's round for epoch 7 is in flight: it counted 8, its parameters are 7's
        assert await delayed.joining_epoch(7, 8, swarm_at(7)) == 8 and reads == []
        # none in flight, and the swarm moved on while the state downloaded: one past, no further
        assert await delayed.joining_epoch(7, 7, swarm_at(8)) == 8
        assert await delayed.joining_epoch(7, 7, swarm_at(12)) == 8
        assert await delayed.joining_epoch(7, 7, swarm_at(7)) == 7  # its round may still gather

        async def unreadable():
            raise OSError("the DHT is unreachable")

        assert await delayed.joining_epoch(7, 7, unreadable) == 7  # a failed read never stops the trainer
        background.cancel_scope.cancel()
    # a peer that steps at once keeps the loaded epoch, whatever the donor counted
    assert await ImmediateUpdates().joining_epoch(7, 8, swarm_at(9)) == 7


@pytest.mark.parametrize(
    ("metadata", "adopted", "counted"),
    [
        ({"epoch": 7, "counted_epoch": 8}, 7, 8),  # a donor whose round for epoch 7 is in flight
        ({"epoch": 7, "counted_epoch": 7}, 7, 7),
        ({"epoch": 7}, 7, 7),  # a donor that does not tell
        ({"epoch": 7, "counted_epoch": 10**6}, 7, 8),  # one past the epoch adopted at most
        ({"epoch": 50, "counted_epoch": 51}, 8, 8),  # the evidence (7) caps both claims
        ({"epoch": 7, "counted_epoch": 7.5}, 7, 7),
        ({"epoch": 7, "counted_epoch": True}, 7, 7),
        ({"epoch": 7, "counted_epoch": -3}, 7, 7),
    ],
)
async def test_a_donor_s_count_is_a_claim_bounded_like_its_epoch(metadata, adopted, counted):
    async with DHTNode.open() as node, trio.open_nursery() as background:
        replica = lone_delayed_optimizer(node, background).replica

        async def donor(timeout):
            return {"round": 0, **metadata}

        replica.state.load_state_from_peers = donor
        assert await replica.load_state_from_peers(1.0, evidenced=7) == counted
        assert replica.epoch == adopted
        background.cancel_scope.cancel()


def evaluated_after_epochs(trainer, epochs) -> dict[int, float]:
    """Filled as ``trainer`` runs: its model's held-out accuracy after each step that ends one of
    ``epochs`` (evaluated between steps, while no batch is in the worker thread)."""
    found: dict[int, float] = {}
    step = trainer.optimizer.step

    async def evaluating_step(batch_size):
        stepped = await step(batch_size)
        if stepped and trainer.optimizer.epoch in epochs:
            found[trainer.optimizer.epoch] = trainer.task.evaluate(trainer.task.model)["accuracy"]
        return stepped

    trainer.optimizer.step = evaluating_step
    return found


def delayed_in(background) -> dict:
    """Delayed updates, with each epoch's group formed ahead, both in ``background`` (as the
    daemon runs ``peerd join --delay-updates``)."""
    return {"updates": DelayedUpdates(background), "matching": MatchAhead(background)}


def lone_delayed_optimizer(node, background, target_batch_size=64) -> CollaborativeOptimizer:
    """A one-parameter model whose gradient is always 1, so the accumulators count samples."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = CollaborativeOptimizer(
        torch.optim.SGD([param], lr=0.1),
        node,
        prefix="held",
        target_batch_size=target_batch_size,
        **delayed_in(background),
        **FAST,
    )
    return optimizer


async def batch(optimizer: CollaborativeOptimizer, size: int = 32) -> bool:
    optimizer.params[0].grad = torch.ones(1)
    with trio.fail_after(5):  # a step that waits for the round in flight would hang here
        return await optimizer.step(size)


async def test_the_next_epoch_accumulates_past_the_target_while_the_last_round_still_averages():
    async with DHTNode.open() as node, trio.open_nursery() as background:
        optimizer = lone_delayed_optimizer(node, background)
        release, weights = trio.Event(), []

        async def held_round(weight=1.0, timeout=None, group=None, round_number=None):
            weights.append(weight)
            await release.wait()
            raise MatchmakingError("held by the test")

        optimizer.grad_averager.step = held_round
        assert [await batch(optimizer) for _ in range(2)] == [False, True]  # 64 samples: launched
        # Ten more batches: the next epoch reached its target long ago, but the round is in flight,
        # so it keeps accumulating instead of waiting for it.
        assert [await batch(optimizer) for _ in range(10)] == [False] * 10
        assert optimizer.averaging_in_background and optimizer.epoch == 1
        assert optimizer.local_samples == 320
        release.set()
        with trio.fail_after(5):
            while optimizer.averaging_in_background:
                await trio.sleep(0.01)
        # The round landed at the next batch and the ready epoch launched with all 352 samples.
        assert await batch(optimizer) is True
        with trio.fail_after(10):  # the new round starts once its matchmaking ahead gives up
            while len(weights) < 2:
                await trio.sleep(0.01)
        assert optimizer.epoch == 2 and weights == [64.0, 352.0]
        # The epoch evidence still bounds claimed epochs by the target batch, the smallest epoch
        # there can be, not by our own epochs' sizes: other peers' epochs may be much smaller.
        assert optimizer.tracker.evidence.samples_per_epoch == 64
        assert optimizer.params[0].item() == pytest.approx(-0.1)  # the first round's (local) step landed
        background.cancel_scope.cancel()


async def test_launching_a_round_does_not_wait_for_its_group_to_form():
    async with DHTNode.open() as node, trio.open_nursery() as background:
        optimizer = lone_delayed_optimizer(node, background)
        formed = trio.Event()

        async def forming(round_number=None, timeout=None, hold_open=None):
            await formed.wait()
            raise MatchmakingError("no group, as the test says")

        optimizer.grad_averager.find_group = forming
        assert [await batch(optimizer) for _ in range(4)] == [False, True, False, False]
        assert optimizer.averaging_in_background  # still waiting for its group, in the background
        formed.set()
        background.cancel_scope.cancel()


def test_join_refuses_an_unknown_compression_in_one_line(tmp_path):
    import subprocess
    import sys

    command = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--task", "digits"]
    result = subprocess.run(
        [sys.executable, "-m", "peerd.cli", *command, "--compression", "zip", "--delay-updates"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "unknown codec 'zip'" in result.stderr and "blockwise_8bit" in result.stderr
    assert "Traceback" not in result.stderr


def test_delay_updates_outside_collaborative_training_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    for extra in (["--task", "digits", "--mode", "local-updates"], []):
        command = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--delay-updates", *extra]
        result = subprocess.run(
            [sys.executable, "-m", "peerd.cli", *command], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1, result.stderr
        assert "--delay-updates applies to training (--task) in collaborative mode only" in result.stderr


async def test_after_the_first_step_no_batch_waits_for_the_progress_exchange():
    async with DHTNode.open() as node, trio.open_nursery() as background:
        optimizer = lone_delayed_optimizer(node, background, target_batch_size=10**6)
        assert await batch(optimizer) is False  # the first step reads the swarm before deciding
        replica, fetching, release = optimizer.replica, trio.Event(), trio.Event()
        fetch = replica.fetch

        async def slow_fetch(samples):
            fetching.set()
            await release.wait()
            return await fetch(samples)

        replica.fetch = slow_fetch
        with trio.fail_after(5):
            while not fetching.is_set():  # batches go on while an exchange is due and then under way
                assert await batch(optimizer) is False
                await trio.sleep(optimizer.progress_interval / 4)
            for _ in range(5):
                assert await batch(optimizer) is False
        release.set()
        with trio.fail_after(5):  # the exchange finishes in the background and the view moves on
            while replica.swarm.peers[replica.tracker.me].samples < optimizer.local_samples - 5 * 32:
                await trio.sleep(0.01)
        background.cancel_scope.cancel()


@pytest.mark.parametrize("delayed", [False, True])
async def test_an_epoch_counted_from_a_group_ahead_moves_the_learning_rate_schedule_too(monkeypatch, delayed):
    """A peer a moment late averages in its group's round for the next epoch and counts that epoch
    as done as well (``Replica.count_round``): its schedule must move as far as its epoch, or it
    would run one more epoch behind the swarm's learning rate each time that happens."""
    import averaging.optimizer as optimizer_module
    from averaging.replica import AveragingRecord

    async def group_one_epoch_ahead(averager, *, epoch, weight, fallback, group=None, timeout=None):
        return AveragingRecord(epoch + 1, averaged=True, group=2)

    monkeypatch.setattr(optimizer_module, "average_once", group_one_epoch_ahead)
    async with DHTNode.open() as node, trio.open_nursery() as background:
        param = torch.nn.Parameter(torch.zeros(1))
        inner = torch.optim.SGD([param], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda epoch: 1.0 / (epoch + 1))
        optimizer = CollaborativeOptimizer(
            inner,
            node,
            prefix="ahead",
            target_batch_size=32,
            scheduler=scheduler,
            **(delayed_in(background) if delayed else {"updates": ImmediateUpdates()}),
            **FAST,
        )
        with trio.fail_after(10):
            assert await batch(optimizer) is True
            while optimizer.averaging_in_background:
                await trio.sleep(0.01)
            await batch(optimizer)  # a delayed step lands at the next batch
        # Every round's group is one epoch ahead, so every round counts two epochs, and the
        # schedule steps once per epoch whose step landed. In line, both batches' rounds landed:
        # epochs 0-1 and 2-3. Delayed, the first round landed at the second batch (epochs 0-1),
        # which then launched the second (epoch 2 counted, its step not landed yet).
        assert optimizer.epoch >= 2
        assert (optimizer.epoch, scheduler.last_epoch) == ((3, 2) if delayed else (4, 4))
        background.cancel_scope.cancel()
