"""Sparse low-bit codecs (``topk_2bit``, ``topk_4bit``): each chunk keeps exactly its largest values
(2-bit ones at two magnitudes that keep the chunk's sum, 4-bit ones within a bin), the wire is
> 100x smaller than float32, hostile payloads are refused, error feedback keeps what the average
left out, and a real round leaves every peer with the same sparse average."""

from __future__ import annotations

import pytest
import torch
import trio

from averaging.allreduce import AllReduceResult
from averaging.compression import decode_part, get_codec
from averaging.error_feedback import ErrorFeedback
from averaging.partition import AllReducePlan
from averaging.sparse_codec import CHUNK, KEEP, kept_per_chunk
from tests.averaging.test_allreduce import flat, make_group, random_tensors, run_round, start_peers

CODECS = ["topk_2bit", "topk_4bit"]
SIZES = [0, 1, 65, CHUNK, 3 * CHUNK + 517]


def normal(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def chunks_of(numel: int) -> list[tuple[int, int]]:
    return [(start, min(start + CHUNK, numel)) for start in range(0, numel, CHUNK)]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("name", CODECS)
def test_each_chunk_keeps_its_largest_values_within_a_bin(name: str, numel: int) -> None:
    codec = get_codec(name)
    x = normal(numel)
    meta, payload = codec.encode(x)
    assert len(payload) == codec.payload_size(numel)
    y = decode_part(meta, bytes(payload), numel)
    for start, end in chunks_of(numel):
        chunk, decoded = x[start:end], y[start:end]
        keep = kept_per_chunk(end - start)
        largest = set(torch.topk(chunk.abs(), keep).indices.tolist())
        assert set(decoded.nonzero().reshape(-1).tolist()) == largest
        kept = torch.tensor(sorted(largest))
        magnitudes = chunk[kept].abs()
        assert torch.equal(decoded[kept].sign(), chunk[kept].sign())
        if codec.bits == 2:  # two magnitudes, each the mean of the values it stands for
            levels = decoded[kept].abs().unique()
            assert len(levels) <= 2 and magnitudes.min() <= levels.min() and levels.max() <= magnitudes.max()
            assert torch.isclose(decoded[kept].abs().sum(), magnitudes.sum(), rtol=1e-5)
        else:  # the middle of one of 8 bins of equal width
            bin_width = (magnitudes.max() - magnitudes.min()) / (1 << (codec.bits - 1))
            assert (decoded[kept] - chunk[kept]).abs().max() <= bin_width / 2 + 1e-6


@pytest.mark.parametrize(("name", "at_least"), [("topk_2bit", 130), ("topk_4bit", 115)])
def test_a_large_part_is_over_a_hundred_times_smaller_than_float32(name: str, at_least: float) -> None:
    numel = 1 << 19
    _, payload = get_codec(name).encode(normal(numel))
    assert 4 * numel / len(payload) >= at_least
    assert (get_codec(name).decode({"codec": name}, payload, numel) != 0).sum() == numel * KEEP // CHUNK


def encoded(name: str, numel: int = 2 * CHUNK + 100) -> bytearray:
    _, payload = get_codec(name).encode(normal(numel))
    return bytearray(payload)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize(
    ("bounds", "match"),
    [
        ((float("nan"), 1.0), "finite"),
        ((0.0, float("inf")), "finite"),
        ((-1.0, 1.0), "non-negative"),
        ((2.0, 1.0), "ordered"),
    ],
)
def test_hostile_chunk_bounds_are_refused(name: str, bounds: tuple[float, float], match: str) -> None:
    payload = encoded(name)
    payload[8:16] = torch.tensor(bounds, dtype=torch.float32).numpy().tobytes()  # the second chunk's
    with pytest.raises(ValueError, match=match):
        decode_part({"codec": name}, bytes(payload), 2 * CHUNK + 100)


@pytest.mark.parametrize("name", CODECS)
def test_an_index_past_the_end_of_its_chunk_is_refused(name: str) -> None:
    numel = CHUNK + 100  # the second chunk holds 100 values and keeps 2 of them
    payload = encoded(name, numel)
    first_tail_index = 8 * 2 + 3 * (KEEP // 2)  # after both chunks' bounds and the first chunk's indices
    payload[first_tail_index] = 200  # index 200 of a 100-value chunk
    with pytest.raises(ValueError, match="outside its chunk"):
        decode_part({"codec": name}, bytes(payload), numel)


@pytest.mark.parametrize("name", CODECS)
def test_wrong_lengths_and_meta_are_refused(name: str) -> None:
    payload = bytes(encoded(name))
    for wrong in (payload[:-1], payload + b"\0"):
        with pytest.raises(ValueError, match="payload has"):
            decode_part({"codec": name}, wrong, 2 * CHUNK + 100)
    with pytest.raises(ValueError, match="exactly the keys"):
        decode_part({"codec": name, "keep": 4096}, payload, 2 * CHUNK + 100)


def round_result(plan: AllReducePlan, my_shard: int) -> AllReduceResult:
    return AllReduceResult(group=None, plan=plan, my_shard=my_shard)


def test_feedback_keeps_what_the_returned_average_left_out_of_every_shard_ours_included() -> None:
    """Our own shard's contribution went in as sent (``sparse_codec.as_sent``), like the others'."""
    codec = get_codec("topk_2bit")
    numel = 2 * CHUNK
    plan = AllReducePlan.build(numel, [1.0, 1.0], part_size=CHUNK)  # shard 0 remote, shard 1 ours
    delta = [normal(numel, seed=1)]
    feedback = ErrorFeedback(delta, codec)
    feedback.add_residual(delta)
    sent = delta[0].clone()
    remote, ours = slice(*plan.shard_bounds(0)), slice(*plan.shard_bounds(1))
    decoded = codec.decode(*codec.encode(sent[remote]), CHUNK)
    averaged = torch.zeros(numel)
    averaged[remote] = decoded
    averaged[remote][decoded.nonzero()[:10]] = 0.0  # the reducer's average left out 10 of ours
    ours_sent = codec.decode(*codec.encode(sent[ours]), CHUNK)
    averaged[ours] = ours_sent
    averaged[ours][ours_sent.nonzero()[:5]] = 0.0  # and our own average left out 5 of ours
    feedback.settle(round_result(plan, my_shard=1), [averaged])
    applied = torch.cat([decoded * (averaged[remote] != 0), ours_sent * (averaged[ours] != 0)])
    assert torch.equal(feedback.residual, sent - applied)
    assert (feedback.residual[remote] == sent[remote]).sum() == CHUNK - KEEP + 10
    assert (feedback.residual[ours] == sent[ours]).sum() == CHUNK - KEEP + 5


def test_a_failed_reducers_shard_leaves_all_of_our_contribution_owed() -> None:
    """A sparse round writes zeros where no average is believed (``allreduce._written``): nothing
    of ours arrived there, and all of it stays owed, where a dense round's local values applied it."""
    codec = get_codec("topk_2bit")
    numel = 2 * CHUNK
    plan = AllReducePlan.build(numel, [1.0, 1.0], part_size=CHUNK)
    delta = [normal(numel, seed=2)]
    feedback = ErrorFeedback(delta, codec)
    feedback.add_residual(delta)
    sent, averaged = delta[0].clone(), torch.zeros(numel)
    ours = slice(*plan.shard_bounds(1))
    averaged[ours] = codec.decode(*codec.encode(sent[ours]), CHUNK)
    result = round_result(plan, my_shard=1)
    result.local_shards[0] = "reducer failed its check"
    feedback.settle(result, [averaged])
    failed = slice(*plan.shard_bounds(0))
    assert torch.equal(feedback.residual[failed], sent[failed])


def test_feedback_needs_the_averaged_tensors_for_a_sparse_codec() -> None:
    plan = AllReducePlan.build(CHUNK, [1.0, 1.0], part_size=CHUNK)
    feedback = ErrorFeedback([torch.ones(CHUNK)], "topk_2bit")
    feedback.add_residual([torch.ones(CHUNK)])
    with pytest.raises(ValueError, match="needs the averaged tensors"):
        feedback.settle(round_result(plan, my_shard=1))


def test_with_feedback_every_value_arrives_and_what_is_owed_stays_bounded() -> None:
    """A constant delta sent round after round: plain top-k sends the same 64 values of every chunk
    for ever; with feedback every value arrives in turn, what arrived plus what is owed is what was
    meant, and what is owed stops growing (about a threshold that the chunk's 64 slots drain)."""
    codec = get_codec("topk_2bit")
    numel = CHUNK
    plan = AllReducePlan.build(numel, [1.0], part_size=CHUNK)  # one shard, another peer's
    delta = normal(numel, seed=2).abs() + 0.1
    feedback = ErrorFeedback([delta], codec)
    arrived, plain = torch.zeros(numel), torch.zeros(numel)
    owed_at = {}
    for round_ in range(1, 1201):
        contribution = [delta.clone()]
        feedback.add_residual(contribution)
        received = codec.decode(*codec.encode(contribution[0]), numel)
        arrived += received
        feedback.settle(round_result(plan, my_shard=None), [received])
        plain += codec.decode(*codec.encode(delta), numel)
        owed_at[round_] = float(feedback.residual.abs().max())
    intended = delta * 1200
    assert (plain == 0).sum() == numel - KEEP, "without feedback most values never arrive"
    assert bool((arrived > 0).all()), "with feedback every value arrives"
    assert torch.allclose(arrived + feedback.residual, intended, rtol=1e-4)
    drain = float(delta.sum()) / KEEP  # the owed amount at which a value wins a slot, roughly
    assert owed_at[600] < 3 * drain and owed_at[1200] < 3 * drain


async def test_a_round_leaves_every_peer_with_the_same_sparse_average() -> None:
    """Every peer, each shard's reducer included, holds the very bytes the reducers sent: the
    largest of each chunk of the average, the rest zero."""
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3)
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(3)]
        results: dict = {}
        await run_round(
            peers, group, tensors, [1.0] * 3, results, codec="topk_2bit", sender_timeout=10.0, reducer_timeout=20.0
        )
        assert all(results[i].succeeded for i in range(3))
        for t in tensors[1:]:
            assert torch.equal(flat(t), flat(tensors[0]))
        kept = int((flat(tensors[0]) != 0).sum())
        plan = results[0].plan
        assert kept == sum(kept_per_chunk(end - start) for i in range(3) for start, end in plan.parts(i))
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("name", CODECS)
def test_a_chunk_with_fewer_non_zero_values_than_slots_decodes_them_and_nothing_else(name: str) -> None:
    codec = get_codec(name)
    x = torch.zeros(CHUNK + 100)
    x[[3, 10, 99]] = torch.tensor([1.0, -0.5, 0.5])
    x[CHUNK + 7] = 5.0
    y = codec.decode(*codec.encode(x), x.numel())
    assert y.nonzero().reshape(-1).tolist() == [3, 10, 99, CHUNK + 7]
    assert y[CHUNK + 7] == 5.0 and y[3] > 0 > y[10] and y[99] > 0
    assert not codec.decode(*codec.encode(torch.zeros(5000)), 5000).any()


@pytest.mark.parametrize("name", CODECS)
def test_values_near_the_float32_limit_round_trip(name: str) -> None:
    x = torch.full((10,), 0.75 * float(torch.finfo(torch.float32).max))
    y = decode_part({"codec": name}, bytes(get_codec(name).encode(x)[1]), 10)
    assert torch.isfinite(y).all() and y.max() == x.max()


def test_two_bit_replies_are_unbiased_where_equal_bins_made_them_twelve_percent_too_large() -> None:
    """A reducer's reply: the average of 8 sparse contributions, encoded again. Its kept values
    decode to magnitudes that add up to the average's, and within 10% of them (norm)."""
    codec = get_codec("topk_2bit")
    numel = 1 << 16
    contributions = [codec.decode(*codec.encode(normal(numel, seed=s)), numel) for s in range(8)]
    average = torch.stack(contributions).mean(dim=0)
    reply = codec.decode(*codec.encode(average), numel)
    kept = reply != 0
    assert torch.isclose(reply[kept].abs().sum(), average[kept].abs().sum(), rtol=1e-5)
    assert (reply[kept] - average[kept]).norm() / average[kept].norm() < 0.1


def test_a_full_chunk_of_values_near_the_float32_limit_round_trips() -> None:
    x = torch.full((CHUNK,), 0.75 * float(torch.finfo(torch.float32).max))
    for name in CODECS:
        y = decode_part({"codec": name}, bytes(get_codec(name).encode(x)[1]), CHUNK)
        assert torch.isfinite(y).all() and (y != 0).sum() == KEEP
