"""The all-reduce plan and a reducer's bookkeeping, without sockets."""

import math

import pytest
import torch

from averaging.compression import get_codec
from averaging.link_speed import UNMEASURED_BANDWIDTH
from averaging.partition import (
    DEFAULT_PART_SIZE,
    MIN_PART_BYTES,
    MIN_PARTS_PER_SHARD,
    MIN_SLOW_PART_BYTES,
    PART_SECONDS,
    SLOW_PARTS_PER_SHARD,
    AllReducePlan,
    bytes_per_value,
    split_by_bandwidth,
)
from averaging.reduction import ContributionRejected, ShardReduction


def test_shards_are_proportional_to_bandwidth_and_cover_everything():
    assert split_by_bandwidth(10, [1, 1]) == [5, 5]
    assert split_by_bandwidth(100, [3, 1]) == [75, 25]
    assert split_by_bandwidth(7, [1, 0, 1]) == [4, 0, 3] or split_by_bandwidth(7, [1, 0, 1]) == [3, 0, 4]
    for total in (0, 1, 17, 12345):
        sizes = split_by_bandwidth(total, [0.5, 2.0, 1.0, 1.5])
        assert sum(sizes) == total
    with pytest.raises(ValueError):
        split_by_bandwidth(10, [0, 0])


def test_parts_tile_each_shard():
    plan = AllReducePlan.build(1000, [1, 2, 1], part_size=64)
    covered = []
    for shard in range(plan.num_shards):
        parts = plan.parts(shard)
        assert len(parts) == plan.num_parts(shard)
        assert all(end - start <= 64 for start, end in parts)
        covered.extend(parts)
    flat = [i for start, end in covered for i in range(start, end)]
    assert flat == list(range(1000))


def test_parts_shrink_until_every_shard_streams_in_several():
    """Answers flow back part by part: 16 MiB among 4 peers goes in 8 parts per shard, not 2,
    while large shards keep the full part size and parts never get tiny."""
    wan = AllReducePlan.build(1 << 22, [1, 1, 1, 1])
    assert wan.part_size == 1 << 17 and wan.num_parts(0) == MIN_PARTS_PER_SHARD
    assert AllReducePlan.build(1 << 24, [1, 1, 1, 1]).part_size == DEFAULT_PART_SIZE
    assert AllReducePlan.build(1 << 24, [1, 1, 1, 1], part_size=1000).part_size == 1000  # a caller's smaller size
    small = AllReducePlan.build(10_000, [1, 1])
    assert small.part_size == MIN_PART_BYTES // 4 and small.num_parts(0) == 1


def test_over_slow_links_parts_shrink_further_and_on_fast_or_unmeasured_ones_they_do_not():
    """64 parts per shard where a part still takes PART_SECONDS at the group's median claim (the
    lab's 100 Mbit/s), the usual 8 where a message's own costs would count (loopback) or where no
    claim says anything of the links yet (newcomers declare the floor rate); one liar's claim does
    not move it."""
    lab = AllReducePlan.build(1 << 22, [12.5e6] * 4)
    assert lab.part_size == MIN_SLOW_PART_BYTES // 4 and lab.num_parts(0) == SLOW_PARTS_PER_SHARD
    assert AllReducePlan.build(1 << 22, [1e9] * 4).part_size == 1 << 17  # ~1 GB/s: 8 parts
    assert AllReducePlan.build(1 << 22, [UNMEASURED_BANDWIDTH] * 4).part_size == 1 << 17
    liar = AllReducePlan.build(1 << 22, [12.5e6] * 3 + [1e12])  # its shard is bounded to twice the others'
    assert liar.num_parts(3) == SLOW_PARTS_PER_SHARD and liar.num_parts(0) == SLOW_PARTS_PER_SHARD // 2
    fast = AllReducePlan.build(1 << 22, [1e9] * 3 + [1.0])  # one liar claiming next to nothing
    assert fast.num_parts(0) == MIN_PARTS_PER_SHARD
    # a part taking PART_SECONDS at a link between the two: between the bounds
    between = AllReducePlan.build(1 << 22, [100e6] * 4).part_size
    assert between == math.ceil(100e6 * PART_SECONDS / 4) and MIN_SLOW_PART_BYTES // 4 < between < 1 << 17
    assert AllReducePlan.build(9610, [12.5e6] * 8).num_parts(0) == 1  # a small model: one part
    # every sender's commitment names every part of every shard: larger groups cut shards in fewer
    assert AllReducePlan.build(1 << 24, [12.5e6] * 16).num_parts(0) == SLOW_PARTS_PER_SHARD // 4
    assert AllReducePlan.build(1 << 26, [12.5e6] * 64).num_parts(0) == MIN_PARTS_PER_SHARD


@pytest.mark.parametrize(("codec", "parts"), [("none", 29), ("blockwise_8bit", 8), ("topk_2bit", 1)])
def test_parts_weigh_their_bytes_in_the_rounds_codec(codec, parts):
    """The floors are bytes on the wire: textlm small's deltas among 4 peers on 10 Mbit/s links
    went in 29 parts per shard whatever the codec, each part's fixed costs paid for 64 KiB of
    float32 that int8 and sparse rounds do not send (0.23 and 0.50 CPU-s a round and peer,
    against 0.11 and 0.15 in parts of 64K values)."""
    value_bytes = bytes_per_value(get_codec(codec).payload_size)
    plan = AllReducePlan.build(1_853_568, [1.25e6] * 4, value_bytes=value_bytes)
    assert plan.num_parts(0) == parts
    size = get_codec(codec).payload_size
    assert size(plan.part_size) >= 0.99 * min(MIN_SLOW_PART_BYTES, size(plan.shard_sizes[0]))
    with pytest.raises(ValueError):
        AllReducePlan.build(1000, [1.0], value_bytes=0.0)


def test_no_part_is_a_sliver_so_centered_clip_over_a_clean_group_is_its_mean():
    """A shard a few values past a whole number of parts: its parts are balanced, none under
    half a part, and CenteredClip over four honest contributions gives their mean on every part
    (a last part of 3 values took it up to ~0.7 from their mean)."""
    from averaging.robust import centered_clip

    plan = AllReducePlan(total=2 * 16_387, shard_sizes=(16_387, 16_387), part_size=4096)
    parts = plan.parts(1)
    assert len(parts) == plan.num_parts(1) == 5
    assert parts[0][0] == 16_387 and parts[-1][1] == 2 * 16_387
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))  # contiguous
    assert max(end - start for start, end in parts) - min(end - start for start, end in parts) <= 1
    assert all(end - start <= plan.part_size for start, end in parts)
    contributions = [torch.randn(plan.total, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for start, end in parts:
        rows = [c[start:end] for c in contributions]
        out = torch.empty(end - start)
        centered_clip(rows, [1.0] * 4, out, center=rows[0])
        assert torch.allclose(out, sum(rows) / 4, atol=1e-5), (start, end)


def reduction_with(part_sizes, senders=("a", "b", "c")):
    return ShardReduction(list(part_sizes), list(senders))


def feed(reduction, sender, values, weight, part_sizes):
    reduction.set_weight(sender, weight)
    offset = 0
    for index, size in enumerate(part_sizes):
        reduction.add_part(sender, index, values[offset : offset + size])
        offset += size
    reduction.finish_sender(sender)


def test_a_stream_end_after_the_shard_was_averaged_is_not_refused():
    """Every part of every sender arrived, so the shard was averaged before one sender's stream
    end came: that end was refused ("this shard is already averaged", a warning in rounds that
    succeeded); a contribution after the outcome still is."""
    sizes = [2, 2]
    reduction = reduction_with(sizes, senders=("a", "b"))
    feed(reduction, "a", torch.ones(4), 1.0, sizes)
    reduction.set_weight("b", 1.0)
    for index, size in enumerate(sizes):
        reduction.add_part("b", index, torch.zeros(size))
    outcome = reduction.outcome()
    assert set(outcome.contributors) == {"a", "b"}
    reduction.finish_sender("b")  # its stream's end, late
    with pytest.raises(ContributionRejected):
        reduction.add_part("b", 0, torch.zeros(2))


def test_weighted_average_of_whole_contributions():
    sizes = [3, 3, 2]
    reduction = reduction_with(sizes)
    data = {s: torch.randn(8) for s in "abc"}
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    for s in "abc":
        feed(reduction, s, data[s], weights[s], sizes)
    outcome = reduction.outcome()
    expected = sum(data[s] * weights[s] for s in "abc") / sum(weights.values())
    assert torch.allclose(outcome.averaged, expected, atol=1e-6)
    assert sorted(outcome.contributors) == ["a", "b", "c"] and reduction.done


def test_sender_dropped_half_way_contributes_nothing():
    sizes = [4, 4]
    reduction = reduction_with(sizes)
    a, b, c = torch.randn(8), torch.randn(8), torch.randn(8)
    feed(reduction, "a", a, 1.0, sizes)
    reduction.set_weight("b", 1.0)
    reduction.add_part("b", 0, b[:4])  # then b dies
    reduction.add_local("c", c, 1.0)
    assert reduction.pending == ["b"]
    reduction.drop_pending("sender timed out")
    outcome = reduction.outcome()
    assert torch.allclose(outcome.averaged, (a + c) / 2, atol=1e-6)
    assert outcome.dropped == {"b": "sender timed out"}


def test_finishing_with_missing_parts_drops_the_sender():
    reduction = reduction_with([2, 2], senders=["a"])
    reduction.set_weight("a", 1.0)
    reduction.add_part("a", 1, torch.ones(2))
    reduction.finish_sender("a")
    assert "1 parts missing" in reduction.dropped["a"]
    assert reduction.outcome().averaged is None


@pytest.mark.parametrize(
    "bad",
    [
        lambda r: r.add_part("a", 0, torch.tensor([float("nan"), 1.0])),
        lambda r: r.add_part("a", 0, torch.ones(3)),
        lambda r: r.add_part("a", 0, torch.ones(2, dtype=torch.float64)),
        lambda r: r.add_part("a", 5, torch.ones(2)),
        lambda r: r.add_part("zed", 0, torch.ones(2)),
    ],
)
def test_bad_parts_are_rejected(bad):
    reduction = reduction_with([2, 2], senders=["a"])
    reduction.set_weight("a", 1.0)
    with pytest.raises(ContributionRejected):
        bad(reduction)


def test_bad_weights_and_duplicates_are_rejected():
    reduction = reduction_with([2], senders=["a"])
    for weight in (float("inf"), float("nan"), -1.0, 1e30):
        with pytest.raises(ContributionRejected):
            reduction.set_weight("a", weight)
    reduction.set_weight("a", 1.0)
    reduction.add_part("a", 0, torch.ones(2))
    with pytest.raises(ContributionRejected, match="twice"):
        reduction.add_part("a", 0, torch.ones(2))


def test_part_buffers_reuse_buffers_and_forget_sizes_no_recent_round_took():
    from averaging.part_buffers import PartBuffers

    pool = PartBuffers()
    pool.start_round()
    with pool.lease() as lease:
        first = lease.take(10)
    with pool.lease() as lease:
        assert lease.take(10) is first  # given back when the lease closed, and reused
    for size in (11, 12, 13):  # shard sizes follow the group, which may change every round
        pool.start_round()
        with pool.lease() as lease:
            for _ in range(3):
                lease.take(size)
    assert pool.pooled_bytes == 4 * 3 * (12 + 13)  # only this round's and the last round's sizes


def test_a_lease_stays_open_while_any_holder_is_inside_and_forfeited_buffers_never_return():
    from averaging.part_buffers import PartBuffers

    pool = PartBuffers()
    pool.start_round()
    lease = pool.lease()
    with lease:
        kept, lost = lease.take(4), lease.take(4)
        with lease:  # a second holder (a reducer handler still replying from the shard)
            pass
        assert pool.pooled_bytes == 0  # the first holder is still inside
        lease.forfeit(lost)  # e.g. still queued on a connection
    assert pool.pooled_bytes == 16
    with pool.lease() as again:
        assert again.take(4) is kept
        assert again.take(4) is not lost
    with pytest.raises(RuntimeError, match="closed"):
        lease.take(4)


def test_a_part_is_averaged_once_every_live_sender_delivered_it():
    sizes = [2, 2, 2]
    reduction = reduction_with(sizes, senders=["a", "b"])
    a, b = torch.arange(6.0), 10 + torch.arange(6.0)
    reduction.set_weight("a", 1.0)
    reduction.set_weight("b", 3.0)
    for index in range(3):
        reduction.add_part("a", index, a[2 * index : 2 * index + 2])
    assert reduction.ready() == 0  # b has delivered nothing yet
    reduction.add_part("b", 1, b[2:4])
    assert reduction.ready() == 0  # in order: part 1 waits for part 0
    reduction.add_part("b", 0, b[0:2])
    assert reduction.ready() == 2 and reduction.pending == ["b"]
    assert reduction.average_next() == 0
    assert torch.equal(reduction.part_average(0), (a[0:2] + 3 * b[0:2]) / 4)
    assert reduction.part_average(1) is None  # not averaged yet
    assert reduction.holds("b") and reduction.holds("a")


def test_a_sender_dropped_midway_is_in_exactly_the_parts_averaged_before():
    sizes = [2, 2, 2]
    reduction = reduction_with(sizes, senders=["a", "b", "c"])
    a, b, c = torch.randn(6), torch.randn(6), torch.randn(6)
    reduction.add_local("c", c, 1.0)
    for sender, values in (("a", a), ("b", b)):
        reduction.set_weight(sender, 1.0)
        reduction.add_part(sender, 0, values[0:2])
    reduction.add_part("a", 1, a[2:4])
    reduction.add_part("b", 1, b[2:4])  # then b stalls: part 1 is staged but not averaged yet
    reduction.average_next()
    reduction.drop("b", "stalled")
    assert not reduction.holds("b")
    reduction.add_part("a", 2, a[4:6])
    outcome = reduction.outcome()
    assert outcome.part_contributors == [["a", "b", "c"], ["a", "c"], ["a", "c"]]
    assert outcome.contributors == ["a", "c"] and outcome.dropped == {"b": "stalled"}
    expected = torch.cat([(a[0:2] + b[0:2] + c[0:2]) / 3, (a[2:] + c[2:]) / 2])
    assert torch.allclose(outcome.averaged, expected, atol=1e-6)


def test_a_part_whose_contributors_all_weigh_nothing_has_no_average():
    reduction = reduction_with([1, 1], senders=["a", "b"])
    reduction.add_local("a", torch.ones(2), 0.0)
    reduction.set_weight("b", 2.0)
    reduction.add_part("b", 0, torch.full((1,), 4.0))
    reduction.average_next()
    reduction.drop("b", "died")
    outcome = reduction.outcome()
    assert torch.equal(reduction.part_average(0), torch.full((1,), 4.0))
    assert reduction.part_average(1) is None and outcome.averaged is None


def test_a_part_larger_than_a_reducer_accepts_is_refused_when_configured():
    from averaging.allreduce import RoundSettings
    from averaging.allreduce_protocol import MAX_PART_MESSAGE

    assert RoundSettings(part_size=1 << 20).part_size == 1 << 20
    for wrong in (0, -1, MAX_PART_MESSAGE // 4):  # the last: every round's first part refused
        with pytest.raises(ValueError, match="part_size"):
            RoundSettings(part_size=wrong)
