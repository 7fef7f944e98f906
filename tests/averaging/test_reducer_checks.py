"""Reducer checks in real rounds (``averaging/reducer_checks.py``, the trio side): a reducer that
lies about its shard is caught by the senders that check it, banned, and left out of their groups;
honest reducers pass every check. How one answer is judged is in ``test_verification.py``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from averaging.allreduce import AllReduceService
from averaging.averager import GroupAverager
from averaging.compression import get_codec
from averaging.matchmaking import MatchmakingError
from averaging.reducer_shard import ReducerShard
from averaging.sparse_codec import CHUNK, kept_per_chunk
from averaging.verification import (
    UNANSWERED_BAN_SECONDS,
    KeptInputs,
)
from peer import Identity, PeerID, open_peer_host
from tests.averaging.test_allreduce import flat, make_group, random_tensors, run_round
from tests.averaging.test_matchmaking import open_swarm, step_all
from tests.support.hostile_reducers import CensoringShard, LyingShard, fabricating_service, lying_service


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
    from tests.averaging.test_allreduce import Peer

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
            assert checks.banned.until[liar] - checks.banned.clock() > UNANSWERED_BAN_SECONDS  # a liar's ban
            # the lie never reached our values: that shard kept them
            assert results[i].local_shards[shard] == f"reducer failed its check: {verdicts[liar]}"
            assert round_.kept_own_values(i)
        nursery.cancel_scope.cancel()


class HalvingShard(LyingShard):
    """A quiet liar: half the aggregate (each kept value at its place, only smaller)."""

    def lie(self, averaged: torch.Tensor) -> torch.Tensor:
        return averaged * 0.5


class RunnerUpShard(LyingShard):
    """Keeps the aggregate's values, but each chunk's runners-up instead of its largest."""

    def lie(self, averaged: torch.Tensor) -> torch.Tensor:
        lie = averaged.clone()
        for start in range(0, lie.numel(), CHUNK):
            chunk = lie[start : start + CHUNK]
            chunk[torch.topk(chunk.abs(), kept_per_chunk(chunk.numel())).indices] = 0.0
        return lie


class NudgingShard(LyingShard):
    """Each of the aggregate's largest values moved by a fifth of itself, up or down at random."""

    def lie(self, averaged: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, averaged.shape, generator=torch.Generator().manual_seed(5)) * 2 - 1
        return averaged * (1 + 0.2 * signs)


class DenseReplyShard(ReducerShard):
    """Replies with its true aggregate, but whole, in float32 (95x the bytes of a sparse reply)."""

    def reply_next(self, codec) -> None:
        super().reply_next(get_codec("none"))


async def test_a_sparse_rounds_reply_in_another_codec_is_refused_on_arrival():
    numel = CHUNK + 300
    async with trio.open_nursery() as nursery:
        make_odd_one = lambda host: AllReduceService(host, shard_type=DenseReplyShard)  # noqa: E731
        peers = await start_with_liar(nursery, 4, liar=3, make_liar=make_odd_one)
        group, results = make_group(peers), {}
        tensors = [[torch.randn(numel, generator=torch.Generator().manual_seed(i))] for i in range(4)]
        await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", codec="topk_2bit")
        shard = [m.peer_id for m in group.reducers].index(peers[3].host.peer_id)
        for i in range(3):
            assert "replied in none, not topk_8bit" in results[i].local_shards[shard], results[i].local_shards
        nursery.cancel_scope.cancel()


SPARSE_LIES = {"flipped": LyingShard, "halved": HalvingShard, "runners-up": RunnerUpShard, "nudged": NudgingShard}


@pytest.mark.parametrize("lie", list(SPARSE_LIES))
async def test_a_sparse_reply_is_checked_for_the_values_it_keeps_and_for_their_choice(lie):
    """With a sparse codec a reducer replies with the largest of each chunk of its aggregate, in 8
    bits: a checking sender bounds which values it kept as well as their rounding. Quiet lies are
    caught, honest sparse replies (the three other reducers') pass."""
    numel = 3 * CHUNK + 700
    async with trio.open_nursery() as nursery:
        make_liar = lambda host: AllReduceService(host, shard_type=SPARSE_LIES[lie])  # noqa: E731
        peers = await start_with_liar(nursery, 4, liar=3, make_liar=make_liar)
        liar, group, results = peers[3].host.peer_id, make_group(peers), {}
        generator = torch.Generator().manual_seed(3)
        tensors = [[torch.randn(numel, generator=generator)] for _ in range(4)]
        options = dict(aggregation="centered-clip", codec="topk_2bit", part_size=2 * CHUNK)
        await run_round(peers, group, tensors, [1.0] * 4, results, sender_timeout=10.0, reducer_timeout=20.0, **options)
        shard = [m.peer_id for m in group.reducers].index(liar)
        for i in range(3):
            verdicts = {reducer: verdict for reducer, verdict in results[i].reducer_checks.values()}
            assert all((verdict is not None) == (reducer == liar) for reducer, verdict in verdicts.items()), verdicts
            assert "unanswered" not in verdicts[liar], verdicts[liar]
            # the caught shard applies nothing (error feedback keeps our contribution owed), not our
            # whole contribution, as a dense round's local values are
            start, end = results[i].plan.shard_bounds(shard)
            assert not tensors[i][0][start:end].any()
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
            left = checks.banned.until[forgetful] - checks.banned.clock()
            assert 0 < left <= UNANSWERED_BAN_SECONDS, left
            assert "unanswered" in results[i].local_shards[shard]
            assert round_.kept_own_values(i)  # its shard unused
            # a lie found later bans it for long, and an unanswered check cannot shorten that
            checks.banned.ban(forgetful, "lied")
            checks.banned.ban(forgetful, "no answer", UNANSWERED_BAN_SECONDS)
            assert checks.banned.until[forgetful] - checks.banned.clock() > UNANSWERED_BAN_SECONDS
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
        banned = [a.all_reduce.checks.banned for a in averagers[:3]]
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


async def honest_checked_round(nursery, **options):
    """A centered-clip round of 4 honest peers, in which every peer checks the 3 other reducers and
    every check holds; returns the peers and the group."""
    peers = await start_with_liar(nursery, 4, liar=-1)
    group = make_group(peers)
    tensors = [random_tensors(i) for i in range(4)]
    results = {}
    await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", **options)
    for i in range(4):
        assert results[i].succeeded, results[i]
        assert len(results[i].reducer_checks) == 3
        verdicts = [verdict for _reducer, verdict in results[i].reducer_checks.values()]
        assert all(verdict is None for verdict in verdicts), verdicts
    return peers, group


@pytest.mark.parametrize("codec", ["float16", "uint8", "blockwise_8bit", "topk_2bit", "topk_4bit"])
async def test_honest_reducers_pass_their_checks_with_lossy_codecs(codec):
    """With a sparse codec a reducer's answer states every input, its own too, in the codec's few
    bytes: its own row as float32 made a check cost 30x the round's traffic."""
    async with trio.open_nursery() as nursery:
        peers, group = await honest_checked_round(nursery, codec=codec)
        if get_codec(codec).sparse:
            answer = peers[0].service.checks.kept.answer(group.group_id, 0, peers[1].host.peer_id, trio.current_time())
            size = get_codec(codec).payload_size(answer.values.shape[1])
            assert [len(answer.row_payload(row)) for row in range(4)] == [size] * 4
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
        await honest_checked_round(nursery)
        # each of 4 peers, the 3 others' commitments (its own it never verifies)
        assert len(calls) == 4 * 3
        nursery.cancel_scope.cancel()


async def test_a_check_answer_in_a_real_round_carries_only_what_its_asker_lacks(monkeypatch):
    """Every peer of a 4-peer checked round reduces, so it holds every sender's commitment: each
    answer it gets carries the 3 other senders' inputs and nothing else (its own input and the
    commitments were a third of an answer's bytes, sent back to the peer that had them)."""
    from averaging.part_inputs import PartInputs

    answers = []
    real = PartInputs.to_message

    def recorded(self, *args, **kwargs):
        body, payload = real(self, *args, **kwargs)
        answers.append((self.values.shape, body, len(payload)))
        return body, payload

    monkeypatch.setattr(PartInputs, "to_message", recorded)
    async with trio.open_nursery() as nursery:
        await honest_checked_round(nursery)
        assert len(answers) == 4 * 3
        for (senders, part_size), body, size in answers:
            assert senders == 4 and size == 3 * 4 * part_size
            assert body["commit_sizes"] == [0] * 4 and body["metas"].count(None) == 1
        nursery.cancel_scope.cancel()


async def test_what_a_reducer_keeps_for_checks_holds_none_of_the_parts_it_sent_to_others():
    """The inputs kept for ``KEEP_SECONDS`` reach our own parts' encodings (a sparse codec's), never
    the encodings of everything we sent the other reducers: one more copy of the vector per round."""
    import gc

    from peer import PeerID as Peer

    def reachable(root, depth: int = 6):
        seen, frontier = set(), [root]
        for _ in range(depth):
            found = []
            for obj in frontier:
                for child in gc.get_referents(obj):
                    if id(child) not in seen and not isinstance(child, (type, type(gc))):
                        seen.add(id(child))
                        found.append(child)
            frontier = found
            yield from found

    async with trio.open_nursery() as nursery:
        peers = await start_with_liar(nursery, 4, liar=-1)
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(4)]
        await run_round(peers, group, tensors, [1.0] * 4, {}, aggregation="centered-clip", codec="topk_2bit")
        me = peers[0].host.peer_id
        sent_elsewhere = [
            obj
            for obj in reachable(peers[0].service.checks.kept)
            if isinstance(obj, dict)
            and any(isinstance(key, tuple) and key and isinstance(key[0], Peer) and key[0] != me for key in obj)
        ]
        assert sent_elsewhere == []
        nursery.cancel_scope.cancel()


async def test_a_reducer_that_keeps_leaving_us_out_unjustly_is_left_out_of_our_groups_briefly():
    """One unjust exclusion now and then costs nothing (an honest reducer drops a sender whose
    link to it failed), and rounds that take us in forgive it; a reducer that leaves us out two
    rounds in three, never three in a row, reaches EXCLUSION_POINTS all the same and is left out
    of our groups for the short spell an unanswered check earns."""
    async with open_peer_host(Identity.generate()) as host:
        checks = AllReduceService(host).checks
        honest, censor = (Identity.generate().peer_id for _ in range(2))
        for _ in range(12):  # the honest one: one round in five
            checks.note_exclusions([honest], [censor])
            for _ in range(4):
                checks.note_exclusions([], [honest, censor])
        assert not checks.exclusions and honest not in checks.banned
        rounds = 0
        while censor not in checks.banned:
            rounds += 1
            assert rounds <= 9, checks.exclusions
            checks.note_exclusions([censor] if rounds % 3 else [], [honest] if rounds % 3 else [honest, censor])
        assert honest not in checks.banned
        left = checks.banned.until[censor] - checks.banned.clock()
        assert 0 < left <= UNANSWERED_BAN_SECONDS and "round after round" in checks.banned.reasons[censor]


async def test_a_reducer_that_leaves_honest_senders_out_as_if_they_stalled_sets_nobodys_average():
    """The censor (peer 3) leaves peers 0 and 1 out of its shard from the start, though every
    other reducer takes them in: its average (its own contribution and peer 2's) would be its to
    set. Every honest peer keeps its own values for that shard (the two it left out see their
    parts refused; peer 2, whom it took in, sees two senders left out whom the others took in),
    nobody honest is banned, and the other shards average as ever."""
    victims: set = set()

    def censor(host):
        return AllReduceService(host, shard_type=partial(CensoringShard, victims=victims))

    async with trio.open_nursery() as nursery:
        peers = await start_with_liar(nursery, 4, liar=3, make_liar=censor)
        victims.update(peer.host.peer_id for peer in peers[:2])
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(4)]
        before = [flat(t).clone() for t in tensors]
        results: dict = {}
        await run_round(peers, group, tensors, [1.0] * 4, results, aggregation="centered-clip", reducer_timeout=20.0)
        nursery.cancel_scope.cancel()
    censor_id = peers[3].host.peer_id
    shard = [m.peer_id for m in group.reducers].index(censor_id)
    start, end = results[0].plan.shard_bounds(shard)
    for i in range(3):
        assert list(results[i].local_shards) == [shard], results[i].local_shards
        assert torch.equal(flat(tensors[i])[start:end], before[i][start:end])
        assert not any(peer in peers[i].service.checks.banned for peer in [p.host.peer_id for p in peers[:3]])
    assert "left out 2 senders" in results[2].local_shards[shard]
