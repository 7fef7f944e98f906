"""The all-reduce's messages and per-stream rules (averaging/allreduce_protocol.py), driven with plain
values and bytes: no sockets, no event loop."""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest
import torch

from averaging.allreduce_protocol import (
    AllReduceError,
    AverageInbox,
    ReduceHeader,
    parse_contributors,
    part_body,
)
from averaging.compression import get_codec
from averaging.part_buffers import PartBuffers, PartSink
from averaging.reducer_shard import ReducerShard
from averaging.reduction import ContributionRejected
from peer import PeerID

A, B, C = (PeerID(os.urandom(20)) for _ in range(3))
RAW = {"codec": "none"}


def raw(values) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


def nan_at_first(payload: bytes) -> bytes:
    return struct.pack("<f", math.nan) + payload[4:]


@pytest.fixture
def pool() -> PartBuffers:
    buffers = PartBuffers()
    buffers.start_round()
    return buffers


def test_header_round_trips_and_malformed_headers_are_refused():
    header = ReduceHeader(b"g" * 16, 2.5, 312)
    assert ReduceHeader.parse(header.to_body()) == header
    for body in [None, [], {"group_id": "text", "total": 3}, {"group_id": b"g", "total": 3.0}, {"group_id": b"g"}]:
        with pytest.raises(ValueError, match="avg.reduce expects"):
            ReduceHeader.parse(body)


def test_contributor_lists_are_checked_against_the_group():
    assert parse_contributors([B.to_bytes(), A.to_bytes()], [A, B]) == [B, A]
    for raw in [None, b"ab", [], [A.to_bytes()] * 3]:
        with pytest.raises(AllReduceError, match="malformed contributor list"):
            parse_contributors(raw, [A, B])
    for raw, reason in [
        ([b"short"], "malformed contributor"),
        (["text"], "malformed contributor"),
        ([A.to_bytes(), A.to_bytes()], "twice"),
        ([C.to_bytes()], "not a sender of this group"),
    ]:
        with pytest.raises(AllReduceError, match=reason):
            parse_contributors(raw, [A, B])


def reducer(pool, part_sizes=(2, 1), senders=(A, B)):
    return ReducerShard(list(part_sizes), list(senders), None)


def feed(inbox, index, payload, meta=RAW):
    part = inbox.part(part_body(index, meta), payload)
    inbox.stage(part.index, inbox.decode(part))


def test_a_reducer_averages_whole_contributions_from_bytes(pool):
    shard = reducer(pool)
    with pool.lease() as lease:
        inboxes = {s: shard.inbox(s, PartSink(lease, shard.part_sizes)) for s in (A, B)}
        shard.set_weight(A, 1.0)
        shard.set_weight(B, 3.0)
        feed(inboxes[A], 1, raw([5.0]))  # parts may come in any order
        feed(inboxes[A], 0, raw([1.0, 2.0]))
        fp16_meta, fp16_payload = get_codec("float16").encode(torch.tensor([3.0, 6.0]))
        feed(inboxes[B], 0, bytes(fp16_payload), fp16_meta)  # each part names its own codec
        feed(inboxes[B], 1, raw([1.0]))
        for inbox in inboxes.values():
            inbox.finish()
        outcome = shard.close("late", get_codec("none"))
    assert outcome.contributors == [A, B] and outcome.part_contributors == [[A, B], [A, B]]
    assert torch.equal(outcome.averaged, torch.tensor([(1 + 9) / 4, (2 + 18) / 4, (5 + 3) / 4]))


@pytest.mark.parametrize(
    ("index", "meta", "payload", "reason"),
    [
        (2, RAW, raw([1.0]), "out of range"),
        (-1, RAW, raw([1.0]), "out of range"),
        (0, {"codec": "gzip"}, raw([1.0, 2.0]), "unknown codec"),
        (0, "none", raw([1.0, 2.0]), "meta must be a map"),
        (0, RAW, raw([1.0, 2.0])[:-4], "expected exactly 8"),  # truncated payload
        (0, RAW, raw([1.0, 2.0, 3.0]), "expected exactly 8"),
        (0, RAW, nan_at_first(raw([1.0, 2.0])), "NaN or infinite"),
        (0, RAW, None, "no payload"),
    ],
)
def test_a_reducer_rejects_a_bad_part_with_its_reason(pool, index, meta, payload, reason):
    shard = reducer(pool)
    shard.set_weight(A, 1.0)
    with pool.lease() as lease:
        inbox = shard.inbox(A, PartSink(lease, shard.part_sizes))
        with pytest.raises(ContributionRejected, match=reason):
            feed(inbox, index, payload, meta)


def test_a_part_body_without_an_index_is_rejected(pool):
    shard = reducer(pool)
    with pool.lease() as lease:
        inbox = shard.inbox(A, PartSink(lease, shard.part_sizes))
        for body in [None, {"meta": RAW}, {"part": "0", "meta": RAW}, {"part": True, "meta": RAW}]:
            with pytest.raises(ContributionRejected, match="each part needs"):
                inbox.part(body, raw([1.0, 2.0]))


def test_a_duplicated_part_is_rejected_and_an_incomplete_sender_dropped(pool):
    shard = reducer(pool)
    shard.set_weight(A, 1.0)
    with pool.lease() as lease:
        inbox = shard.inbox(A, PartSink(lease, shard.part_sizes))
        feed(inbox, 0, raw([1.0, 2.0]))
        with pytest.raises(ContributionRejected, match="sent twice"):
            feed(inbox, 0, raw([1.0, 2.0]))
        inbox.finish()  # part 1 never came
    assert "1 parts missing" in shard.reduction.dropped[A]


def test_raw_parts_land_in_leased_buffers_and_are_used_without_a_copy(pool):
    shard = reducer(pool, part_sizes=(3,), senders=(A,))
    shard.set_weight(A, 1.0)
    with pool.lease() as lease:
        sink = PartSink(lease)  # the sizes are not known yet when the first parts arrive
        body = part_body(0, RAW)
        buffer = sink.provide(body, 12)
        assert buffer is not None and sink.provide({"part": 1, "meta": {"codec": "float16"}}, 12) is None
        buffer[:] = raw([1.0, 2.0, 3.0])  # what the connection's reader does: decrypt into it
        sink.part_sizes = shard.part_sizes
        inbox = shard.inbox(A, sink)
        part = inbox.part(body, buffer)
        assert part.landed
        values = inbox.decode(part)
        assert values.data_ptr() == part.out.data_ptr()
        assert torch.equal(values, torch.tensor([1.0, 2.0, 3.0]))


def test_a_sink_checks_sizes_and_forfeits_what_never_arrived(pool):
    with pool.lease() as lease:
        sink = PartSink(lease, [3, 2])
        assert sink.provide(part_body(0, RAW), 8) is None  # not part 0's size
        assert sink.provide(part_body(2, RAW), 8) is None  # no such part
        assert sink.provide(part_body(0, RAW), 12) is not None
        assert sink.provide(part_body(0, RAW), 12) is None  # already lent
        lent_to_a_dead_stream = sink.provide(part_body(1, RAW), 8)
        sink.close()
        assert sink.provide(part_body(1, RAW), 8) is None  # a closed sink lends nothing
    assert pool.pooled_bytes == 0  # lent, never claimed: the reader may still write into them
    with pool.lease() as lease:
        assert lease.take(2).data_ptr() != np.frombuffer(lent_to_a_dead_stream, np.uint8).ctypes.data


def sender_inbox(lease, ranges=((10, 12), (12, 13)), senders=(A, B)):
    return AverageInbox(list(ranges), PartSink(lease, [end - start for start, end in ranges]), list(senders))


def reply(index, contributors=None, meta=RAW, **extra):
    body = {**part_body(index, meta), **extra}
    if contributors is not None:
        body["contributors"] = [p.to_bytes() for p in contributors]
    return body


def take(inbox, body, payload):
    inbox.accept(inbox.decode(inbox.part(body, payload)))


def test_a_sender_takes_a_whole_average_in_order_with_contributors_per_part(pool):
    with pool.lease() as lease:
        inbox = sender_inbox(lease)
        take(inbox, reply(0, [A, B]), raw([1.0, 2.0]))
        assert not inbox.all_in
        with pytest.raises(AllReduceError, match="1 of 2 parts"):
            inbox.averaged()  # a half-received shard never counts
        take(inbox, reply(1, [A], all_in=True), raw([3.0]))  # B was dropped after part 0
        assert inbox.complete and inbox.all_in
        pieces = inbox.averaged()
    assert inbox.part_contributors == [[A, B], [A]] and inbox.contributors == [A]
    assert [start for start, _ in pieces] == [10, 12]
    assert torch.equal(torch.cat([values for _, values in pieces]), torch.tensor([1.0, 2.0, 3.0]))


def test_contributors_carry_over_until_they_change(pool):
    with pool.lease() as lease:
        inbox = sender_inbox(lease, ranges=((0, 1), (1, 2), (2, 3)))
        take(inbox, reply(0, [B, A]), raw([1.0]))
        take(inbox, reply(1), raw([2.0]))
        take(inbox, reply(2, [B]), raw([3.0]))
    assert inbox.part_contributors == [[B, A], [B, A], [B]] and inbox.contributors == [B]


@pytest.mark.parametrize(
    ("replies", "error", "reason"),
    [
        ([(reply(1, [A]), raw([3.0]))], AllReduceError, "out of order"),
        ([(reply(0, [A]), raw([1.0, 2.0])), (reply(0, [A]), raw([1.0, 2.0]))], AllReduceError, "out of order"),
        ([(reply(0), raw([1.0, 2.0]))], AllReduceError, "before naming its contributors"),
        ([(reply(0, [C]), raw([1.0, 2.0]))], AllReduceError, "not a sender of this group"),
        ([(reply(0, [A, A]), raw([1.0, 2.0]))], AllReduceError, "twice"),
        ([(reply(0, [A]), raw([1.0, 2.0])), (reply(1, [A, B]), raw([3.0]))], AllReduceError, "it had dropped"),
        ([(reply(0, []), raw([1.0, 2.0]))], AllReduceError, "malformed contributor list"),
        ([({"part": "0", "contributors": [A.to_bytes()]}, raw([1.0, 2.0]))], AllReduceError, "out of order"),
        ([(reply(0, [A]), nan_at_first(raw([1.0, 2.0])))], AllReduceError, "NaN or infinite"),
        ([(reply(0, [A]), raw([1.0]))], ValueError, "expected exactly 8"),  # truncated
        ([(reply(0, [A], meta={"codec": "gzip"}), raw([1.0, 2.0]))], ValueError, "unknown codec"),
        (
            [(reply(0, [A]), raw([1.0, 2.0])), (reply(1), raw([3.0])), (reply(2), raw([4.0]))],
            AllReduceError,
            "more parts than the shard has",
        ),
    ],
)
def test_a_sender_refuses_a_reducer_that_breaks_the_protocol_for_good(pool, replies, error, reason):
    with pool.lease() as lease:
        inbox = sender_inbox(lease)
        with pytest.raises(error, match=reason):
            for body, payload in replies:
                take(inbox, body, payload)
        with pytest.raises(error, match=reason):  # sticky: nothing half-works afterwards
            take(inbox, reply(len(inbox.part_contributors), [A]), raw([1.0] * (2 - len(inbox.part_contributors))))
        assert not inbox.complete or reason == "more parts than the shard has"
