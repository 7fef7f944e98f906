"""Error feedback: the residual is exactly what the round's encoding dropped from our contribution,
and carrying it makes the transmitted sum track the intended sum where plain rounding loses it."""

import torch

from averaging.allreduce import AllReduceResult
from averaging.compression import get_codec
from averaging.error_feedback import ErrorFeedback
from averaging.partition import AllReducePlan
from peer import PeerID

CODEC = get_codec("blockwise_8bit")


def round_result(plan, my_shard, local_shards=(), contributors=None, part_contributors=None):
    """What a finished round reports (the group itself plays no part in the residual)."""
    return AllReduceResult(
        group=None,
        plan=plan,
        my_shard=my_shard,
        local_shards=dict.fromkeys(local_shards, "x"),
        contributors=contributors or {},
        part_contributors=part_contributors or {},
    )


def transmitted(values: torch.Tensor, plan: AllReducePlan, my_shard: int) -> torch.Tensor:
    """What the other peers receive of ``values``: every part of a remote shard encoded."""
    out = values.clone()
    for index in range(plan.num_shards):
        if index != my_shard:
            for start, end in plan.parts(index):
                out[start:end] = CODEC.decode(*CODEC.encode(values[start:end]), end - start)
    return out


def test_residual_is_what_encoding_dropped_from_remote_shards_only():
    torch.manual_seed(0)
    tensors = [torch.randn(3000), torch.randn(50, 40)]
    plan = AllReducePlan.build(5000, [1.0, 1.0, 1.0], part_size=700)  # blocks fall per part
    feedback = ErrorFeedback(tensors, CODEC)
    feedback.add_residual(tensors)  # nothing owed yet
    sent = torch.cat([t.reshape(-1) for t in tensors])
    feedback.settle(round_result(plan, my_shard=1, local_shards=[2]))
    start0, end0 = plan.shard_bounds(0)
    expected = sent[start0:end0] - transmitted(sent, plan, 1)[start0:end0]
    assert torch.equal(feedback.residual[start0:end0], expected)
    assert expected.abs().max() > 0  # int8 did drop something
    assert not feedback.residual[end0:].any(), "our own shard and the failed reducer's were never encoded"


def test_a_failed_round_owes_nothing_and_the_residual_goes_into_the_next_contribution():
    tensors = [torch.linspace(-1, 1, 4096)]
    plan = AllReducePlan.build(4096, [1.0, 1.0], part_size=4096)
    feedback = ErrorFeedback(tensors, CODEC)
    feedback.add_residual(tensors)
    feedback.settle(round_result(plan, my_shard=1))
    owed = feedback.residual.clone()
    assert owed.any()
    nxt = [torch.zeros(4096)]
    feedback.add_residual(nxt)
    assert torch.equal(nxt[0], owed)
    feedback.settle(None)  # the round failed: our values were applied exactly as they were
    assert not feedback.residual.any()


def test_carried_residual_keeps_the_transmitted_sum_on_track_where_rounding_loses_it():
    # One big value per block sets the scale; the others are far below one quantisation step
    # (absmax / 127), so plain int8 rounds them to zero every round: a bias that never averages out.
    size = 2048
    delta = torch.full((size,), 0.002)
    delta[0] = 1.0
    plan = AllReducePlan.build(size, [1.0, 1.0], part_size=size)  # shard 0 is remote, one block
    half = plan.shard_sizes[0]
    rounds = 200
    feedback = ErrorFeedback([delta], CODEC)
    with_feedback = torch.zeros(size)
    without = torch.zeros(size)
    for _ in range(rounds):
        contribution = [delta.clone()]
        feedback.add_residual(contribution)
        with_feedback += transmitted(contribution[0], plan, my_shard=1)
        feedback.settle(round_result(plan, my_shard=1))
        without += transmitted(delta, plan, my_shard=1)
    intended = delta * rounds
    step = 1.0 / 127
    assert (without[1:half] - intended[1:half]).abs().max() > 0.3, "plain rounding drops the small values"
    assert (with_feedback[:half] - intended[:half]).abs().max() <= step, "feedback loses at most one step"


def test_a_shard_whose_reducer_dropped_us_owes_our_whole_contribution():
    me, other = PeerID(b"\x01" * 20), PeerID(b"\x02" * 20)
    tensors = [torch.linspace(-1, 1, 3000)]
    plan = AllReducePlan.build(3000, [1.0, 1.0, 1.0], part_size=512)
    feedback = ErrorFeedback(tensors, CODEC, me)
    feedback.add_residual(tensors)
    # shard 0 averaged without us; shard 2 with us (only rounding is owed there)
    feedback.settle(round_result(plan, my_shard=1, contributors={0: [other], 2: [me, other]}))
    start0, end0 = plan.shard_bounds(0)
    assert torch.equal(feedback.residual[start0:end0], tensors[0][start0:end0])
    start2, end2 = plan.shard_bounds(2)
    assert 0 < feedback.residual[start2:end2].abs().max() <= 1 / 127


def test_parts_averaged_after_a_reducer_dropped_us_owe_their_whole_slice():
    me, other = PeerID(b"\x01" * 20), PeerID(b"\x02" * 20)
    tensors = [torch.linspace(-1, 1, 2048)]
    plan = AllReducePlan.build(2048, [1.0, 1.0], part_size=256)  # shard 0: 4 parts
    parts = plan.parts(0)
    feedback = ErrorFeedback(tensors, CODEC, me)
    feedback.add_residual(tensors)
    # we were in parts 0-1 of shard 0, then dropped: parts 2-3 were averaged without us
    per_part = [[me, other], [me, other], [other], [other]]
    feedback.settle(round_result(plan, my_shard=1, contributors={0: [other]}, part_contributors={0: per_part}))
    for (start, end), holders in zip(parts, per_part, strict=True):
        owed = feedback.residual[start:end]
        if me in holders:
            assert 0 < owed.abs().max() <= 1 / 127  # only rounding
        else:
            assert torch.equal(owed, tensors[0][start:end])  # all of it
