"""Collaborative training of the digits task by in-process peers over a real DHT."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
import trio

from averaging.local_rounds import OverlappedRounds, SequentialRounds
from averaging.match_ahead import MatchAhead
from averaging.optimizer import CollaborativeOptimizer
from dht.node import DHTNode
from peerd.tasks import ShardSpec, TaskError, digits_task, load_task
from peerd.training import Trainer

FAST = {"settle_time": 0.1, "matchmaking_timeout": 2.0, "averaging_timeout": 6.0, "progress_interval": 0.1}


async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(initial_peers=initial) as node:
        task_status.started(node)
        await trio.sleep(math.inf)


async def open_swarm(nursery, count):
    first = await nursery.start(run_node, [])
    return [first] + [await nursery.start(run_node, [first.address]) for _ in range(count - 1)]


def make_trainer(node, index, count, **options):
    task = digits_task(shard=ShardSpec(index, count))
    optimizer = CollaborativeOptimizer(
        task.make_optimizer(list(task.model.parameters())),
        node,
        prefix="digits-test",
        target_batch_size=task.target_batch_size,
        target_group_size=count,
        **{**FAST, **options},
    )
    return Trainer(task, optimizer)


async def test_three_peers_reach_target_accuracy_on_digits():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        # as the daemon trains: each epoch's group forms in the background while it accumulates
        trainers = [make_trainer(node, i, 3, matching=MatchAhead(nursery)) for i, node in enumerate(nodes)]
        statuses = {}

        async def train(i):
            statuses[i] = await trainers[i].run(max_epochs=60, target_accuracy=0.9)

        with trio.fail_after(90):
            async with trio.open_nursery() as inner:
                for i in range(3):
                    inner.start_soon(train, i)
        assert max(s.accuracy for s in statuses.values()) >= 0.9
        averaged = [t.optimizer.last_averaging for t in trainers]
        assert any(record and record["averaged"] and record["group"] >= 2 for record in averaged)
        # The swarm stepped together: every peer ended within one epoch of the others.
        epochs = [t.optimizer.epoch for t in trainers]
        assert max(epochs) - min(epochs) <= 1
        nursery.cancel_scope.cancel()


async def test_late_joiner_starts_at_the_swarm_epoch_with_its_parameters():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        early = [make_trainer(node, i, 2, average_state_every=2) for i, node in enumerate(nodes[:2])]
        async with trio.open_nursery() as inner:
            for trainer in early:
                inner.start_soon(lambda t=trainer: t.run(max_epochs=6))
        swarm_epoch = early[0].optimizer.epoch
        assert swarm_epoch >= 5
        late = make_trainer(nodes[2], 0, 1)
        assert late.optimizer.epoch == 0
        await late.optimizer.step(1)  # one batch is enough to see the swarm is ahead and catch up
        assert late.optimizer.epoch >= swarm_epoch
        reference = early[0].task.model.state_dict()
        for name, value in late.task.model.state_dict().items():
            assert torch.allclose(value, reference[name], atol=1e-6), name
        # ... and the optimizer's state (Adam's moments and step counts), not a restart from zero
        donor_state = early[0].optimizer.optimizer_state
        assert donor_state and len(late.optimizer.optimizer_state) == len(donor_state)
        for ours, theirs in zip(late.optimizer.optimizer_state, donor_state, strict=True):
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
        assert late.optimizer.optimizer.state[next(late.task.model.parameters())]["step"] >= 5
        nursery.cancel_scope.cancel()


def scheduled_sgd(node, shard: ShardSpec, **options):
    """The digits task under SGD at lr 1.0 halved every 2 epochs (StepLR), swarm batch 128:
    ``(task, inner optimizer, CollaborativeOptimizer)``."""
    task = digits_task(shard=shard)
    inner = torch.optim.SGD(task.model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
    optimizer = CollaborativeOptimizer(inner, node, target_batch_size=128, scheduler=scheduler, **{**FAST, **options})
    return task, inner, optimizer


async def test_a_peer_that_moves_to_the_swarm_epoch_moves_its_lr_schedule_with_it():
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        task, inner, optimizer = scheduled_sgd(node, ShardSpec(0, 1), prefix="digits-schedule", load_state_timeout=0.5)
        await optimizer.load_state_from_peers(swarm_epoch=6)  # no donor: local parameters, swarm epoch
        assert optimizer.epoch == 6
        assert inner.param_groups[0]["lr"] == pytest.approx(0.125)  # 1.0 * 0.5 ** (6 // 2)
        with trio.fail_after(10):  # an absurd epoch from the network costs a bounded catch-up
            await optimizer.load_state_from_peers(swarm_epoch=10**15)
        # a schedule that refuses to go past its end (OneCycleLR raises) does not stop training
        inner.param_groups[0].pop("initial_lr", None)
        optimizer = CollaborativeOptimizer(
            inner,
            node,
            prefix="digits-one-cycle",
            target_batch_size=128,
            scheduler=torch.optim.lr_scheduler.OneCycleLR(inner, max_lr=1.0, total_steps=3),
            **{**FAST, "load_state_timeout": 0.5},
        )
        await optimizer.load_state_from_peers(swarm_epoch=10**15 + 10)
        assert optimizer.epoch == 10**15 + 10
        # ... nor at the next epoch's step (alone, so averaging fails and it steps on its own)
        for batch in task.batches:
            task.loss_fn(task.model, batch).backward()
            if await optimizer.step(len(batch[1])):
                break
        assert optimizer.epoch == 10**15 + 11
        nursery.cancel_scope.cancel()


async def test_impossible_optimizer_state_from_a_donor_is_clamped():
    """A donor's state is finite (the all-reduce refuses NaN) but can still be impossible: a
    negative second moment would turn the next Adam step into NaN."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        weights = [torch.nn.Parameter(torch.ones(4)) for _ in nodes]
        optimizers = [
            CollaborativeOptimizer(
                torch.optim.Adam([weight], lr=0.1), node, prefix="poison", target_batch_size=10**6, **FAST
            )
            for weight, node in zip(weights, nodes, strict=True)
        ]
        donor, joiner = optimizers
        state = donor.optimizer.state[weights[0]]
        state["exp_avg_sq"].fill_(-1.0)
        state["step"].fill_(-1.0)
        await donor.state_averager.state_sharing.announce(1)
        with trio.fail_after(20):
            await joiner.load_state_from_peers()
        loaded = joiner.optimizer.state[weights[1]]
        assert (loaded["exp_avg_sq"] >= 0).all() and loaded["step"] >= 0
        weights[1].grad = torch.ones(4)
        joiner.optimizer.step()
        assert torch.isfinite(weights[1]).all()
        nursery.cancel_scope.cancel()


def test_bad_task_names_give_clear_errors():
    with pytest.raises(TaskError, match="unknown task 'nope'.*digits"):
        load_task("nope")
    with pytest.raises(TaskError, match="cannot load task factory 'no_such_module:f'"):
        load_task("no_such_module:f")
    with pytest.raises(TaskError, match="shard index 3"):
        ShardSpec(3, 2)


def test_thin_shards_still_give_batches_and_empty_ones_are_refused():
    thin = digits_task(shard=ShardSpec(5, 200), batch_size=32)  # 1,438 training images: 7 or 8 each
    inputs, targets = next(thin.batches)
    assert 1 <= len(inputs) < 32 and len(inputs) == len(targets)
    with pytest.raises(TaskError, match="shard 1500/2000 of digits is empty"):
        digits_task(shard=ShardSpec(1500, 2000))


async def train_to_target(nodes, make, target: float | None = 0.9, max_epochs=80):
    trainers = [make(node, i, len(nodes)) for i, node in enumerate(nodes)]
    statuses = {}

    async def train(i):
        statuses[i] = await trainers[i].run(max_epochs=max_epochs, target_accuracy=target)

    async with trio.open_nursery() as inner:
        for i in range(len(trainers)):
            inner.start_soon(train, i)
    return trainers, statuses


def make_local_updates_trainer(node, index, count, rounds=None, **options):
    from averaging.local_updates import LocalUpdatesOptimizer

    task = digits_task(shard=ShardSpec(index, count))
    settings = {
        "prefix": "digits-local",
        "local_steps": 20,
        "codec": "uint8",
        "target_group_size": count,
        "settle_time": 0.1,
        "matchmaking_timeout": 3.0,
        "averaging_timeout": 6.0,
        "rounds": rounds,
    }
    optimizer = LocalUpdatesOptimizer(
        task.make_optimizer(list(task.model.parameters())), node, **{**settings, **options}
    )
    return Trainer(task, optimizer)


async def test_overlapped_local_updates_reach_the_target_while_averaging_in_the_background():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        async with trio.open_nursery() as background:

            def make(node, index, count):
                return make_local_updates_trainer(node, index, count, rounds=OverlappedRounds(background))

            with trio.fail_after(90):
                trainers, statuses = await train_to_target(nodes, make, max_epochs=30)
            background.cancel_scope.cancel()
        assert max(s.accuracy for s in statuses.values()) >= 0.9
        assert any(t.optimizer.last_averaging and t.optimizer.last_averaging["averaged"] for t in trainers)
        nursery.cancel_scope.cancel()


def tiny_local_updates(node, weight, **options):
    """One inner SGD step (lr 1) per round on one small tensor, outer Nesterov at lr 0.5 and
    momentum 0.9, exact averaging (the plain mean: with centered-clip a peer in a pair moves only as
    far as its own past updates allow, and these have none): small enough to check by hand."""
    from averaging.local_updates import LocalUpdatesOptimizer

    defaults = {
        "local_steps": 1,
        "outer_lr": 0.5,
        "outer_momentum": 0.9,
        "codec": "none",
        "target_group_size": 2,
        "aggregation": "mean",
    }
    return LocalUpdatesOptimizer(torch.optim.SGD([weight], lr=1.0), node, settle_time=0.05, **{**defaults, **options})


async def test_a_delayed_outer_step_keeps_the_progress_made_while_averaging():
    """One lone peer (its averaging fails: no partner), so every delta is its own and the math can
    be checked exactly: after round 1, params = outer_step(start, delta_0) + (progress in round 1)."""

    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        async with trio.open_nursery() as background:
            weight = torch.nn.Parameter(torch.zeros(3))
            optimizer = tiny_local_updates(
                node,
                weight,
                prefix="lone",
                matchmaking_timeout=0.2,
                averaging_timeout=1.0,
                rounds=OverlappedRounds(background),
            )

            async def inner_step(grad):
                weight.grad = torch.tensor(grad)
                return await optimizer.step(1)

            assert await inner_step([1.0, 0.0, 0.0]) is False  # round 0 ends: averaging starts, no outer step yet
            assert weight.tolist() == [-1.0, 0.0, 0.0] and optimizer.epoch == 0
            assert await inner_step([0.0, 2.0, 0.0]) is True  # round 1 ends: round 0's outer step lands
            # outer step from start 0 along delta_0 = +1 (lr 0.5, first Nesterov step: 1.9 x the
            # gradient): -0.95; plus round 1's own progress (-2), which a plain outer step would lose
            assert torch.allclose(weight.detach(), torch.tensor([-0.95, -2.0, 0.0])) and optimizer.epoch == 1
            assert optimizer.last_averaging is not None and optimizer.last_averaging["averaged"] is False
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_sequential_rounds_step_at_once_and_the_overlapped_schedule_can_be_passed_explicitly():
    """The same lone peer and gradients as above: a sequential round lands its own outer step at
    the end of the round, as it does by default; ``rounds=OverlappedRounds(nursery)`` lands it a
    round late, with the progress made meanwhile."""

    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        lone = {"matchmaking_timeout": 0.2, "averaging_timeout": 1.0}
        weight = torch.nn.Parameter(torch.zeros(3))
        optimizer = tiny_local_updates(node, weight, prefix="lone-seq", rounds=SequentialRounds(), **lone)
        weight.grad = torch.tensor([1.0, 0.0, 0.0])
        assert await optimizer.step(1) is True and optimizer.epoch == 1
        assert torch.allclose(weight.detach(), torch.tensor([-0.95, 0.0, 0.0]))
        assert optimizer.last_averaging == {"epoch": 0, "averaged": False, "group": 0, "failed": []}

        async with trio.open_nursery() as background:
            weight = torch.nn.Parameter(torch.zeros(3))
            overlapped = tiny_local_updates(
                node, weight, prefix="lone-overlap", rounds=OverlappedRounds(background), **lone
            )
            weight.grad = torch.tensor([1.0, 0.0, 0.0])
            assert await overlapped.step(1) is False and overlapped.epoch == 0  # averaging in flight
            weight.grad = torch.tensor([0.0, 2.0, 0.0])
            assert await overlapped.step(1) is True and overlapped.epoch == 1
            assert torch.allclose(weight.detach(), torch.tensor([-0.95, -2.0, 0.0]))
            with pytest.raises(TypeError, match="background"):  # a nursery is no schedule: say which one
                tiny_local_updates(node, weight, prefix="both", background=background)
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_local_updates_pull_diverged_replicas_together_and_hand_newcomers_the_momentum():
    """Averaging deltas alone never brings apart replicas back together; averaging the shared start
    every few rounds does, a piece at a time (two with float32 deltas: ``start_pieces``). Exact
    arithmetic with one inner step per round."""

    def make(node, start):
        weight = torch.nn.Parameter(torch.tensor(start))
        optimizer = tiny_local_updates(
            node, weight, prefix="replicas", matchmaking_timeout=3.0, averaging_timeout=6.0, average_state_every=1
        )
        return weight, optimizer

    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        (weight_a, a), (weight_b, b) = make(nodes[0], [0.0, 0.0, 0.0]), make(nodes[1], [2.0, 2.0, 2.0])
        assert len(a.state.tensors) == 2  # the shared start and the outer momentum buffer

        async def one_round(weight, optimizer, grad):
            weight.grad = torch.tensor(grad)
            assert await optimizer.step(1) is True

        with trio.fail_after(30):
            async with trio.open_nursery() as rounds:
                rounds.start_soon(one_round, weight_a, a, [1.0, 0.0, 0.0])
                rounds.start_soon(one_round, weight_b, b, [0.0, 1.0, 0.0])
        assert a.last_averaging["averaged"] and b.last_averaging["averaged"]
        # averaged delta (0.5, 0.5, 0); first Nesterov step 1.9 x that at lr 0.5 from each start:
        # (-0.475, -0.475, 0) and (1.525, 1.525, 2); then epoch 1's piece of the starts (values 1
        # and 2 of the two pieces [0:1], [1:3]) is averaged: ((0, 0) + (2, 2)) / 2 - (0.475, 0)
        assert len(a.start_averagers) == 2
        assert torch.allclose(weight_a.detach(), torch.tensor([-0.475, 0.525, 1.0]))
        assert torch.allclose(weight_b.detach(), torch.tensor([1.525, 0.525, 1.0]))
        # each peer's momentum is its own delta's (worker momentum: the average of the two is
        # the averaged delta's)
        assert torch.allclose(a.outer_state[0], torch.tensor([1.0, 0.0, 0.0]))
        assert torch.allclose(b.outer_state[0], torch.tensor([0.0, 1.0, 0.0]))

        # the next round averages the other piece: the replicas are one again
        async def next_round(weight, optimizer):
            while optimizer.epoch < 2:
                weight.grad = torch.zeros(3)
                await optimizer.step(1)

        with trio.fail_after(30):
            async with trio.open_nursery() as rounds:
                rounds.start_soon(next_round, weight_a, a)
                rounds.start_soon(next_round, weight_b, b)
        assert torch.allclose(a.snapshot[0], b.snapshot[0]) and torch.allclose(weight_a.detach(), weight_b.detach())

        weight_c, c = make(nodes[2], [9.0, 9.0, 9.0])
        with trio.fail_after(30):
            await c.load_state_from_peers()
        assert torch.allclose(weight_c.detach(), a.snapshot[0])
        assert any(torch.allclose(c.outer_state[0], donor.outer_state[0]) for donor in (a, b))
        assert c.epoch == 1  # the donors' 2 is a claim, taken up to one past what c has seen (nothing yet)
        nursery.cancel_scope.cancel()


async def test_local_updates_reach_the_target_with_ten_times_fewer_bytes():
    async with trio.open_nursery() as nursery:
        grad_nodes = await open_swarm(nursery, 3)
        with trio.fail_after(90):
            _, grad_statuses = await train_to_target(grad_nodes, make_trainer)
        grad_bytes = sum(node.host.traffic.bytes_sent for node in grad_nodes)
        assert max(s.accuracy for s in grad_statuses.values()) >= 0.9

        local_nodes = await open_swarm(nursery, 3)
        with trio.fail_after(90):
            local_trainers, local_statuses = await train_to_target(
                local_nodes, make_local_updates_trainer, max_epochs=30
            )
        local_bytes = sum(node.host.traffic.bytes_sent for node in local_nodes)
        assert max(s.accuracy for s in local_statuses.values()) >= 0.9
        assert any(t.optimizer.last_averaging and t.optimizer.last_averaging["averaged"] for t in local_trainers)
        assert local_bytes * 10 <= grad_bytes, (local_bytes, grad_bytes)
        nursery.cancel_scope.cancel()


def single_process_accuracy(batch_size: int, steps: int, *, orders: int = 1, last: int = 1) -> float:
    """Held-out accuracy of digits trained by one process, ``steps`` steps of ``batch_size``: the
    mean over the last ``last`` steps' models and over ``orders`` orders of the data (one run's
    accuracy is one draw: at 40 steps of 256 it spreads 0.930-0.944 over data orders)."""
    accuracies = []
    for order in range(orders):
        single = digits_task(shard=ShardSpec(0, 1, seed=order), batch_size=batch_size)
        optimizer = single.make_optimizer(list(single.model.parameters()))
        for step in range(1, steps + 1):
            loss = single.loss_fn(single.model, next(single.batches))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step > steps - last:
                accuracies.append(single.evaluate(single.model)["accuracy"])
    return sum(accuracies) / len(accuracies)


async def test_convergence_parity_with_one_process_at_the_same_batch_size():
    epochs = 40
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 4)
        with trio.fail_after(120):
            trainers, _ = await train_to_target(nodes, make_trainer, target=None, max_epochs=epochs)
        swarm_accuracy = max(t.task.evaluate(t.task.model)["accuracy"] for t in trainers)
        nursery.cancel_scope.cancel()

    single_accuracy = single_process_accuracy(trainers[0].task.target_batch_size, epochs)
    assert single_accuracy > 0.85  # both actually learned; parity of two untrained models proves nothing
    assert abs(swarm_accuracy - single_accuracy) <= 0.02, (swarm_accuracy, single_accuracy)


async def test_scheduler_steps_per_epoch_and_gradients_are_clipped():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        trainers = []
        for i, node in enumerate(nodes):
            task, _inner, optimizer = scheduled_sgd(
                node, ShardSpec(i, 2), prefix="digits-clip", target_group_size=2, clip_grad_norm=1e-3,
                average_state_every=0,
            )  # fmt: skip
            trainers.append(Trainer(task, optimizer))
        before = [torch.cat([p.detach().reshape(-1).clone() for p in t.task.model.parameters()]) for t in trainers]
        async with trio.open_nursery() as inner_nursery:
            for trainer in trainers:
                inner_nursery.start_soon(lambda t=trainer: t.run(max_epochs=4))
        for trainer, start in zip(trainers, before, strict=True):
            assert trainer.optimizer.epoch == 4
            assert trainer.optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)  # 1.0 * 0.5 ** (4 // 2)
            after = torch.cat([p.detach().reshape(-1) for p in trainer.task.model.parameters()])
            # each step moved the parameters by at most lr * clip norm: 1.0 + 1.0 + 0.5 + 0.5 times 1e-3
            assert 0 < (after - start).norm().item() <= 3e-3 + 1e-6
        nursery.cancel_scope.cancel()


async def test_a_peer_one_epoch_behind_counts_the_round_it_shares_and_state_averaging_meets():
    """Two peers: one stepped alone at epoch 0 while the other started, which then averaged every
    round with it but counted one epoch less; every ``average_state_every`` epochs they looked for
    each other in different averagers and both lost a matchmaking deadline."""
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        models = [torch.nn.Linear(4, 1) for _ in nodes]
        optimizers = [
            CollaborativeOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                node,
                prefix="skew",
                target_batch_size=64,
                average_state_every=2,
                **FAST,
            )
            for model, node in zip(models, nodes, strict=True)
        ]
        records = {0: [], 1: []}

        async def one_batch(i: int) -> bool:
            models[i](torch.randn(16, 4)).square().mean().backward()
            return await optimizers[i].step(16)

        for i in range(2):  # both have joined the swarm at epoch 0...
            assert not await one_batch(i)
        await optimizers[0].replica.move_to_epoch(1)  # ...and then one stepped alone, its epoch-0 round empty

        async def train(i: int) -> None:
            while optimizers[i].epoch < 6:
                if await one_batch(i):
                    records[i].append(optimizers[i].last_averaging)
                await trio.sleep(0.01)  # ~1600 samples/s: an epoch takes a few progress refreshes

        with trio.fail_after(30):
            async with trio.open_nursery() as peers:
                for i in range(2):
                    peers.start_soon(train, i)
        assert optimizers[0].epoch == optimizers[1].epoch == 6
        # After the first shared round, both count the same epochs and every round averages.
        assert all(r["averaged"] for r in records[1]), records
        assert all(r["averaged"] for r in records[0][1:]), records
        nursery.cancel_scope.cancel()


async def test_a_lone_peer_says_once_that_it_trains_alone(caplog):
    """The first peer of a swarm finds no group every epoch: one WARNING, not one per round."""
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        task = digits_task()
        optimizer = CollaborativeOptimizer(
            task.make_optimizer(list(task.model.parameters())),
            node,
            prefix="alone-test",
            target_batch_size=64,
            target_group_size=2,
            **{**FAST, "matchmaking_timeout": 0.3},
        )
        with caplog.at_level(logging.DEBUG, logger="peerd.training"):
            await Trainer(task, optimizer).run(max_epochs=4)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "no other peer to average with" in warnings[0], warnings
        assert sum("no other peer to average with at epoch" in r.getMessage() for r in caplog.records) >= 2
        nursery.cancel_scope.cancel()


async def test_the_training_thread_computes_subnormal_values_as_zeros():
    """Forward and backward passes run with subnormal floats flushed to zero, in whatever worker
    thread runs them: on x86 each operation on one takes ~100x longer, and local updates' outer
    steps drove textlm's activations among them (an int8 swarm's passes took 1.7x longer by its
    10th round)."""
    task = digits_task()
    seen: list[float] = []

    def loss_fn(model, batch):
        seen.append(float(torch.tensor([1e-39]) * 3.0))  # a subnormal times 3: still subnormal
        return task.loss_fn(model, batch)

    trainer = Trainer(dataclasses.replace(task, loss_fn=loss_fn), optimizer=None)
    await trainer.compute_slice()
    assert seen == [0.0]
