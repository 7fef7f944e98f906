"""The trio side of reducer checks (``verification.py``): the sender picks a part before its
round writes the averages back, asks the reducer once the round is over, and bans a liar; the
reducer keeps its inputs and answers.

Whether a round is checked is its strategy, chosen once as it starts (``ReducerChecks.strategy``):
a ``PlainRound`` does nothing of this; a ``CheckedRound`` commits to every part it sends before
the first goes out, has its reducer take only committed parts and keep its inputs, and checks the
other reducers before their averages are written back."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import trio

from peer import Message, PeerHost, PeerID, Request, Router, RPCError

from .commitments import Commitment, SignedPart, VerifiedSignatures, commit, part_digest
from .compression import Codec, codec_of, get_codec
from .group import GroupInfo, GroupMember
from .part_inputs import held_fingerprints
from .partition import AllReducePlan
from .reducer_shard import ReducerShard, ShardSigning
from .robust import Aggregation
from .round_roles import in_thread
from .round_state import AllReduceRound
from .verification import (
    CHECK_METHOD,
    CHECK_TIMEOUT,
    MAX_BANNED,
    UNANSWERED_BAN_SECONDS,
    BanList,
    KeptInputs,
    PartCheck,
    PartInputs,
)

__all__ = [
    "CheckedRound",
    "PendingCheck",
    "PlainRound",
    "Prepared",
    "ReducerChecks",
    "RoundStrategy",
    "CHECK_SHARE",
    "CHECK_ALL_BELOW",
    "EXCLUSION_POINTS",
    "FORGIVEN_PER_ROUND",
]

log = logging.getLogger("peerd.averaging")

# A check of a reducer's part makes it upload that part's inputs (group size x part size) again;
# its round uploads (senders - 1) x its shard. Each sender checks a reducer with the probability
# that keeps what all checks cost it, in expectation, to this share of its round's upload: for a
# shard of k parts that is k / (4 x senders), every time from 4 x senders parts on. (Half the
# upload made a 16M-value round on loopback cost 2x the mean's CPU; a quarter is the trade made
# here between that cost and how many rounds a liar's answers are used before it is caught.)
CHECK_SHARE = 0.25
# Vectors this light on the wire, in the round's codec: every sender checks every reducer (a round
# costs more in fixed costs than the whole vector's bytes), so a lie is caught in its first round
# and used by nobody. (256 KiB: 64K float32 values, or textlm small's 1.9 M values in a sparse
# codec, whose shards now go in one part each: ``partition.MIN_PART_BYTES``.)
CHECK_ALL_BELOW = 1 << 18
# A reducer that leaves our contribution out while the other reducers take it in whole
# (``AllReduceRound.unjust_exclusions``) earns a point, and each round in which it takes us in
# takes a quarter of one back; at EXCLUSION_POINTS it is left out of our groups for
# UNANSWERED_BAN_SECONDS. An honest one does so only while our link to it fails (one bad round is no
# reason to part, and once our links are healthy it is forgiven), while one that leaves us out on
# purpose more than one round in five stops being given the chance, in a row or not.
EXCLUSION_POINTS = 3.0
FORGIVEN_PER_ROUND = 0.25


@dataclass
class PendingCheck:
    reducer: GroupMember
    group_id: bytes
    part: int  # index within the reducer's shard
    senders: int  # the group's senders: at most this many inputs
    check: PartCheck


def _as_sent(codec: Codec, values: torch.Tensor) -> torch.Tensor:
    """``values`` as a reducer decodes them from what we send (a copy)."""
    if codec.encodes_as_view:
        return values.clone()
    meta, payload = codec.encode_finite(values)
    out = torch.empty(values.numel(), dtype=torch.float32)
    decoded = codec_of(meta).decode_into(meta, payload, out)
    return decoded if decoded is out else decoded.clone()


def _requantizer(codec: Codec):
    if codec.encodes_as_view:
        return None

    def requantize(values: torch.Tensor) -> torch.Tensor:
        meta, payload = codec.encode(values)
        return codec_of(meta).decode_into(meta, payload, torch.empty_like(values)).clone()

    return requantize


# A check over at most this many values (inputs x part size) runs on the event loop: a worker
# thread's hop costs more than its work (a tiny model's round makes one check per reducer per
# sender), and a check is a few passes over them (decoding, digests, CenteredClip): ~1 ms at most.
CHECK_INLINE_LIMIT = 1 << 16


async def _inline_if_small(numel: int, fn, *args):
    """``fn(*args)`` on the event loop for a check of a small part, else in a worker thread."""
    if numel <= CHECK_INLINE_LIMIT:
        return fn(*args)
    return await in_thread(fn, *args)


def _draw(probability: float) -> bool:
    """True with ``probability``, from private randomness (a reducer must not guess our checks)."""
    return probability >= 1 or secrets.randbelow(1 << 30) < probability * (1 << 30)


def max_part(shard: list[tuple[int, int, int, int]]) -> int:
    return max(end - start for *_, start, end in shard)


class ReducerChecks:
    """One host's checks: the inputs its reductions keep, the checks its rounds make, and the
    peers it caught (``banned``; matchmaking leaves them out)."""

    def __init__(self, host: PeerHost, router: Router, kept: KeptInputs | None = None):
        """``kept``: where this host's reductions keep their inputs (tests substitute hostile ones)."""
        self.host = host
        self.kept = kept if kept is not None else KeptInputs()
        self.banned = BanList(clock=trio.current_time)
        self.caught = 0  # reducers this peer has caught lying
        self.passed = 0  # checks whose answer held
        self.verified = VerifiedSignatures()  # commitments verified lately, as reducer or checker
        self.exclusions: dict[PeerID, float] = {}  # points of reducers that left us out unjustly
        router.add_unary(CHECK_METHOD, self._handle_check)

    async def _handle_check(self, request: Request) -> Message:
        body = request.body if isinstance(request.body, dict) else {}
        held = held_fingerprints(body.get("held"))
        inputs = self.kept.answer(body.get("group_id"), body.get("part"), request.peer, trio.current_time())
        answer, payload = await _inline_if_small(inputs.values.numel(), inputs.to_message, request.peer, held)
        return Message(answer, payload)

    def note_exclusions(self, unjust: list[PeerID], took_us: list[PeerID]) -> None:
        """Count the reducers that left us out of a round's averages unjustly and forgive those
        whose averages took us in (``EXCLUSION_POINTS``); leave out of our groups one whose points
        reach the limit."""
        for reducer in took_us:
            points = self.exclusions.pop(reducer, 0.0) - FORGIVEN_PER_ROUND
            if points > 0:
                self.exclusions[reducer] = points
        for reducer in unjust:
            points = self.exclusions.pop(reducer, 0.0) + 1.0
            if points < EXCLUSION_POINTS:
                if len(self.exclusions) >= MAX_BANNED:  # bounded against Sybils: forget the oldest
                    del self.exclusions[next(iter(self.exclusions))]
                self.exclusions[reducer] = points
                continue
            reason = "it left our contribution out, which the other reducers took in, round after round"
            self.banned.ban(reducer, reason, UNANSWERED_BAN_SECONDS)
            log.warning("reducer %s left out of our groups for %g s: %s", reducer, UNANSWERED_BAN_SECONDS, reason)

    def commit(
        self, group: GroupInfo, plan: AllReducePlan, flat: torch.Tensor, weight: float, codec: Codec
    ) -> tuple[Commitment, dict[tuple[PeerID, int], tuple[Any, Any]]]:
        """Encode every part we send in a checked round and commit to them all (``commitments.py``;
        tensor work): returns the commitment and the encoded parts, by (reducer, part index). Our
        own shard is committed to as float32, as our checks' answers state it; with a sparse codec,
        encoded as the other senders' parts are (what we add is ``sparse_codec.as_sent``), and those
        encodings are returned too, so that our answers state our row in its few bytes, not as
        float32 of mostly zeros."""
        me, plain = self.host.peer_id, get_codec("none")
        encoded: dict[tuple[PeerID, int], tuple[Any, Any]] = {}
        shards = []
        for index, member in enumerate(group.reducers):
            if not plan.shard_sizes[index]:
                continue
            own = member.peer_id == me
            digests = []
            for part, (start, end) in enumerate(plan.parts(index)):
                meta, payload = (plain if own and not codec.sparse else codec).encode_finite(flat[start:end])
                if not own or codec.sparse:
                    encoded[(member.peer_id, part)] = (meta, payload)
                digests.append(part_digest(meta, payload))
            shards.append((member.peer_id, digests))
        return commit(self.host.identity, group.group_id, float(weight), shards), encoded

    def strategy(self, aggregation: Aggregation, check: bool | None = None) -> RoundStrategy:
        """How a round with ``aggregation`` is checked: with CenteredClip by default (which the
        checks recompute), never with the mean. Like the aggregation this is the swarm's setting:
        a reducer that keeps no inputs fails a checking peer's checks."""
        robust = aggregation.robust
        if check and not robust:
            raise ValueError(f"reducer checks recompute CenteredClip: a round of {aggregation.value} cannot be checked")
        return CheckedRound(self, aggregation) if robust and check is not False else PlainRound()

    def keep(self, group: GroupInfo, shard: ReducerShard, prepared: Prepared | None = None) -> None:
        """Keep what ``shard`` aggregates, part by part, for the senders' checks (call as the
        round starts, and again as it ends to keep them ``KEEP_SECONDS`` from then); ``prepared``:
        our commitment to our own contribution (and, with a sparse codec, its parts as encoded)."""

        identity = self.host.identity
        plain = get_codec("none")
        commitment = prepared.commitment if prepared is not None else None
        # our own parts alone (a sparse codec's encodings of them): the closure below is kept for
        # KEEP_SECONDS, and the other reducers' parts would stay alive with it
        own = prepared.mine(identity.peer_id) if prepared is not None else {}

        def inputs(index: int) -> PartInputs | None:
            kept = shard.inputs_of(index)
            if kept is None or not kept.senders:
                return None
            signed = list(kept.signed)
            for row, sender in enumerate(kept.senders):
                if signed[row] is None and sender == identity.peer_id and commitment is not None:
                    sparse = own.get(index)  # our part as a sparse codec encoded it
                    meta, payload = sparse if sparse is not None else (plain.encode_finite(kept.values[row])[0], None)
                    signed[row] = SignedPart(commitment, meta, payload)  # (payload None: float32 as kept)
            senders = list(kept.senders)
            return PartInputs(
                senders, kept.weights, kept.values, kept.tau, kept.aggregation, kept.start, signed, kept.neighbours
            )

        senders = [m.peer_id for m in group.senders]
        self.kept.keep(group.group_id, senders, inputs, trio.current_time(), shard.kept_values)

    def pick(
        self,
        group: GroupInfo,
        plan: AllReducePlan,
        flat: torch.Tensor,
        weight: float,
        received: list[tuple[int, torch.Tensor]],
        part_contributors: dict[int, list[list[PeerID]]],
        codec: Codec,
        reply_codec: Codec,
        aggregation: Aggregation,
        held: dict[PeerID, Commitment] | None = None,
    ) -> list[tuple[int, PendingCheck]]:
        """Choose, in private, one part of each other reducer's shard that we received (each
        reducer with the probability ``CHECK_SHARE`` gives it), and copy what each check will
        need (call before the averages are written back into ``flat``): we sent with ``codec``,
        the reducers reply with ``reply_codec``, and must aggregate by ``aggregation``, the round's
        rule; ``held``: this round's commitments we hold (ours, and those we met as a reducer),
        which the answers leave out. Returns (shard, check) pairs."""
        me = self.host.peer_id
        by_start = dict((start, values) for start, values in received)
        shards: list[list[tuple[int, int, int, int]]] = []
        for index, member in enumerate(group.reducers):
            if member.peer_id == me or index not in part_contributors:
                continue
            parts = [
                (part, start, end)
                for part, (start, end) in enumerate(plan.parts(index))
                if start in by_start and part < len(part_contributors[index])
            ]
            if parts:
                shards.append([(index, *part) for part in parts])
        if not shards:
            return []
        senders = len(group.senders)
        if codec.payload_size(plan.total) > CHECK_ALL_BELOW:
            shards = [
                shard
                for shard in shards
                if _draw(CHECK_SHARE * sum(end - start for *_, start, end in shard) / (senders * max_part(shard)))
            ]
        pending = []
        for shard in shards:
            index, part, start, end = shard[secrets.randbelow(len(shard))]
            check = PartCheck(
                me,
                group.reducers[index].peer_id,
                _as_sent(codec, flat[start:end]),
                float(weight),
                list(part_contributors[index][part]),
                by_start[start].clone(),
                None if reply_codec.sparse else _requantizer(reply_codec),
                group.group_id,
                part,
                self.verified,
                reply_codec.sparse,
                aggregation,
                held or {},
            )
            pending.append(
                (index, PendingCheck(group.reducers[index], group.group_id, part, len(group.senders), check))
            )
        return pending

    async def run_all(self, pending: list[tuple[int, PendingCheck]]) -> dict[int, tuple[PeerID, str | None]]:
        """Run the checks at once; shard index -> (its reducer, why it was caught or None)."""
        verdicts: dict[int, tuple[PeerID, str | None]] = {}

        async def one(index: int, check: PendingCheck) -> None:
            verdicts[index] = (check.reducer.peer_id, await self.run(check))

        async with trio.open_nursery() as nursery:
            for index, check in pending:
                nursery.start_soon(one, index, check)
        return verdicts

    async def run(self, pending: PendingCheck) -> str | None:
        """Ask the reducer for the part's inputs and judge its answer; a liar is banned. Returns
        why it was caught, or None."""
        reducer = pending.reducer
        verdict: str | None = f"it did not answer the check within {CHECK_TIMEOUT:g} s"
        answered = False
        with trio.move_on_after(CHECK_TIMEOUT) as waiting:
            try:
                assert reducer.address is not None
                holds = pending.check.holds()
                ask = {"group_id": pending.group_id, "part": pending.part, "held": holds.request()}
                reply = await self.host.call(reducer.address, CHECK_METHOD, ask)
            except (OSError, RPCError) as error:  # no answer: unreachable, or it refused
                verdict = f"its check went unanswered: {type(error).__name__}: {error}"
            else:
                answered = True
                try:
                    parse, numel = PartInputs.parse, pending.check.reply.numel()
                    work = numel * pending.senders
                    answer = (reply.body, reply.payload, numel, pending.senders, holds)
                    inputs = await _inline_if_small(work, parse, *answer)
                    verdict = await _inline_if_small(work, pending.check.verdict, inputs)
                except Exception as error:  # noqa: BLE001 (any failure of its answer is the reducer's)
                    verdict = f"its check answer failed: {type(error).__name__}: {error}"
        if verdict is None:
            self.passed += 1
            return None
        if answered and not waiting.cancelled_caught:  # (a check we could not finish judging proves nothing)
            self.caught += reducer.peer_id not in self.banned
            self.banned.ban(reducer.peer_id, verdict)
            log.warning("reducer %s caught and banned: %s", reducer.peer_id, verdict)
        else:
            seconds = UNANSWERED_BAN_SECONDS
            self.banned.ban(reducer.peer_id, verdict, seconds)
            log.warning("reducer %s left out of our groups for %g s: %s", reducer.peer_id, seconds, verdict)
        return verdict


@dataclass(frozen=True)
class Prepared:
    """What a round prepares before its first part goes out: in a checked round, our commitment
    to our parts and the parts, encoded, by (reducer, part index)."""

    commitment: Commitment | None = None
    parts: dict[tuple[PeerID, int], tuple[Any, Any]] | None = None

    def mine(self, me: PeerID) -> dict[int, tuple[Any, Any]]:
        """Our own parts' encodings (a sparse codec's, in a checked round), by part index."""
        return {index: part for (peer, index), part in (self.parts or {}).items() if peer == me}

    @property
    def wire_commitment(self) -> Any:
        """The commitment as the stream headers carry it (None: no commitment)."""
        return None if self.commitment is None else self.commitment.to_wire()


class RoundStrategy(Protocol):
    """What a round does about reducer checks, at its four moments: before its first part goes
    out (``prepare``), as its reducer's shard is made (``shard_signing``), once that shard is
    announced and again as it ends (``keep``), and before the averages are written back
    (``review``)."""

    async def prepare(self, group: GroupInfo, plan: AllReducePlan, flat, weight: float, codec: Codec) -> Prepared: ...

    def shard_signing(self, group: GroupInfo, me: PeerID) -> ShardSigning | None: ...

    def keep(self, group: GroupInfo, shard: ReducerShard, prepared: Prepared) -> None: ...

    async def review(self, round_: AllReduceRound, flat, weight: float, codec: Codec) -> None: ...

    def reply_codec(self, codec: Codec) -> Codec:
        """What our reducer replies with when the senders send with ``codec``."""
        ...


class PlainRound:
    """A round nobody checks: nothing is committed to, kept, or checked."""

    async def prepare(self, group: GroupInfo, plan: AllReducePlan, flat, weight: float, codec: Codec) -> Prepared:
        return Prepared()

    def shard_signing(self, group: GroupInfo, me: PeerID) -> ShardSigning | None:
        return None

    def keep(self, group: GroupInfo, shard: ReducerShard, prepared: Prepared) -> None:
        pass

    async def review(self, round_: AllReduceRound, flat, weight: float, codec: Codec) -> None:
        pass

    def reply_codec(self, codec: Codec) -> Codec:
        return codec.reply_codec(checked=False)


class CheckedRound:
    """A round whose reducers are checked (``verification.py``): every part we send is committed
    to, our reducer takes only committed parts and keeps its inputs, and before we use the other
    reducers' averages we check some of them, and believe only those that hold."""

    def __init__(self, checks: ReducerChecks, aggregation: Aggregation):
        self.checks = checks
        self.aggregation = aggregation  # the round's rule: a reducer that answers by another is lying
        # this round's commitments we hold, by sender (ours, and those our reducer accepted): the
        # checks' answers leave them out
        self.held: dict[PeerID, Commitment] = {}
        self._shard: ReducerShard | None = None

    async def prepare(self, group: GroupInfo, plan: AllReducePlan, flat, weight: float, codec: Codec) -> Prepared:
        if flat is None:  # we send nothing: nothing to commit to
            return Prepared()
        prepared = Prepared(*await in_thread(self.checks.commit, group, plan, flat, weight, codec))
        if prepared.commitment is not None:
            self.held[self.checks.host.peer_id] = prepared.commitment
        return prepared

    def shard_signing(self, group: GroupInfo, me: PeerID) -> ShardSigning | None:
        return ShardSigning(group.group_id, me, self.checks.verified)

    def keep(self, group: GroupInfo, shard: ReducerShard, prepared: Prepared) -> None:
        self.checks.keep(group, shard, prepared)
        self._shard = shard

    def reply_codec(self, codec: Codec) -> Codec:
        return codec.reply_codec(checked=True)

    async def review(self, round_: AllReduceRound, flat, weight: float, codec: Codec) -> None:
        """Check the other reducers whose averages we received (before they are written back into
        ``flat``), and tell the round each verdict."""
        if flat is None:
            return
        unjust = round_.unjust_exclusions()
        self.checks.note_exclusions(unjust, round_.took_us_in())
        received, contributors = round_.received(), round_.part_contributors()
        pending = self.checks.pick(
            round_.group, round_.plan, flat, weight, received, contributors, codec, self.reply_codec(codec),
            self.aggregation, self.held | (self._shard.commitments if self._shard is not None else {}),
        )  # fmt: skip
        for index, (reducer, verdict) in (await self.checks.run_all(pending)).items():
            round_.checked(index, reducer, verdict)
