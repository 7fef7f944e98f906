"""A reducer's side of one round, sans I/O (``averaging/reducer_shard.py``): replies part by part,
each encoded once, our own average as the senders decode it, and no reply after one that cannot
be made; in a checked round, only senders whose commitment names this shard's parts."""

from __future__ import annotations

import os

import pytest
import torch

from averaging.allreduce_protocol import ReduceHeader, part_body
from averaging.compression import get_codec
from averaging.part_buffers import PartBuffers, PartSink
from averaging.reducer_shard import ReducerShard, ShardPhase, ShardSigning
from averaging.reduction import ContributionRejected
from averaging.robust import Aggregation
from averaging.round_roles import INLINE_WORK_LIMIT
from peer import PeerID

A, B = (PeerID(os.urandom(20)) for _ in range(2))
RAW = {"codec": "none"}


def raw(values) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


@pytest.fixture
def pool() -> PartBuffers:
    buffers = PartBuffers()
    buffers.start_round()
    return buffers


def reducer(pool, part_sizes=(2, 1), senders=(A, B), signing=None, aggregation=Aggregation.MEAN):
    return ReducerShard(list(part_sizes), list(senders), None, aggregation, signing=signing)


def test_a_reducer_replies_with_its_average_encoded_once(pool):
    shard = reducer(pool, part_sizes=(2, 2), senders=(A,))
    shard.add_local(A, torch.tensor([1.0, 2.0, 3.0, 4.0]), 1.0)
    shard.close("late", get_codec("none"))
    assert shard.error is None
    contributors = {"contributors": [A.to_bytes()]}
    assert [body for body, _payload in shard.replies] == [
        {**part_body(0, RAW), "all_in": True, **contributors},
        {**part_body(1, RAW), "all_in": True},  # the same contributors: not named again
    ]
    assert bytes(shard.replies[1][1]) == raw([3.0, 4.0])
    own = shard.own_average(get_codec("none"))
    assert torch.equal(own, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_with_a_lossy_codec_the_reducer_keeps_what_the_senders_decode(pool):
    shard = reducer(pool, part_sizes=(3,), senders=(A,))
    shard.add_local(A, torch.tensor([0.1, 0.2, 0.3]), 1.0)
    codec = get_codec("float16")
    shard.close("late", codec)
    body, payload = shard.replies[0]
    assert torch.equal(shard.own_average(codec), codec.decode(body["meta"], payload, 3))


def test_an_average_that_overflows_is_not_sent(pool):
    shard = reducer(pool, part_sizes=(1, 1), senders=(A, B))
    shard.add_local(A, torch.tensor([1.0, 3e38]), 1.0)
    shard.add_local(B, torch.tensor([1.0, 3e38]), 1.0)  # the weighted sum overflows to inf
    shard.close("late", get_codec("none"))
    assert len(shard.replies) == 1 and "NaN or infinite" in str(shard.error)  # no more replies after


def test_a_reducer_that_got_nothing_says_so(pool):
    shard = reducer(pool, senders=(A, B))
    outcome = shard.close("did not finish sending before the sender deadline", get_codec("none"))
    assert outcome.averaged is None and shard.replies == [] and "no contribution" in str(shard.error)
    assert set(outcome.dropped) == {A, B}


def test_the_shard_goes_from_replying_to_replied_or_failed(pool):
    shard = reducer(pool, part_sizes=(2,), senders=(A,))
    assert shard.phase is ShardPhase.REPLYING and not shard.finished
    shard.add_local(A, torch.tensor([1.0, 2.0]), 1.0)
    shard.close("late", get_codec("none"))
    assert shard.phase is ShardPhase.REPLIED and shard.finished
    failed = reducer(pool, senders=(A, B))
    failed.close("late", get_codec("none"))
    assert failed.phase is ShardPhase.FAILED and failed.finished


def test_a_checked_round_refuses_a_sender_without_a_commitment_and_keeps_its_inputs(pool):
    clip = Aggregation.CENTERED_CLIP  # (the aggregation the checks recompute)
    shard = reducer(pool, part_sizes=(2,), senders=(A, B), signing=ShardSigning(b"g" * 16, A), aggregation=clip)
    with pool.lease() as lease, pytest.raises(ContributionRejected, match="needs the sender's commitment"):
        shard.inbox(B, PartSink(lease, shard.part_sizes), ReduceHeader(b"g" * 16, 1.0, 2))
    plain = reducer(pool, part_sizes=(2,), senders=(A, B), aggregation=clip)
    with pool.lease() as lease:
        assert plain.inbox(B, PartSink(lease, plain.part_sizes), ReduceHeader(b"g" * 16, 1.0, 2)).signing is None
    # only a checked round's reduction keeps what it aggregated, for the senders' checks
    for keeping, kept in ((shard, True), (plain, False)):
        keeping.add_local(A, torch.tensor([1.0, 2.0]), 1.0)
        keeping.drop(B, "gone")
        keeping.close("late", get_codec("none"))
        assert (keeping.inputs_of(0) is not None) == kept


def test_a_robust_part_counts_as_the_work_it_is_and_leaves_the_event_loop():
    """CenteredClip passes over a part many times where the mean passes once: four senders' parts
    of 16K values (the lab's parts over 100 Mbit/s links) are cheap enough to average on the event
    loop, not to clip, which blocked the loop for up to 0.6 s a round there."""
    senders = [PeerID(os.urandom(20)) for _ in range(4)]
    parts = [1 << 14] * 4
    mean = ReducerShard(parts, senders, None, Aggregation.MEAN)
    clipped = ReducerShard(parts, senders, None, Aggregation.CENTERED_CLIP)
    assert mean.work_per_part <= INLINE_WORK_LIMIT < clipped.work_per_part
