"""Reducer checks judged sans I/O (``averaging/verification.py``): an honest reducer's answer
holds and every lie is named, kept inputs answer only their round's senders and expire, bans
expire and stay bounded."""

from __future__ import annotations

import time
from dataclasses import astuple

import pytest
import torch

from averaging.commitments import Commitment, SignedPart, commit, part_digest
from averaging.compression import get_codec
from averaging.robust import Aggregation, centered_clip, clip_weights
from averaging.verification import KEPT_VALUES, BanList, KeptInputs, PartCheck, PartInputs
from peer import Identity, PeerID
from peer.framing import MAX_RECORD_PLAINTEXT
from peer.packing import packb
from peer.tensors import tensor_bytes

DIM = 1024
GROUP = b"g" * 16
KEYS: dict[PeerID, Identity] = {}


def ids(count: int) -> list[PeerID]:
    identities = [Identity.generate() for _ in range(count)]
    KEYS.update((i.peer_id, i) for i in identities)
    return [i.peer_id for i in identities]


def signed_rows(peers: list[PeerID], weights: list[float], values: torch.Tensor) -> list[SignedPart]:
    """Each row as its sender (``KEYS``) commits to it as part 0 of ``peers[0]``'s shard."""
    codec, rows = get_codec("none"), []
    for peer, weight, row in zip(peers, weights, values, strict=True):
        meta, payload = codec.encode(row)
        commitment = commit(KEYS[peer], GROUP, weight, [(peers[0], [part_digest(meta, payload)])])
        rows.append(SignedPart(commitment, meta, bytes(payload)))
    return rows


def checker(me, reducer, own, weight, contributors, reply) -> PartCheck:
    return PartCheck(me, reducer, own, weight, contributors, reply, None, GROUP, 0)


def honest_inputs(peers: list[PeerID], seed: int = 0) -> tuple[PartInputs, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(len(peers), DIM, generator=generator)
    values[-1] = 1e30  # a hostile sender: its clipped contribution is part of the honest answer
    # (the reducer is peers[0], and starts from its own contribution)
    weights = [1.0] * (len(peers) - 1) + [2.0**40]
    reply = torch.empty(DIM)
    tau, moved_to = centered_clip(list(values.unbind(0)), clip_weights(weights), reply, center=values[0])
    assert moved_to is None
    signed = signed_rows(peers, weights, values)
    return PartInputs(list(peers), weights, values, tau, Aggregation.CENTERED_CLIP, 0, signed), reply


@pytest.mark.parametrize("distances", ["gram", "streamed"])
def test_an_honest_answer_holds_and_every_lie_is_named(distances, monkeypatch):
    """(The radii of small parts come from one Gram matrix, of large ones from passes over the
    rows: both judge alike.)"""
    if distances == "streamed":
        monkeypatch.setattr("averaging.verification.GRAM_LIMIT", 0)
        monkeypatch.setattr("averaging.robust.GRAM_LIMIT", 0)
    peers = ids(5)
    inputs, reply = honest_inputs(peers)
    me = peers[2]
    check = checker(me, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply)
    assert check.verdict(inputs) is None
    # our own input is compared with what we sent: its commitment is not verified (it proves nothing more)
    unsigned_ours, ours = list(inputs.signed), inputs.signed[2].commitment
    unsigned_ours[2] = SignedPart(Commitment(ours.public_key, b"x" * 64, ours.digests), *astuple(inputs.signed[2])[1:])
    assert check.verdict(PartInputs(*astuple(inputs)[:6], unsigned_ours)) is None
    lies = {
        "reply": checker(me, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply * -10),
        "our values": checker(me, peers[0], inputs.values[2] + 1, 1.0, list(peers), reply),
        "our weight": checker(me, peers[0], inputs.values[2].clone(), 3.0, list(peers), reply),
        "left out": checker(peers[0], peers[0], inputs.values[0].clone(), 1.0, list(peers), reply),
    }
    stranger = ids(1)[0]
    lies["left out"].me = stranger
    lies["left out"].contributors.append(stranger)  # the reply named us; its inputs do not hold us
    for name, lie in lies.items():
        assert lie.verdict(inputs) is not None, name
    for tau in (inputs.tau * 10, inputs.tau / 10):  # loosened to the mean, or tightened to its start
        assert (
            check.verdict(PartInputs(peers, inputs.weights, inputs.values, tau, inputs.aggregation, 0, inputs.signed))
            is not None
        )
    # a reducer that starts from a contribution of its own far away: a huge radius, the mean
    far = inputs.values.clone()
    far[0] = 1e6
    weights = inputs.weights
    parts = list(far.unbind(0))
    tau, _ = centered_clip(parts, clip_weights(weights), reply, center=far[0], choose_start=False)
    honest_looking = checker(me, peers[0], far[2].clone(), 1.0, list(peers), reply)
    lie = PartInputs(peers, weights, far, tau, Aggregation.CENTERED_CLIP, 0, signed_rows(peers, weights, far))
    assert "far" in (honest_looking.verdict(lie) or "")
    # a quiet attacker that starts from its own contribution (-4x the honest mean, two of them):
    # its radius takes in every honest input, though it is no outlier's (under 4x the median's)
    generator = torch.Generator().manual_seed(5)
    mu = torch.randn(DIM, generator=generator)
    mu *= 0.5 / mu.norm()
    ipm = torch.stack([mu + torch.randn(DIM, generator=generator) / DIM**0.5 for _ in range(3)] + [-4 * mu] * 2)
    ipm_weights = [1.0] * 5
    ipm_reply = torch.empty(DIM)
    tau, _ = centered_clip(list(ipm.unbind(0)), ipm_weights, ipm_reply, center=ipm[4], choose_start=False)
    ipm_lie = PartInputs(
        peers, ipm_weights, ipm, tau, Aggregation.CENTERED_CLIP, 4, signed_rows(peers, ipm_weights, ipm)
    )
    assert "far" in (checker(me, peers[0], ipm[2].clone(), 1.0, list(peers), ipm_reply).verdict(ipm_lie) or "")
    # an honest reducer whose own contribution lies far out (a replica that lags) starts elsewhere
    tau, moved_to = centered_clip(parts, clip_weights(weights), reply, center=far[0])
    assert moved_to not in (None, 0)
    honest = PartInputs(peers, weights, far, tau, Aggregation.CENTERED_CLIP, moved_to, signed_rows(peers, weights, far))
    assert checker(me, peers[0], far[2].clone(), 1.0, list(peers), reply).verdict(honest) is None
    # another sender's input changed (to fit a lie) under its own commitment, or under one it did
    # not sign, or without one
    fabricated = inputs.values.clone()
    fabricated[1] = reply
    forged = list(inputs.signed)
    forged[1] = SignedPart(forged[1].commitment, forged[1].meta, bytes(tensor_bytes(reply)))
    stated = PartInputs(peers, inputs.weights, fabricated, inputs.tau, inputs.aggregation, 0, forged)
    assert "did not commit to" in (check.verdict(stated) or "")
    theirs = forged[1].commitment
    digests = ((theirs.digests[0][0], part_digest(forged[1].meta, forged[1].payload)),)
    forged[1] = SignedPart(Commitment(theirs.public_key, theirs.signature, digests), *astuple(forged[1])[1:])
    stated = PartInputs(peers, inputs.weights, fabricated, inputs.tau, inputs.aggregation, 0, forged)
    assert "did not sign" in (check.verdict(stated) or "")
    assert "not signed" in (check.verdict(PartInputs(peers, *astuple(stated)[1:6], forged[:-1])) or "")
    mean = PartInputs(peers, inputs.weights, inputs.values, inputs.tau, Aggregation.MEAN, 0)
    assert "mean" in (check.verdict(mean) or "")


def test_a_reply_that_left_us_out_openly_is_judged_on_the_inputs_it_took():
    """A reducer drops a sender that falls silent and names the part's contributors without it:
    the dropped sender's check holds an honest aggregate of the others, and still catches a lie."""
    peers = ids(5)
    inputs, reply = honest_inputs(peers)
    late = ids(1)[0]  # sent (weight 1), was dropped, and is named nowhere
    assert checker(late, peers[0], torch.randn(DIM), 1.0, list(peers), reply).verdict(inputs) is None
    assert "away from" in (checker(late, peers[0], torch.randn(DIM), 1.0, list(peers), reply + 1).verdict(inputs) or "")


def test_kept_inputs_answer_only_the_round_senders_and_expire():
    peers = ids(3)
    inputs, _reply = honest_inputs(peers)
    kept = KeptInputs()
    kept.keep(b"g" * 16, peers, lambda index: inputs if index == 0 else None, now=0.0)
    assert kept.answer(b"g" * 16, 0, peers[1], now=1.0) is inputs
    for group_id, index, asker, now in (
        (b"g" * 16, 0, ids(1)[0], 1.0),
        (b"g" * 16, 1, peers[1], 1.0),
        (b"g" * 16, 0, peers[1], 1e6),
    ):
        try:
            kept.answer(group_id, index, asker, now)
        except ValueError:
            continue
        raise AssertionError("answered what it must not")
    body, payload = inputs.to_message()
    parsed = PartInputs.parse(body, bytes(payload), DIM, max_senders=3)
    assert torch.equal(parsed.values, inputs.values) and parsed.senders == peers


def test_kept_inputs_outlast_many_small_rounds_within_their_budget():
    """A small model's reducer runs many rounds while a slow sender's round is still going; the
    sender's check of an early round must still be answered (else it bans an honest reducer)."""
    peers = ids(3)
    inputs, _reply = honest_inputs(peers)
    kept = KeptInputs()
    first = b"a" * 16
    kept.keep(first, peers, lambda index: inputs, now=0.0, values=3 * DIM)
    for round_number in range(50):
        kept.keep(bytes([round_number]) * 16, peers, lambda index: None, now=0.1 * round_number, values=3 * DIM)
    assert kept.answer(first, 0, peers[1], now=10.0) is inputs
    # big rounds: beyond the last KEPT_ROUNDS, only KEPT_VALUES are kept
    kept.keep(b"b" * 16, peers, lambda index: None, now=11.0, values=KEPT_VALUES)
    kept.keep(b"c" * 16, peers, lambda index: None, now=11.0, values=KEPT_VALUES)
    with pytest.raises(ValueError, match="no inputs kept"):
        kept.answer(first, 0, peers[1], now=11.0)


def test_bans_expire():
    banned = BanList()
    peer, expired = ids(2)
    banned.ban(peer, "lied", seconds=60)
    banned.ban(expired, "lied", seconds=-1)
    assert peer in banned and expired not in banned and len(banned) == 1
    banned.until[peer] = time.monotonic() - 1  # its minute is over
    assert peer not in banned and len(banned) == 0


def test_bans_of_many_identities_stay_bounded():
    """Sybil identities caught one after another: the list keeps at most MAX_BANNED of them, with
    their reasons (those of evicted bans go with them)."""
    from averaging.verification import MAX_BANNED

    banned = BanList()
    for i in range(MAX_BANNED + 50):
        banned.ban(PeerID(i.to_bytes(20, "big")), "lied")
    assert len(banned.until) == MAX_BANNED and banned.reasons.keys() == banned.until.keys()


@pytest.mark.parametrize("distances", ["gram", "streamed"])
@pytest.mark.parametrize("spread", [1e-6, 0.0])
def test_a_checker_far_from_the_others_judges_an_honest_reducer_honest(distances, spread, monkeypatch):
    """A checker whose own contribution lags far behind replicas that agree (to 1e-6, or exactly)
    judges distances between those replicas exactly, not from a Gram matrix taken relative to its
    own row (where they cancel to noise), so an honest reducer among them passes."""
    if distances == "streamed":
        monkeypatch.setattr("averaging.verification.GRAM_LIMIT", 0)
        monkeypatch.setattr("averaging.robust.GRAM_LIMIT", 0)
    peers = ids(5)
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(DIM, generator=generator).repeat(5, 1)
    values[1:] += spread * torch.randn(4, DIM, generator=generator)
    values[2] += 100.0  # the checker, peers[2], lags far behind
    weights = [1.0] * 5
    reply = torch.empty(DIM)
    tau, moved_to = centered_clip(list(values.unbind(0)), clip_weights(weights), reply, center=values[0])
    assert moved_to is None
    signed = signed_rows(peers, weights, values)
    inputs = PartInputs(peers, weights, values, tau, Aggregation.CENTERED_CLIP, 0, signed)
    assert checker(peers[2], peers[0], values[2].clone(), 1.0, list(peers), reply).verdict(inputs) is None
    assert checker(peers[3], peers[0], values[3].clone(), 1.0, list(peers), reply).verdict(inputs) is None


def test_a_check_answer_fits_its_record_for_a_large_model_in_a_large_group():
    """Every input's commitment covers its sender's whole round (here 16 senders, each committing
    to 4096 parts, a 2-billion-value vector in parts of 2**19, over 16 reducers): together far more
    than the one 1 MiB record an RPC body travels in, so they go in the payload, and the answer
    still parses and holds."""
    peers = ids(16)
    generator = torch.Generator().manual_seed(2)
    values = torch.randn(len(peers), DIM, generator=generator)
    weights = [1.0] * len(peers)
    codec, signed = get_codec("none"), []
    filler = [bytes(32)] * 255
    for peer, row in zip(peers, values, strict=True):
        meta, payload = codec.encode(row)
        shards = [(peers[0], [part_digest(meta, payload), *filler])] + [
            (other, filler + [bytes(32)]) for other in peers[1:]
        ]
        signed.append(SignedPart(commit(KEYS[peer], GROUP, 1.0, shards), meta, bytes(payload)))
    reply = torch.empty(DIM)
    tau, moved_to = centered_clip(list(values.unbind(0)), clip_weights(weights), reply, center=values[0])
    inputs = PartInputs(peers, weights, values, tau, Aggregation.CENTERED_CLIP, moved_to or 0, signed)
    body, payload = inputs.to_message()
    assert len(packb(body)) < MAX_RECORD_PLAINTEXT // 4
    parsed = PartInputs.parse(body, bytes(payload), DIM, max_senders=len(peers))
    assert checker(peers[3], peers[0], values[3].clone(), 1.0, list(peers), reply).verdict(parsed) is None


def test_a_sparse_reply_of_an_aggregate_near_ours_passes_and_a_moved_one_does_not():
    """``sparse_reply_verdict``: a reducer whose own aggregate is within epsilon of ours (another
    start, other rounding) and which encodes it honestly in 8 bits always passes; replies that
    keep the wrong values, or move the right ones by more than their rounding, do not."""
    from averaging.compression import get_codec
    from averaging.sparse_codec import CHUNK
    from averaging.verification import sparse_reply_verdict

    codec, generator = get_codec("topk_8bit"), torch.Generator().manual_seed(11)
    numel = 2 * CHUNK + 333
    for draw in range(20):
        ours = torch.randn(numel, generator=generator) * (1 + draw)
        epsilon = 0.001 * float(ours.norm())
        nudge = torch.randn(numel, generator=generator)
        theirs = ours + nudge * (epsilon / float(nudge.norm()))  # the reducer's aggregate
        reply = codec.decode(*codec.encode(theirs), numel)
        assert sparse_reply_verdict(ours, reply, epsilon) is None
        kept = reply != 0
        assert "away from" in sparse_reply_verdict(ours, reply * 0.9, epsilon)
        assert "away from" in sparse_reply_verdict(
            ours, torch.where(kept, reply + 3 * epsilon / kept.sum() ** 0.5, 0), epsilon
        )
        dropped = codec.decode(*codec.encode(torch.where(kept, 0.0, theirs)), numel)  # the runners-up
        assert "below the chunk's largest" in sparse_reply_verdict(ours, dropped, epsilon)
        largest = torch.where(kept, ours.abs(), 0.0).argmax()  # the largest value dropped
        assert "leaves out a value" in sparse_reply_verdict(
            ours, torch.where(torch.arange(numel) == largest, 0.0, reply), epsilon
        )
    assert "keeps 4096 values" in sparse_reply_verdict(ours, ours.clone(), epsilon)  # a dense reply


def test_a_sparse_reply_verdict_names_the_first_chunk_that_breaks_a_rule():
    """The chunks are judged all at once; the verdict still names the first one that breaks a
    rule, the part's shorter last chunk included (it keeps fewer values)."""
    from averaging.sparse_codec import CHUNK, kept_per_chunk
    from averaging.verification import sparse_reply_verdict

    numel = 3 * CHUNK + 100
    ours = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    reply = torch.zeros(numel)
    for start in range(0, numel, CHUNK):
        chunk = ours[start : start + CHUNK]
        top = torch.topk(chunk.abs(), kept_per_chunk(chunk.numel())).indices + start
        reply[top] = ours[top]
    assert sparse_reply_verdict(ours, reply, 1e-6) is None
    for chunk in (1, 3):  # a middle chunk, and the short last one
        start = chunk * CHUNK
        end = min(start + CHUNK, numel)
        kept = torch.nonzero(reply[start:end]).flatten() + start
        dropped = reply.clone()
        dropped[kept[0]] = 0.0
        why = sparse_reply_verdict(ours, dropped, 1e-6)
        assert f"leaves out a value among the largest {kept_per_chunk(end - start)} of the chunk at {start}" in why
        runner_up = torch.topk(torch.where(reply[start:end] != 0, 0.0, ours[start:end].abs()), 1).indices + start
        swapped = dropped.clone()
        swapped[runner_up] = ours[runner_up]
        assert f"keeps a value of the chunk at {start} below" in sparse_reply_verdict(ours, swapped, 1e-6)
    two_lies = reply.clone()  # one in chunk 1, one in chunk 2: the first is named
    two_lies[torch.nonzero(reply[CHUNK : 2 * CHUNK]).flatten()[0] + CHUNK] = 0.0
    two_lies[2 * CHUNK : 3 * CHUNK] = ours[2 * CHUNK : 3 * CHUNK]
    assert f"the chunk at {CHUNK}" in sparse_reply_verdict(ours, two_lies, 1e-6)
    crowded = reply.clone()
    crowded[3 * CHUNK :] = ours[3 * CHUNK :]
    assert sparse_reply_verdict(ours, crowded, 1e-6) == "its reply keeps 100 values of a chunk of 100"


@pytest.mark.parametrize("float32_rows", [True, False], ids=["kept-values", "as-sent"])
def test_an_answer_leaves_out_the_askers_own_input_and_the_commitments_it_holds(float32_rows):
    """What the asker sent and the commitments it met as a reducer travel as nothing: of an
    answer to one of 4 senders, 3 rows' bytes and no commitment; parsed with what the asker holds,
    it is the answer in full, and an honest one holds."""
    peers = ids(4)
    inputs, reply = honest_inputs(peers)
    if float32_rows:  # (a reducer keeps float32 inputs as its values, with no second copy)
        inputs.signed = [SignedPart(s.commitment, s.meta, None) for s in inputs.signed]
    asker = peers[2]
    held = {peer: signed.commitment for peer, signed in zip(peers, inputs.signed, strict=True)}
    check = PartCheck(asker, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply, None, GROUP, 0, held=held)
    full_body, full_payload = inputs.to_message()
    body, payload = inputs.to_message(asker, frozenset(check.holds().request()))
    assert len(payload) == 3 * 4 * DIM and body["commit_sizes"] == [0] * 4
    assert body["sizes"][2] == 0 and body["metas"][2] is None
    assert len(full_payload) > 4 * 4 * DIM
    parsed = PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=check.holds())
    assert torch.equal(parsed.values, inputs.values) and parsed.senders == peers
    assert [s.commitment for s in parsed.signed] == [s.commitment for s in inputs.signed]
    assert check.verdict(parsed) is None
    # only the commitments the asker named are left out
    body, payload = inputs.to_message(asker, frozenset([inputs.signed[1].commitment.fingerprint]))
    assert [size > 0 for size in body["commit_sizes"]] == [True, False, False, True]
    parsed = PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=check.holds())
    assert check.verdict(parsed) is None


def test_an_answer_may_leave_out_only_what_the_asker_holds():
    """A reducer that leaves out a commitment we do not hold, or any input but ours, has given
    no answer (a malformed one: the checker bans it); one that leaves out our input and states
    a false aggregate is caught as before, from our own input as we sent it."""
    peers = ids(4)
    inputs, reply = honest_inputs(peers)
    asker = peers[2]
    held = {peer: signed.commitment for peer, signed in zip(peers, inputs.signed, strict=True)}
    check = PartCheck(asker, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply, None, GROUP, 0, held=held)
    body, payload = inputs.to_message(asker, frozenset(check.holds().request()))
    lacking = PartCheck(asker, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply, None, GROUP, 0)
    with pytest.raises(ValueError, match="which we do not hold"):
        PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=lacking.holds())
    with pytest.raises(ValueError, match="which we do not hold"):
        PartInputs.parse(body, bytes(payload), DIM, max_senders=4)
    someone_else = PartCheck(peers[1], peers[0], inputs.values[1].clone(), 1.0, list(peers), reply, None, GROUP, 0)
    someone_else.held.update(held)
    with pytest.raises(ValueError, match="not ours"):
        PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=someone_else.holds())
    lying = PartCheck(asker, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply * 1.5, None, GROUP, 0)
    lying.held.update(held)
    parsed = PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=lying.holds())
    assert "away from the aggregate" in (lying.verdict(parsed) or "")


def test_a_check_request_without_well_formed_fingerprints_gets_the_whole_answer():
    """A request that names nothing it holds (a peer that predates ``held``), or names it in
    another form, gets every input and commitment, its own too, and an asker that holds
    commitments parses that as well."""
    from averaging.part_inputs import MAX_HELD, held_fingerprints

    assert held_fingerprints(None) is None
    assert held_fingerprints([]) == frozenset()
    assert held_fingerprints([b"f" * 32, b"f" * 32]) == {b"f" * 32}
    for raw in ([b"short"], [b"s" * 64], [None], "x", [b"f" * 32] * (MAX_HELD + 1)):
        assert held_fingerprints(raw) is None  # (malformed: the whole answer, which is always safe)
    peers = ids(4)
    inputs, reply = honest_inputs(peers)
    body, payload = inputs.to_message(peers[2], None)
    full_body, full_payload = inputs.to_message()
    assert body == full_body and bytes(payload) == bytes(full_payload)
    held = {peer: signed.commitment for peer, signed in zip(peers, inputs.signed, strict=True)}
    check = PartCheck(peers[2], peers[0], inputs.values[2].clone(), 1.0, list(peers), reply, None, GROUP, 0, held=held)
    assert check.verdict(PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=check.holds())) is None


def test_an_answer_leaves_out_only_the_very_commitment_the_asker_holds():
    """Commitments are named by their whole content: one the asker holds with the same signature
    bytes as the reducer's copy but other digests (a sender that hands the two of them different
    statements under one signature, as a key that verifies nothing now could) does not stand in
    for the reducer's copy, which goes in full and is the one the answer is judged by."""
    peers = ids(4)
    inputs, reply = honest_inputs(peers)
    asker, theirs = peers[2], inputs.signed[3].commitment
    other = Commitment(theirs.public_key, theirs.signature, ((peers[0].to_bytes(), b"\0" * 32),))
    held = {peer: part.commitment for peer, part in zip(peers, inputs.signed, strict=True)} | {peers[3]: other}
    check = PartCheck(asker, peers[0], inputs.values[2].clone(), 1.0, list(peers), reply, None, GROUP, 0, held=held)
    body, payload = inputs.to_message(asker, frozenset(check.holds().request()))
    assert body["commit_sizes"][3] > 0 and body["commit_sizes"][:3] == [0, 0, 0]
    parsed = PartInputs.parse(body, bytes(payload), DIM, max_senders=4, holds=check.holds())
    assert parsed.signed[3].commitment == theirs != other
    assert check.verdict(parsed) is None
