"""Fault-tolerant butterfly all-reduce over the peer RPC.

Every sender streams the slice of its flattened tensors that belongs to reducer ``r`` to ``r``
(reduce-scatter); each reducer averages its shard part by part, and streams each part's average
back to every sender on the same stream as soon as every sender still in the round has delivered
that part (all-gather), so both run at once and the links stay busy. Shards follow the reducers'
declared bandwidths (``partition.py``), so a peer on a slow link reduces little and the round goes
at the fast peers' pace.

Deadlines follow the bytes, not fixed seconds (``link_speed.py``): a reducer keeps waiting for a
sender while its bytes keep arriving, however slow its link; a sender that delivers nothing for a
stall interval, or whose connection dies or is refused, is dropped (at once for a lost
connection): it is in the parts averaged before that and in no other, and the result says per
part whose contributions its average holds (``AllReduceResult.part_contributors``). A sender gives
up on a reducer that stops taking its parts or stops answering; that shard keeps the sender's
own values. Every wait is also capped: by what the peer could owe at a floor rate, and by
``sender_timeout`` / ``reducer_timeout`` where a caller sets them. ``AllReduceResult`` says what
happened, and how fast this peer's link moved the round's bytes (``link_rate``): the averager
declares that as its bandwidth in the next round.

A reducer aggregates its shard with the weighted mean or, robust to a hostile minority, with
CenteredClip (``robust.py``); after a CenteredClip round each sender checks other reducers' answers
before it uses them (``verification.py``, ``reducer_checks.py``).

The messages and what each side does with them are sans-I/O objects in ``allreduce_protocol.py``
and ``reducer_shard.py``; what became of each shard and each sender, and the result, is the
round's own table (``round_state.AllReduceRound``), its one writer. Here ``AllReduceService.run``
only drives a round: it moves bytes and time for two small trio roles (``round_roles.py``),
``ReducerRole`` (one shard's reduction, fed by a handler per sender stream) and ``SenderRole``
(one exchange per reducer), watched by the round's ``RoundLinks``, and tells the round what
happened. Whether the round is checked is its strategy (``reducer_checks.PlainRound`` or
``CheckedRound``). Buffers come from a per-service pool under leases (``part_buffers.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import trio

from peer import PeerHost, Router
from peer.tensors import all_finite

from .allreduce_protocol import MAX_PART_MESSAGE, REDUCE_METHOD, AllReduceError, ReduceHeader, RoundOver
from .compression import Codec, get_codec
from .contribution_scores import ContributionScores, ShardAlignment
from .flat_parts import flat_view, flatten, write_back
from .group import GroupInfo
from .link_speed import DeadlineRules
from .own_radius import MIN_OUTVOTING, bound_move, bound_sparse_move
from .part_buffers import BufferLease, PartBuffers, PartSink
from .partition import DEFAULT_PART_SIZE, AllReducePlan, bytes_per_value
from .reducer_checks import ReducerChecks, RoundStrategy
from .reducer_shard import ReducerShard
from .robust import Aggregation
from .round_links import ConnectionCaps, RoundLinks
from .round_roles import INLINE_WORK_LIMIT, ReducerRole, SenderRole, in_thread, tensor_work_limiter
from .round_state import AllReduceResult, AllReduceRound
from .sparse_codec import as_sent
from .uplink import UploadFigures, uplink_shares
from .verification import BAN_SECONDS, KeptInputs

__all__ = [
    "AllReduceService",
    "AllReduceResult",
    "AllReduceError",
    "RoundSettings",
    "INLINE_WORK_LIMIT",
    "tensor_work_limiter",
]

log = logging.getLogger("peerd.averaging")

# How long a reducer's handler waits for its own round to start: the leader's announcement can
# reach a follower a little after another follower has started sending to it.
ROUND_WAIT = 5.0
# Group IDs of rounds that ended (or were cancelled) on this peer, so that a stream arriving late
# for one is refused at once instead of waiting ROUND_WAIT for a round that will not come again.
# A peer runs a round every few seconds at most; this many cover hours of rounds in 16 KiB.
FINISHED_ROUNDS_KEPT = 1024
DEFAULT_DEADLINES = DeadlineRules()
# A leader that reuses a live group ID gets its second round refused with this.
DUPLICATE_GROUP_ID = "another round on this peer already uses this group ID"


@dataclass(frozen=True)
class RoundSettings:
    """How a round runs (the swarm's settings, the same on every member).

    ``deadlines`` says how long to wait for a peer whose bytes stop coming (``link_speed.py``);
    ``sender_timeout`` and ``reducer_timeout``, if set, cap in seconds how long a reducer waits
    for a sender and a sender for a reducer, whatever their progress. ``aggregation``: how our
    shard, if we reduce one, is aggregated from the senders' parts (``robust.py``);
    ``check_reducers``: whether to check the other reducers before using their averages
    (``verification.py``; default: with centered-clip, which the checks recompute; never with
    the mean). ``uplink``: this peer's uplink in bytes/s, if known: the round's connections are
    paced to share it (``uplink.py``)."""

    codec: str | Codec = "none"
    sender_timeout: float | None = None
    reducer_timeout: float | None = None
    part_size: int = DEFAULT_PART_SIZE
    deadlines: DeadlineRules = DEFAULT_DEADLINES
    aggregation: Aggregation | str = Aggregation.MEAN
    check_reducers: bool | None = None
    uplink: float | None = None

    def __post_init__(self) -> None:
        # A part goes in one stream message, which a reducer accepts up to MAX_PART_MESSAGE.
        if not 0 < self.part_size <= MAX_PART_MESSAGE // 4 - 1024:
            raise ValueError(f"part_size must be 1..{MAX_PART_MESSAGE // 4 - 1024} values, got {self.part_size}")

    @property
    def sender_rules(self) -> DeadlineRules:
        """How long our reducer waits for a sender."""
        return dataclasses.replace(self.deadlines, cap=_tighter(self.deadlines.cap, self.sender_timeout))

    @property
    def reducer_rules(self) -> DeadlineRules:
        """How long we wait for a reducer."""
        return dataclasses.replace(self.deadlines, cap=_tighter(self.deadlines.cap, self.reducer_timeout))


DEFAULTS = RoundSettings()


class AllReduceService:
    """Serves ``avg.reduce`` for every all-reduce this peer takes part in."""

    def __init__(
        self,
        host: PeerHost,
        router: Router | None = None,
        *,
        shard_type: Callable[..., ReducerShard] = ReducerShard,
        kept: KeptInputs | None = None,
    ):
        """``shard_type``: what reduces our shard, ``kept``: where it keeps its inputs for the
        checks (tests and benchmarks substitute hostile ones)."""
        self.host = host
        self.shard_type = shard_type
        # reducers checked after robust rounds, and those caught (``banned``: left out of groups)
        self.checks = ReducerChecks(host, router or host.router, kept)
        # senders' contributions scored against our held-out loss, in rounds given a reference
        self.scores = ContributionScores()
        self._buffers = PartBuffers()
        self._caps = ConnectionCaps()  # uplink caps that this host's rounds hold on connections
        # group ID -> our reducer role in that round (None: we reduce nothing in it)
        self._rounds: dict[bytes, ReducerRole | None] = {}
        self._rounds_changed = trio.Event()
        self._finished: dict[bytes, None] = {}  # insertion-ordered: the oldest goes first
        (router or host.router).add_stream(
            REDUCE_METHOD, self._handle_reduce, prepare=self._prepare_reduce, max_message=MAX_PART_MESSAGE
        )

    @property
    def rounds_in_progress(self) -> int:
        return len(self._rounds)

    def _prepare_reduce(self, stream) -> None:
        # Before any message is processed: parts follow the header at once, often before our own
        # round is announced; their sizes are checked once the header names the round.
        stream.set_buffer_provider(PartSink(self._buffers.lease()))

    async def _handle_reduce(self, stream) -> None:
        sink = stream.buffer_provider
        assert isinstance(sink, PartSink)
        with sink:  # however the handler ends, buffers lent for parts that never came are forfeited
            header = ReduceHeader.parse((await stream.receive()).body)
            role = await self._find_reducer(header.group_id)
            if role is None:
                raise ValueError("this peer reduces no shard in that group")
            if header.total != role.total:
                raise ValueError(f"tensor size mismatch: this group averages {role.total} values, got {header.total}")
            sink.part_sizes = role.shard.part_sizes
            with role.lease:
                try:
                    await role.serve(stream, sink, header)
                except BaseException:
                    role.lease.forfeit_all()  # a reply cut short may still sit in the send queue
                    raise

    async def _find_reducer(self, group_id: bytes) -> ReducerRole | None:
        with trio.move_on_after(ROUND_WAIT):
            while group_id not in self._rounds:
                if group_id in self._finished:
                    raise RoundOver("this peer's part in that round is over")
                await self._rounds_changed.wait()
        return self._rounds.get(group_id)

    def _used(self, group_id: bytes) -> bool:
        """Whether a round with this group ID is live or over on this peer. A finished one counts:
        streams for it are refused (``RoundOver``) and their senders stop waiting for our parts,
        so a leader that announced its ID again would have our members drop each other."""
        return group_id in self._rounds or group_id in self._finished

    def _announce(self, group_id: bytes, role: ReducerRole | None) -> None:
        self._rounds[group_id] = role
        self._rounds_changed.set()
        self._rounds_changed = trio.Event()

    def _finish(self, group_id: bytes) -> None:
        self._finished[group_id] = None
        if len(self._finished) > FINISHED_ROUNDS_KEPT:
            del self._finished[next(iter(self._finished))]
        self._rounds_changed.set()  # handlers waiting for this round learn that it is over
        self._rounds_changed = trio.Event()

    # ------------------------------------------------------------------ one round
    async def run(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        settings: RoundSettings = DEFAULTS,
        own_radius: float | None = None,
        reference: Sequence[torch.Tensor] | None = None,
    ) -> AllReduceResult:
        """Average ``tensors`` in place with the other members of ``group`` (``RoundSettings``
        says how). The tensors are read while the round runs (a single contiguous float32 CPU
        tensor is sent straight from its memory, without a copy) and written only when it is
        over, so they must not change in between; a cancelled round leaves them as they were.
        ``own_radius``: if the round ends with fewer than ``MIN_OUTVOTING`` senders in it, how
        far (L2) its averages may move our values (``own_radius.py``); None: any distance.
        ``reference``: our held-out loss's gradient where ``tensors`` start from, shaped as they are,
        to score the contributions to our shard against (``contribution_scores.py``)."""
        me, started, tensors = self.host.peer_id, trio.current_time(), list(tensors)
        member = group.member(me)
        if member is None:
            raise AllReduceError("this peer is not a member of the group")
        codec, aggregation = get_codec(settings.codec), Aggregation(settings.aggregation)
        strategy = self.checks.strategy(aggregation, settings.check_reducers)
        plan = AllReducePlan.build(
            sum(t.numel() for t in tensors),
            [m.bandwidth for m in group.reducers],
            settings.part_size,
            bytes_per_value(codec.payload_size),
        )
        if self._used(group.group_id):  # refused before it costs anything (checked again at the announcement)
            raise AllReduceError(DUPLICATE_GROUP_ID)
        scored = None if reference is None else await in_thread(flat_reference, list(reference), plan.total)
        self._buffers.start_round()
        with self._buffers.lease() as received, self._buffers.lease() as lease:
            with self._taking_part(group.group_id) as announce:
                flat = await in_thread(checked_flat, tensors) if member.mode.sends else None  # (refuses NaN)
                prepared = await strategy.prepare(group, plan, flat, weight, codec)
                round_ = AllReduceRound(group, plan, me, sends=flat is not None)
                crossing = {peer for peer, _ in uplink_shares(plan, group, me, 1.0)}  # through our uplink
                pacing = uplink_shares(plan, group, me, settings.uplink) if settings.uplink and crossing else None
                others = [m.peer_id for m in group.members if m.peer_id != me]
                links = RoundLinks(self.host, others, pacing, self._caps, crossing)
                reducer = self._reducer_role(round_, codec, lease, links, aggregation, strategy, scored)
                announce(reducer)  # (no await since the last: see ``_taking_part``)
                if reducer is not None:  # its inputs, for the checks, as they come
                    strategy.keep(group, reducer.shard, prepared)
                local = None
                if reducer is not None and flat is not None:
                    bounds = plan.shard_bounds(round_.my_shard)
                    local, ours = flat[slice(*bounds)], prepared.mine(me)  # (ours: as committed, if we did)
                    if codec.sparse:  # our own contribution as the others' arrive (``sparse_codec.as_sent``)
                        local = await in_thread(as_sent, codec, local, plan.parts(round_.my_shard), bounds[0], ours)
                async with links.watching(), trio.open_nursery() as roles:
                    if reducer is not None:
                        roles.start_soon(reducer.reduce, me, local, weight, settings.sender_rules)
                    if flat is not None:
                        header = ReduceHeader(group.group_id, weight, plan.total, prepared.wire_commitment)
                        sender = SenderRole(self.host, flat, header, codec, links, round_.exchanges(), prepared.parts)
                        for index in sender.shards:
                            roles.start_soon(sender.exchange, index, round_, received, settings.reducer_rules)
            if reducer is not None:
                await reducer.report(round_)
                strategy.keep(group, reducer.shard, prepared)  # kept from now on
            round_.exchanges_over()
            round_.screen(self.checks.banned, lambda peer: self.checks.banned.reasons.get(peer, ""))
            await strategy.review(round_, flat, weight, codec)  # before the averages land
            bounded = None
            if flat is not None:
                averages = _written(round_, codec)
                if own_radius is not None and round_.senders_in() < MIN_OUTVOTING:
                    averages, bounded = await _within_own_radius(flat, averages, own_radius, codec, round_)
                await in_thread(write_back, tensors, averages)
        link_rate = links.link_rate()  # (reads the round's last bytes first)
        upload = UploadFigures(links.uplink.rate(), settings.uplink if pacing else None)
        result = round_.finish(link_rate, trio.current_time() - started, bounded, upload)
        result.alignment = self._judge(reducer.shard.scoring if reducer is not None else None)
        for peer in result.failed_peers:
            log.info("peer %s dropped from round %s", peer, group.group_id.hex()[:8])
        return result

    def _judge(self, scoring: ShardAlignment | None) -> dict:
        """Score this round's senders by their cosines (``ShardAlignment``); ban those whose
        contributions keep raising our held-out loss. Returns the cosines."""
        if scoring is None:
            return {}
        alignment = scoring.cosines()
        for peer, mean in self.scores.observe(alignment, scoring.own_cosine()):
            reason = f"its contributions raised our held-out loss (mean cosine {mean:.2f} with its gradient)"
            self.checks.banned.ban(peer, reason, BAN_SECONDS)
            log.warning("peer %s banned: %s", peer, reason)
        return alignment

    @contextlib.contextmanager
    def _taking_part(self, group_id: bytes) -> Iterator[Callable[[ReducerRole | None], None]]:
        """This peer's part in round ``group_id``, announced with what it yields once the round is
        ready to serve: however the block ends (refused, failed, cancelled or done), what was
        announced goes, handlers still waiting for our replies give up, and streams for the
        round that arrive from then on are refused at once."""
        announced: list[ReducerRole | None] = []
        duplicate = False

        def announce(role: ReducerRole | None) -> None:
            # Checked with no await between it and the announcement: a leader that reused a live
            # group ID would have the two rounds take each other's parts.
            nonlocal duplicate
            if self._used(group_id):
                duplicate = True
                raise AllReduceError(DUPLICATE_GROUP_ID)
            self._announce(group_id, role)
            announced.append(role)

        try:
            yield announce
        finally:
            if announced:
                del self._rounds[group_id]  # ours: a second round with this ID was refused
                if announced[0] is not None:
                    announced[0].cancel()
            if not duplicate:  # the ID is the live round's: its streams are not to be refused
                self._finish(group_id)

    def _reducer_role(
        self,
        round_: AllReduceRound,
        codec: Codec,
        lease: BufferLease,
        links: RoundLinks,
        aggregation: Aggregation,
        strategy: RoundStrategy,
        reference: torch.Tensor | None = None,
    ) -> ReducerRole | None:
        """Our reducer role in the round, or None if we reduce no shard; it replies in the codec
        the round's strategy gives for ``codec``, the senders' (``RoundStrategy.reply_codec``),
        and scores the senders against ``reference`` (flat, the whole vector's) if given."""
        if round_.my_shard is None:
            return None
        part_sizes = [end - start for start, end in round_.plan.parts(round_.my_shard)]
        sum_buffer = lease.take(sum(part_sizes)) if sum(part_sizes) else None
        senders = [m.peer_id for m in round_.group.senders]
        workspace = None
        if aggregation.robust and part_sizes:  # one part per sender, reused
            workspace = lease.take(len(senders) * max(part_sizes))
        signing = strategy.shard_signing(round_.group, self.host.peer_id)
        shard = self.shard_type(part_sizes, senders, sum_buffer, aggregation, workspace, signing)
        if reference is not None:
            shard.score_against(reference[slice(*round_.plan.shard_bounds(round_.my_shard))], self.host.peer_id)
        return ReducerRole(shard, lease, round_.plan.total, strategy.reply_codec(codec), links)


def _written(round_: AllReduceRound, codec: Codec) -> list[tuple[int, torch.Tensor]]:
    """What the round writes into our values: every believed average; with a sparse codec also
    zeros where no average is believed. A sparse average is zero where it averaged nothing and
    error feedback keeps our contribution there owed: a failed reducer's shard is all such values
    (left as they are, every peer would apply its whole unsent progress there, and the peers'
    shared starts would drift apart)."""
    averages = round_.averages()
    if codec.sparse:
        averages += [(start, torch.zeros(end - start)) for start, end in round_.unaveraged()]
    return averages


async def _within_own_radius(
    flat: torch.Tensor, averages: list[tuple[int, torch.Tensor]], radius: float, codec: Codec, round_: AllReduceRound
) -> tuple[list[tuple[int, torch.Tensor]], tuple[float, float] | None]:
    """A round too small to outvote a liar: its averages bounded to ``radius`` of our values
    (``own_radius.py``), and (how far they would have moved us, the radius) if that bound was
    needed. A sparse codec's are bounded at the values they kept, toward our contribution as we
    sent it (``sparse_codec.as_sent``): what we did not send stays owed (error feedback), and is
    not applied here as well; and the radius, which our whole updates set, shrinks to the share of
    our values' norm that we sent (the few values a sparse round carries move us by as much less,
    and a liar should not have the rest to move us by)."""
    if codec.sparse:
        parts = [part for shard in range(round_.plan.num_shards) for part in round_.plan.parts(shard)]
        sent = await in_thread(as_sent, codec, flat, parts, 0)
        whole = float(flat.double().norm())
        radius = radius * float(sent.double().norm()) / whole if whole > 0 else 0.0
        averages, moved = await in_thread(bound_sparse_move, sent, averages, radius)
    else:
        averages, moved = await in_thread(bound_move, flat, averages, radius)
    if moved <= radius:
        return averages, None
    what = "round %s: too few senders to outvote a liar; our values moved %.3g, not %.3g"
    log.info(what, round_.group.group_id.hex()[:8], radius, moved)
    return averages, (moved, radius)


def _tighter(cap: float | None, timeout: float | None) -> float | None:
    return cap if timeout is None else timeout if cap is None else min(cap, timeout)


def flat_reference(reference: list[torch.Tensor], total: int) -> torch.Tensor:
    """A round's reference as one flat float32 vector of ``total`` values (ValueError if not)."""
    flat = flatten(reference)
    if flat.numel() != total:
        raise ValueError(f"the reference holds {flat.numel()} values, the tensors {total}")
    return flat


def checked_flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Our values as one flat float32 vector, refused if any is NaN or infinite.

    A single contiguous float32 CPU tensor is used as it is (a view, no copy): the round only reads
    it until it is over, and then writes the averages into it. Anything else is copied."""
    flat = flat_view(tensors)
    if flat is None:
        flat = flatten(tensors)
    if not all_finite(flat):
        raise AllReduceError("local tensors contain NaN or infinite values; refusing to average them")
    return flat
