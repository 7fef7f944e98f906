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

The messages and what each side does with them are sans-I/O objects in ``allreduce_protocol.py``.
Here a round is two small roles driven by trio (``round_roles.py``): ``ReducerRole`` (one
shard's reduction, fed by a handler per sender stream) and ``SenderRole`` (one exchange per
reducer), watched by the round's ``RoundLinks``; buffers come from a per-service pool under
leases (``part_buffers.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio

from peer import PeerHost, PeerID, Router
from peer.tensors import all_finite

from .allreduce_protocol import REDUCE_METHOD, AllReduceError, ReduceHeader, ReducerShard
from .compression import Codec, get_codec
from .flat_parts import flat_view, flatten, write_back
from .group import GroupInfo
from .link_speed import DeadlineRules
from .part_buffers import BufferLease, PartBuffers, PartSink
from .partition import DEFAULT_PART_SIZE, AllReducePlan
from .reducer_checks import ReducerChecks
from .robust import Aggregation
from .round_links import ConnectionCaps, RoundLinks
from .round_roles import INLINE_WORK_LIMIT, ReducerRole, SenderRole, in_thread, tensor_work_limiter
from .uplink import uplink_shares

__all__ = ["AllReduceService", "AllReduceResult", "AllReduceError", "INLINE_WORK_LIMIT", "tensor_work_limiter"]

log = logging.getLogger("peerd.averaging")

# How long a reducer's handler waits for its own round to start: the leader's announcement can
# reach a follower a little after another follower has started sending to it.
ROUND_WAIT = 5.0
# Group IDs of rounds that ended (or were cancelled) on this peer, so that a stream arriving late
# for one is refused at once instead of waiting ROUND_WAIT for a round that will not come again.
# A peer runs a round every few seconds at most; this many cover hours of rounds in 16 KiB.
FINISHED_ROUNDS_KEPT = 1024
DEFAULT_DEADLINES = DeadlineRules()


@dataclass
class AllReduceResult:
    group: GroupInfo
    # shard index -> peers whose contribution is in every part of that shard's average
    contributors: dict[int, list[PeerID]] = field(default_factory=dict)
    # shard index -> per part (``plan.parts(shard)``), the peers whose contribution is in that
    # part's average: a sender dropped midway is in the parts averaged before it was dropped
    part_contributors: dict[int, list[list[PeerID]]] = field(default_factory=dict)
    # shards that kept this peer's local values (their reducer died, stalled or got nothing)
    local_shards: dict[int, str] = field(default_factory=dict)
    # peers that failed this peer in some way (as reducer, or dropped as sender by some reducer)
    failed_peers: set[PeerID] = field(default_factory=set)
    # how the vector was split (shard i is reduced by group.reducers[i]; which also fixes how each
    # part was encoded), and the shard this peer reduced
    plan: AllReducePlan | None = None
    my_shard: int | None = None
    # what this peer's link achieved in the round (bytes/s, the slower direction), if measurable
    link_rate: float | None = None
    # reducers this peer checked after the round (``verification.py``): shard index -> the
    # reducer, and why it was caught (None: its answer held); a caught one's shard stays local
    reducer_checks: dict[int, tuple[PeerID, str | None]] = field(default_factory=dict)
    seconds: float = 0.0  # the round itself, from the start to the averages written back

    @property
    def succeeded(self) -> bool:
        return not self.local_shards and not self.failed_peers


class AllReduceService:
    """Serves ``avg.reduce`` for every all-reduce this peer takes part in."""

    def __init__(self, host: PeerHost, router: Router | None = None, *, shard_type: type[ReducerShard] = ReducerShard):
        """``shard_type``: what reduces our shard (tests and benchmarks substitute hostile ones)."""
        self.host = host
        self.shard_type = shard_type
        # reducers checked after robust rounds, and those caught (``banned``: left out of groups)
        self.checks = ReducerChecks(host, router or host.router)
        self._buffers = PartBuffers()
        self._caps = ConnectionCaps()  # uplink caps that this host's rounds hold on connections
        # group ID -> our reducer role in that round (None: we reduce nothing in it)
        self._rounds: dict[bytes, ReducerRole | None] = {}
        self._rounds_changed = trio.Event()
        self._finished: dict[bytes, None] = {}  # insertion-ordered: the oldest goes first
        (router or host.router).add_stream(REDUCE_METHOD, self._handle_reduce, prepare=self._prepare_reduce)

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
            sink.part_sizes = role.shard.reduction.part_sizes
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
                    raise ValueError("this peer's part in that round is over")
                await self._rounds_changed.wait()
        return self._rounds.get(group_id)

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
        codec: str | Codec = "none",
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        deadlines: DeadlineRules = DEFAULT_DEADLINES,
        aggregation: Aggregation | str = Aggregation.MEAN,
        check_reducers: bool | None = None,
        uplink: float | None = None,
    ) -> AllReduceResult:
        """Average ``tensors`` in place with the other members of ``group``.

        ``deadlines`` says how long to wait for a peer whose bytes stop coming (see
        ``link_speed.py``); ``sender_timeout`` and ``reducer_timeout``, if set, cap in seconds how
        long a reducer waits for a sender and a sender for a reducer, whatever their progress.

        The tensors are read while the round runs (a single contiguous float32 CPU tensor is sent
        straight from its memory, without a copy) and written only when it is over, so they must
        not change in between; a cancelled round leaves them as they were. ``aggregation``: how
        our shard, if we reduce one, is aggregated from the senders' parts (``robust.py``);
        ``check_reducers``: whether to check the other reducers before using their averages
        (``verification.py``; default: with centered-clip, which the checks recompute).
        ``uplink``: this peer's uplink in bytes/s, if known: the round's connections are paced to
        share it (``uplink.py``)."""
        me = self.host.peer_id
        member = group.member(me)
        if member is None:
            raise AllReduceError("this peer is not a member of the group")
        started = trio.current_time()
        tensors = list(tensors)
        the_codec = get_codec(codec)
        try:
            flat = await in_thread(checked_flat, tensors) if member.mode.sends else None
        except BaseException:  # refused (NaN) or cancelled: we will not take part, say so at once
            self._finish(group.group_id)
            raise
        total = sum(t.numel() for t in tensors)
        robust = Aggregation(aggregation) is Aggregation.CENTERED_CLIP
        # Checked rounds (CenteredClip by default): every part is committed to and each reducer
        # keeps its inputs for the checks; a round nobody checks does neither. Like the aggregation,
        # this is the swarm's setting: a reducer that keeps no inputs fails a checking peer's checks.
        checked = robust if check_reducers is None else check_reducers
        plan = AllReducePlan.build(total, [m.bandwidth for m in group.reducers], part_size)
        my_shard = next((i for i, m in enumerate(group.reducers) if m.peer_id == me), None)
        sender_rules = dataclasses.replace(deadlines, cap=_tighter(deadlines.cap, sender_timeout))
        reducer_rules = dataclasses.replace(deadlines, cap=_tighter(deadlines.cap, reducer_timeout))
        committed = None  # our commitment to our parts, and the parts, encoded (``commitments.py``)
        if checked and robust and flat is not None:
            try:
                committed = await in_thread(self.checks.commit, group, plan, flat, weight, the_codec)
            except BaseException:
                self._finish(group.group_id)
                raise
        commitment = committed[0] if committed is not None else None
        # Checked here, with no await between it and the announcement below: a leader that reused a
        # live group ID would have the two rounds take each other's parts.
        if group.group_id in self._rounds:
            raise AllReduceError("another round on this peer already uses this group ID")
        self._buffers.start_round()
        pacing = uplink_shares(plan, group, me, uplink) if uplink else None
        links = RoundLinks(self.host, [m.peer_id for m in group.members if m.peer_id != me], pacing, self._caps)
        with self._buffers.lease() as received, contextlib.ExitStack() as holds:
            reducer = None
            if my_shard is not None:
                lease = holds.enter_context(self._buffers.lease())
                aggregated = Aggregation(aggregation)
                reducer = self._reducer_role(group, plan, my_shard, the_codec, lease, links, aggregated, checked)
                if reducer.shard.reduction.keep_inputs:
                    self.checks.keep(group, reducer.shard.reduction, commitment)
            sender = None
            if flat is not None:
                header = ReduceHeader(group.group_id, weight, total, commitment and commitment.to_wire())
                sender = SenderRole(self.host, plan, flat, header, the_codec, links)
                sender.prepared = committed[1] if committed is not None else None
            result = AllReduceResult(group, plan=plan, my_shard=my_shard)
            self._announce(group.group_id, reducer)
            try:
                async with trio.open_nursery() as watching:
                    watching.start_soon(links.run)
                    async with trio.open_nursery() as nursery:
                        if reducer is not None:
                            local = flat[slice(*plan.shard_bounds(my_shard))] if flat is not None else None
                            nursery.start_soon(reducer.reduce, me, local, weight, sender_rules)
                        if sender is not None:
                            for index, peer in enumerate(group.reducers):
                                if peer.peer_id != me and plan.shard_sizes[index]:
                                    sender.will_exchange(index)
                            for index, peer in enumerate(group.reducers):
                                if peer.peer_id != me and plan.shard_sizes[index] == 0:
                                    _nothing_to_average(result, group, index)
                                elif peer.peer_id != me:
                                    nursery.start_soon(
                                        sender.exchange, index, peer, group, result, received, reducer_rules
                                    )
                    watching.cancel_scope.cancel()
            finally:
                links.lift_pacing()
                del self._rounds[group.group_id]  # ours: a second round with this ID was refused above
                self._finish(group.group_id)
                if reducer is not None:  # (if cancelled: free the handlers waiting for replies)
                    reducer.cancel()
            result.link_rate = links.link_rate()
            own_average = []
            if reducer is not None:
                assert my_shard is not None
                own_average = await self._own_shard(reducer, my_shard, plan, result, wanted=sender is not None)
            if reducer is not None and reducer.shard.reduction.keep_inputs:  # kept from now on
                self.checks.keep(group, reducer.shard.reduction, commitment)
            if sender is not None:
                averaged = self._unbanned(group, plan, sender.averaged, result)
                if checked:  # before their averages land
                    averaged = await self._checked(group, plan, flat, weight, averaged, result, the_codec)
                await in_thread(write_back, tensors, averaged + own_average)
            for peer in result.failed_peers:
                log.info("peer %s dropped from round %s", peer, group.group_id.hex()[:8])
        result.seconds = trio.current_time() - started
        return result

    def _unbanned(
        self, group: GroupInfo, plan: AllReducePlan, averaged: list[tuple[int, torch.Tensor]], result: AllReduceResult
    ) -> list[tuple[int, torch.Tensor]]:
        """The averaged parts less those of reducers on our ban list: matchmaking keeps banned peers
        out of our groups, but a group formed ahead of the step (``match_ahead.py``) may predate
        the ban, and a caught liar's shard must not be believed in it."""
        for index, member in enumerate(group.reducers):
            if member.peer_id != self.host.peer_id and member.peer_id in self.checks.banned:
                result.local_shards[index] = "reducer banned: " + self.checks.banned.reasons.get(member.peer_id, "")
                result.failed_peers.add(member.peer_id)
                start, end = plan.shard_bounds(index)
                averaged = [(offset, values) for offset, values in averaged if not start <= offset < end]
        return averaged

    async def _checked(
        self,
        group: GroupInfo,
        plan: AllReducePlan,
        flat: torch.Tensor | None,
        weight: float,
        averaged: list[tuple[int, torch.Tensor]],
        result: AllReduceResult,
        codec: Codec,
    ) -> list[tuple[int, torch.Tensor]]:
        """Check the other reducers (``reducer_checks.py``); the shards of those caught keep our
        own values. Returns the averaged parts that remain."""
        assert flat is not None
        pending = self.checks.pick(group, plan, flat, weight, averaged, result.part_contributors, codec)
        result.reducer_checks = await self.checks.run_all(pending)
        for index, (reducer, verdict) in result.reducer_checks.items():
            if verdict is not None:
                result.local_shards[index] = f"reducer failed its check: {verdict}"
                result.failed_peers.add(reducer)
                start, end = plan.shard_bounds(index)
                averaged = [(offset, values) for offset, values in averaged if not start <= offset < end]
        return averaged

    def _reducer_role(
        self,
        group: GroupInfo,
        plan: AllReducePlan,
        my_shard: int,
        codec: Codec,
        lease: BufferLease,
        links: RoundLinks,
        aggregation: Aggregation,
        checked: bool,
    ) -> ReducerRole:
        part_sizes = [end - start for start, end in plan.parts(my_shard)]
        sum_buffer = lease.take(sum(part_sizes)) if sum(part_sizes) else None
        senders = [m.peer_id for m in group.senders]
        workspace = None
        if aggregation is Aggregation.CENTERED_CLIP and part_sizes:  # one part per sender, reused
            workspace = lease.take(len(senders) * max(part_sizes))
        shard = self.shard_type(part_sizes, senders, sum_buffer, aggregation, workspace)
        if aggregation is Aggregation.CENTERED_CLIP and checked:  # for the senders' checks: committed parts, kept
            shard.reduction.keep_inputs = True
            shard.signed_round = (group.group_id, self.host.peer_id)
            shard.verified = self.checks.verified
        return ReducerRole(shard, lease, plan.total, codec, links)

    async def _own_shard(
        self, reducer: ReducerRole, my_shard: int, plan: AllReducePlan, result: AllReduceResult, *, wanted: bool
    ) -> list[tuple[int, torch.Tensor]]:
        """Record how our shard's reduction went, and return its average as ``write_back`` takes
        it if we have values to write it into (``wanted``) and there is one."""
        outcome = reducer.shard.reduction.outcome()
        result.contributors[my_shard] = list(outcome.contributors)
        result.part_contributors[my_shard] = outcome.part_contributors
        result.failed_peers.update(outcome.dropped)
        if not wanted:
            return []
        if reducer.shard.error is not None:  # the other senders keep their values: so do we
            result.local_shards[my_shard] = str(reducer.shard.error)
            return []
        if outcome.averaged is None:
            result.local_shards[my_shard] = "no contribution arrived"
            return []
        own = await in_thread(reducer.shard.own_average, reducer.codec)
        return [(plan.shard_bounds(my_shard)[0], own)]


def _nothing_to_average(result: AllReduceResult, group: GroupInfo, index: int) -> None:
    """An empty shard (a tiny vector split many ways): no exchange, and every sender is in each of
    its (no) parts."""
    result.contributors[index] = [member.peer_id for member in group.senders]
    result.part_contributors[index] = []


def _tighter(cap: float | None, timeout: float | None) -> float | None:
    return cap if timeout is None else timeout if cap is None else min(cap, timeout)


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
