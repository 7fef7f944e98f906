"""Reducer checks: a reducer that lies about its shard is caught by the senders that check it,
banned, and left out of their groups; honest reducers pass every check."""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from averaging.allreduce import AllReduceService
from averaging.averager import GroupAverager
from averaging.commitments import Commitment, SignedPart, commit, part_digest
from averaging.compression import get_codec
from averaging.matchmaking import MatchmakingError
from averaging.robust import Aggregation, centered_clip, clip_weights
from averaging.verification import (
    KEPT_VALUES,
    UNANSWERED_BAN_SECONDS,
    BanList,
    KeptInputs,
    PartCheck,
    PartInputs,
)
from peer import Identity, PeerID
from peer.framing import MAX_RECORD_PLAINTEXT
from peer.packing import packb
from peer.tensors import tensor_bytes

from .hostile_reducers import LyingShard, fabricating_service, lying_service
from .test_allreduce import flat, make_group, random_tensors, run_round
from .test_matchmaking import open_swarm, step_all

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
    lies["left out"].me = ids(1)[0]
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


class MisSigning(Identity):
    """Signs every part over something other than what it sends (a sender out to frame reducers)."""

    def sign(self, message: bytes) -> bytes:
        return super().sign(message + b"!" if message.startswith(b"peerd-committed-round") else message)


def commit_to_other_values(service: AllReduceService) -> None:
    """A sender that signs a true commitment to values other than those it sends (out to frame
    the reducers that take them)."""
    checks = service.checks
    honest = checks.commit

    def commit(group, plan, flat, weight, codec):
        commitment, _parts = honest(group, plan, flat + 1.0, weight, codec)
        return commitment, honest(group, plan, flat, weight, codec)[1]

    checks.commit = commit  # type: ignore[method-assign]


async def start_with_liar(nursery, count: int, liar: int, make_liar=None, mis_signer: int = -1, mis_committer=-1):
    from peer import open_peer_host

    from .test_allreduce import Peer

    peers = []

    async def run_peer(index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        identity = MisSigning(Ed25519PrivateKey.generate()) if index == mis_signer else Identity.generate()
        async with open_peer_host(identity) as host:
            if index != liar:
                service = AllReduceService(host)
                if index == mis_committer:
                    commit_to_other_values(service)
            elif make_liar is not None:
                service = make_liar(host)
            else:
                service = AllReduceService(host, shard_type=LyingShard)
            task_status.started(Peer(host, service, trio.CancelScope(), None))
            await trio.sleep_forever()

    for index in range(count):
        peers.append(await nursery.start(run_peer, index))
    return peers


@dataclass
class CheckedRound:
    """A centered-clip round of 4 peers whose last one reduces with ``make_odd_one``'s service."""

    peers: list
    odd_one: PeerID
    tensors: list
    before: list[torch.Tensor]  # each peer's values before the round
    results: dict
    odd_bounds: tuple[int, int]  # where the odd one's shard lies in the flat vector

    def kept_own_values(self, i: int) -> bool:
        start, end = self.odd_bounds
        return torch.equal(flat(self.tensors[i])[start:end], self.before[i][start:end])


async def checked_round(nursery, make_odd_one) -> CheckedRound:
    peers = await start_with_liar(nursery, 4, liar=3, make_liar=make_odd_one)
    odd_one = peers[3].host.peer_id
    group = make_group(peers)
    tensors = [random_tensors(i) for i in range(4)]
    before = [flat(t).clone() for t in tensors]
    results = {}
    await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", reducer_timeout=20.0)
    shard = [m.peer_id for m in group.reducers].index(odd_one)
    return CheckedRound(peers, odd_one, tensors, before, results, results[0].plan.shard_bounds(shard))


@pytest.mark.parametrize(
    ("make_liar", "caught_by"),
    [
        (None, "away from the aggregate of its own inputs"),  # true inputs, a reply they do not give
        (fabricating_service, "did not commit to"),  # inputs made to fit the lie, not signed for it
    ],
    ids=["true-inputs", "fabricated-inputs"],
)
async def test_a_lying_reducer_is_caught_before_its_answer_is_used_and_honest_ones_never_are(make_liar, caught_by):
    """Also one that states each checker's own contribution truly and fabricates every other to
    fit its lie: the fabricated inputs do not carry their senders' signatures. Either is caught
    *as a liar*, by what its answer says (a reducer whose answer cannot be had is only
    "unanswered", and left out briefly): banned for long, and counted as caught."""
    async with trio.open_nursery() as nursery:
        round_ = await checked_round(nursery, make_liar)
        peers, liar, results = round_.peers, round_.odd_one, round_.results
        group = results[0].group
        shard = [m.peer_id for m in group.reducers].index(liar)
        for i in range(3):
            verdicts = {reducer: verdict for reducer, verdict in results[i].reducer_checks.values()}
            assert set(verdicts) == {m.peer_id for m in group.reducers} - {peers[i].host.peer_id}
            assert all((verdict is not None) == (reducer == liar) for reducer, verdict in verdicts.items()), verdicts
            assert caught_by in verdicts[liar] and "unanswered" not in verdicts[liar], verdicts[liar]
            checks = peers[i].service.checks
            assert set(checks.banned.until) == {liar} and checks.caught == 1
            assert checks.banned.reasons[liar] == verdicts[liar]
            assert checks.banned.until[liar] - time.monotonic() > UNANSWERED_BAN_SECONDS  # a liar's ban
            # the lie never reached our values: that shard kept them
            assert results[i].local_shards[shard] == f"reducer failed its check: {verdicts[liar]}"
            assert round_.kept_own_values(i)
        nursery.cancel_scope.cancel()


class ForgetfulInputs(KeptInputs):
    """An honest reducer that lost its inputs (restarted, or cut off): it refuses every check."""

    def answer(self, group_id, index, asker, now):
        raise ValueError("no inputs kept for that round")


def forgetful_service(host) -> AllReduceService:
    return AllReduceService(host, kept=ForgetfulInputs())


async def test_an_unanswered_check_leaves_the_reducer_out_briefly_and_a_lie_for_long():
    """After a partition, honest reducers that could not answer their checks were banned for ten
    minutes, as liars are, and kept the healed swarm apart; an unanswered check costs a minute."""
    async with trio.open_nursery() as nursery:
        round_ = await checked_round(nursery, forgetful_service)
        forgetful, results = round_.odd_one, round_.results
        shard = [m.peer_id for m in results[0].group.reducers].index(forgetful)
        for i in range(3):
            checks = round_.peers[i].service.checks
            assert forgetful in checks.banned and checks.caught == 0
            left = checks.banned.until[forgetful] - time.monotonic()
            assert 0 < left <= UNANSWERED_BAN_SECONDS, left
            assert "unanswered" in results[i].local_shards[shard]
            assert round_.kept_own_values(i)  # its shard unused
            # a lie found later bans it for long, and an unanswered check cannot shorten that
            checks.banned.ban(forgetful, "lied")
            checks.banned.ban(forgetful, "no answer", UNANSWERED_BAN_SECONDS)
            assert checks.banned.until[forgetful] - time.monotonic() > UNANSWERED_BAN_SECONDS
        nursery.cancel_scope.cancel()


async def step_each(averagers) -> None:
    """A step on every averager; a group that did not form is no failure here."""

    async def one(averager) -> None:
        try:
            await averager.step()
        except MatchmakingError:
            pass

    async with trio.open_nursery() as nursery:
        for averager in averagers:
            nursery.start_soon(one, averager)


async def test_a_caught_reducer_is_left_out_of_the_groups_that_caught_it():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 4)
        lying_service(nodes[3].host)
        averagers = [
            GroupAverager([torch.randn(512)], node, prefix="test", matchmaking_timeout=2.0, aggregation="centered-clip")
            for node in nodes
        ]
        liar = nodes[3].host.peer_id
        banned = [a._service.checks.banned for a in averagers[:3]]
        for _round in range(20):
            await step_each(averagers)
            if all(liar in b for b in banned):
                break
        assert all(liar in b for b in banned)
        results = {}
        await step_all(averagers[:3], results)
        for i in range(3):
            assert results[i].group.member(liar) is None and len(results[i].group.members) == 3
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("codec", ["float16", "uint8", "blockwise_8bit"])
async def test_honest_reducers_pass_their_checks_with_lossy_codecs(codec):
    async with trio.open_nursery() as nursery:
        peers = await start_with_liar(nursery, 4, liar=-1)
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(4)]
        results = {}
        await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", codec=codec)
        for i in range(4):
            assert results[i].succeeded, results[i]
            assert len(results[i].reducer_checks) == 3
            verdicts = [verdict for _reducer, verdict in results[i].reducer_checks.values()]
            assert all(verdict is None for verdict in verdicts), verdicts
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("hostile_sender", ["mis-signed", "mis-committed"])
async def test_a_sender_whose_parts_do_not_match_its_commitment_is_refused_and_frames_nobody(hostile_sender):
    """A commitment it did not sign, or a signed one to other values than it sends: its parts
    never enter a reducer's inputs, so every honest reducer's answers stay provable."""
    async with trio.open_nursery() as nursery:
        if hostile_sender == "mis-signed":
            peers = await start_with_liar(nursery, 4, liar=-1, mis_signer=3)
        else:
            peers = await start_with_liar(nursery, 4, liar=-1, mis_committer=3)
        hostile = peers[3].host.peer_id
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(4)]
        results = {}
        await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", reducer_timeout=20.0)
        honest = [m.peer_id for m in group.reducers if m.peer_id != hostile]
        for i in range(3):
            assert hostile in results[i].failed_peers
            for shard, parts in results[i].part_contributors.items():
                assert group.reducers[shard].peer_id == hostile or all(hostile not in part for part in parts)
            verdicts = {reducer: verdict for reducer, verdict in results[i].reducer_checks.values()}
            assert set(verdicts) == {m.peer_id for m in group.reducers} - {peers[i].host.peer_id}
            assert all(verdicts[r] is None for r in honest if r != peers[i].host.peer_id), verdicts
            # (as a reducer it states its own parts under signatures that do not match them)
            assert set(peers[i].service.checks.banned.until) <= {hostile}
        nursery.cancel_scope.cancel()


async def test_a_checked_round_verifies_each_commitment_once_per_peer(monkeypatch):
    """Every peer meets each other sender's commitment as a reducer and again in each of its
    checks: it verifies the signature once (``VerifiedSignatures``), not once per check input."""
    import averaging.commitments

    calls = []
    real = averaging.commitments.verify_signature

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(averaging.commitments, "verify_signature", counted)
    async with trio.open_nursery() as nursery:
        peers = await start_with_liar(nursery, 4, liar=-1)
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(4)]
        results = {}
        await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip")
        for i in range(4):
            assert results[i].succeeded and len(results[i].reducer_checks) == 3
            assert all(verdict is None for _reducer, verdict in results[i].reducer_checks.values())
        # each of 4 peers, the 3 others' commitments (its own it never verifies)
        assert len(calls) == 4 * 3
        nursery.cancel_scope.cancel()


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
