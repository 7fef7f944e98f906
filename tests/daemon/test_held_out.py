"""What a peer scores contributions against (``peerd/held_out.py``, ``--score-contributions``):
the gradient of the task's held-out loss at the values asked for, never at the live parameters,
and how each optimizer hands it to its averagers (the shared start's for local updates, by
fragment; the parameters' for collaborative training)."""

from __future__ import annotations

import signal

import pytest
import torch
import trio

from averaging.local_updates import LocalUpdatesOptimizer
from averaging.optimizer import CollaborativeOptimizer
from peerd.held_out import held_out_gradient
from peerd.tasks import digits_task, textlm_task
from tests.daemon.test_machine_peer import start_peer
from tests.daemon.test_training import open_swarm
from tests.support.processes import status_of, wait_until


def test_the_gradient_is_taken_at_the_values_given_on_a_copy_of_the_model():
    task = digits_task()
    live = [p.detach().clone() for p in task.model.parameters()]
    gradient = held_out_gradient(task)
    assert gradient is not None
    elsewhere = [torch.randn_like(p) for p in live]
    found = gradient(elsewhere)
    assert [g.shape for g in found] == [p.shape for p in live]
    for param, before in zip(task.model.parameters(), live, strict=True):
        assert torch.equal(param, before) and param.grad is None  # the live model untouched
    # the same as the task's loss of a model holding those values, on a held-out batch of its own
    copy = digits_task()
    with torch.no_grad():
        for param, value in zip(copy.model.parameters(), elsewhere, strict=True):
            param.copy_(value)
    assert copy.validation_batches is not None
    loss = copy.loss_fn(copy.model, next(copy.validation_batches))
    expected = torch.autograd.grad(loss, list(copy.model.parameters()))
    for got, want in zip(found, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_a_task_without_held_out_batches_scores_nothing_and_a_wrong_model_is_refused():
    task = digits_task()
    task.validation_batches = None
    assert held_out_gradient(task) is None
    gradient = held_out_gradient(digits_task())
    with pytest.raises(ValueError, match="1 values for a model of 4 parameters"):
        gradient([torch.zeros(3)])


def test_the_built_in_tasks_hold_out_batches():
    assert next(digits_task().validation_batches)[0].shape[0] > 0
    assert next(textlm_task(model_size="tiny").validation_batches)[0].shape[0] > 0


async def test_local_updates_score_each_fragment_at_the_shared_start():
    asked = []

    def held_out(values):
        asked.append([v.clone() for v in values])
        return [torch.full_like(v, float(i)) for i, v in enumerate(values)]

    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        optimizer = LocalUpdatesOptimizer(
            torch.optim.SGD(params, lr=0.1), node, prefix="scored", local_steps=2, fragments=2, held_out=held_out
        )
        with torch.no_grad():
            for param in params:
                param.add_(5.0)  # training moved the parameters; the start stays where it was
        for fragment in optimizer.fragments:
            group = [next(i for i, p in enumerate(params) if p is mine) for mine in fragment.step.params]
            reference = fragment.averager.reference()
            assert [r.shape for r in reference] == [t.shape for t in fragment.step.deltas]
            assert [float(r[0]) for r in reference] == [float(i) for i in group]
        assert all(torch.equal(v, torch.ones_like(v)) for v in asked[0])  # the start, not the live values
        nursery.cancel_scope.cancel()


async def test_collaborative_training_scores_at_the_parameters():
    async with trio.open_nursery() as nursery:
        [node] = await open_swarm(nursery, 1)
        params = [torch.nn.Parameter(torch.arange(3.0))]
        optimizer = CollaborativeOptimizer(
            torch.optim.SGD(params, lr=0.1),
            node,
            prefix="scored",
            target_batch_size=4,
            held_out=lambda values: [2 * v.detach() for v in values],
        )
        [reference] = optimizer.grad_averager.reference()
        assert torch.equal(reference, 2 * torch.arange(3.0))
        nursery.cancel_scope.cancel()


def test_two_peers_that_score_contributions_average_and_ban_nobody(tmp_path):
    """``peerd join --score-contributions`` as a user runs it: two honest digits peers score each
    other's gradients in their rounds, keep averaging, and neither bans the other."""
    first, port = start_peer(tmp_path, "a", "0/2", None, "--score-contributions")
    second = None
    try:
        second, _ = start_peer(tmp_path, "b", "1/2", status_of(port)["address"], "--score-contributions")
        for peer in (first, second):
            peer.wait_for_log("scoring contributions against task digits's held-out batches", timeout=30)
        # rounds in which each scored the other's contribution to the shard it reduced
        rounds = [lambda peer=peer: peer.log().count("round done with 2 peers") >= 3 for peer in (first, second)]
        wait_until(lambda: all(done() for done in rounds), timeout=90, what="three rounds of two peers each")
        assert "banned" not in first.log() + second.log()
        assert "not scored" not in first.log() + second.log()
    finally:
        for peer in (second, first):
            if peer is not None:
                peer.stop(signal.SIGTERM)
