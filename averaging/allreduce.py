"""Fault-tolerant butterfly all-reduce over the peer RPC.

Every sender streams the slice of its flattened tensors that belongs to reducer ``r`` to ``r``
(reduce-scatter); each reducer averages its shard and streams the result back to every sender on
the same stream (all-gather). Deadlines make it fault tolerant:

- ``sender_timeout``: a reducer waits that long for the senders' data; a sender that died or
  stalled by then is dropped and the average is taken over the contributions that arrived whole;
- ``reducer_timeout``: a sender waits that long for a reducer's averaged shard; if the reducer
  died or stalled, that shard keeps the sender's own local values.

``AllReduceResult`` says what happened, so a caller can log it and decide what to do.

The messages and what each side does with them are sans-I/O objects in ``allreduce_protocol.py``.
Here a round is two small roles driven by trio: ``_ReducerRole`` (one shard's reduction, fed by a
handler per sender stream) and ``_SenderRole`` (one exchange per reducer); buffers come from a
per-service pool under leases (``part_buffers.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from peer import ConnectError, PeerHost, PeerID, Router, RPCError
from peer.tensors import all_finite

from .allreduce_protocol import (
    REDUCE_METHOD,
    AllReduceError,
    AverageInbox,
    ContributionInbox,
    ReduceHeader,
    ReducerShard,
    Reply,
    part_body,
)
from .compression import Codec, get_codec
from .flat_parts import flat_view, flatten, write_back
from .group import GroupInfo, GroupMember
from .part_buffers import BufferLease, PartBuffers, PartSink
from .partition import DEFAULT_PART_SIZE, AllReducePlan
from .reduction import ContributionRejected

__all__ = ["AllReduceService", "AllReduceResult", "AllReduceError", "tensor_work_limiter"]

log = logging.getLogger("peerd.averaging")

# How long a reducer's handler waits for its own round to start: the leader's announcement can
# reach a follower a little after another follower has started sending to it.
ROUND_WAIT = 5.0
# Group IDs of rounds that ended (or were cancelled) on this peer, so that a stream arriving late
# for one is refused at once instead of waiting ROUND_WAIT for a round that will not come again.
# A peer runs a round every few seconds at most; this many cover hours of rounds in 16 KiB.
FINISHED_ROUNDS_KEPT = 1024

_limiter: trio.CapacityLimiter | None = None


def tensor_work_limiter() -> trio.CapacityLimiter:
    """One process-wide limit for heavy tensor work in worker threads (2 threads: enough to overlap
    compression with reduction, few enough to leave the event loop a core on small machines)."""
    global _limiter
    if _limiter is None:
        _limiter = trio.CapacityLimiter(2)
    return _limiter


async def _in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args, limiter=tensor_work_limiter())


# Tensor work on at most this many values runs on the event loop (~0.4 ms), larger in a thread.
INLINE_WORK_LIMIT = 1 << 20


async def _small_inline(numel: int, fn, *args):
    if numel <= INLINE_WORK_LIMIT:
        return fn(*args)
    return await _in_thread(fn, *args)


@dataclass
class AllReduceResult:
    group: GroupInfo
    # shard index -> peers whose contribution is in that shard's average
    contributors: dict[int, list[PeerID]] = field(default_factory=dict)
    # shards that kept this peer's local values (their reducer died, stalled or got nothing)
    local_shards: dict[int, str] = field(default_factory=dict)
    # peers that failed this peer in some way (as reducer, or dropped as sender by some reducer)
    failed_peers: set[PeerID] = field(default_factory=set)
    # how the round split the values (which fixes how each part was encoded), and our shard in it
    plan: AllReducePlan | None = None
    my_shard: int | None = None

    @property
    def succeeded(self) -> bool:
        return not self.local_shards and not self.failed_peers


class _ReducerRole:
    """This peer as the reducer of one shard in one round: the shard's reduction, fed by one
    handler per sender stream and by the round itself (our own values), then one reply for all.

    ``lease`` holds the running sum, which becomes the average the replies are sent from: the
    round and every handler still replying hold it, and the last one out gives it back."""

    def __init__(self, shard: ReducerShard, lease: BufferLease, total: int, codec: Codec):
        self.shard = shard
        self.lease = lease
        self.total = total
        self.codec = codec
        self.lock = trio.Lock()  # one ShardReduction call at a time (several run in worker threads)
        self.senders_done = trio.Event()  # every sender committed or dropped
        self.replied = trio.Event()  # the reply is ready, or the round was cancelled (reply None)
        self.reply: Reply | None = None

    async def reduce(self, me: PeerID, local: torch.Tensor | None, weight: float, sender_timeout: float) -> None:
        """Add our own slice, wait (up to ``sender_timeout``) for the other senders, then average
        what arrived and encode the reply."""
        reduction = self.shard.reduction
        if local is not None:
            async with self.lock:
                await _in_thread(reduction.add_local, me, local, weight)
        self._note_progress()
        with trio.move_on_after(sender_timeout):
            await self.senders_done.wait()
        async with self.lock:
            if not reduction.done:
                log.info("dropping senders that did not finish in time: %s", [str(p) for p in reduction.pending])
            await _in_thread(self.shard.close, "did not finish sending before the sender deadline")
        self.reply = await _in_thread(self.shard.reply, self.codec)
        self.replied.set()

    async def serve(self, stream, sink: PartSink, weight: Any) -> None:
        """One sender's stream: its parts until it ends (or the round moves on), then the reply."""
        sender = stream.peer
        reduction = self.shard.reduction
        try:
            async with self.lock:
                reduction.set_weight(sender, weight)
        except ContributionRejected as error:
            await self._drop(sender, str(error))
            raise
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive, self.shard.inbox(sender, sink), stream)
            await self.replied.wait()
            nursery.cancel_scope.cancel()  # a stalled sender's receive loop ends with the round
        reply = self.reply
        if reply is None:
            raise AllReduceError("the all-reduce was cancelled on this peer")
        if reply.error is not None:
            raise reply.error
        await stream.send(reply.summary.to_body())
        for body, payload in reply.parts:
            await stream.send(body, payload)

    async def _receive(self, inbox: ContributionInbox, stream) -> None:
        # The sink's lease holds this sender's staged parts: they go back to the pool as soon as
        # the sender is committed (its values are in the sum) or dropped, so the averages this
        # peer receives next can reuse them.
        with inbox.sink.lease, inbox.sink:
            try:
                await self._receive_parts(inbox, stream)
            finally:
                if inbox.sender in self.shard.reduction.pending:  # cancelled: the round moved on
                    with trio.CancelScope(shield=True):
                        await self._drop(inbox.sender, "the sender abandoned the stream")

    async def _receive_parts(self, inbox: ContributionInbox, stream) -> None:
        try:
            async for message in stream:
                part = inbox.part(message.body, message.payload)
                # A payload that landed in its buffer is only checked; anything else is decoded
                # (a copy at least) in a worker thread.
                values = inbox.decode(part) if part.landed else await _in_thread(inbox.decode, part)
                async with self.lock:
                    # stage checks the part for NaN/inf: on the event loop for parts of the usual
                    # size (a fraction of a millisecond, while the part is still in cache; a thread
                    # hop costs more), in a worker thread for unusually large ones.
                    await _small_inline(values.numel(), inbox.stage, part.index, values)
            async with self.lock:
                await _in_thread(inbox.finish)  # adds the whole contribution
        except (ContributionRejected, ValueError, TypeError) as error:
            log.warning("refusing contribution of %s: %s", inbox.sender, error)
            await self._drop(inbox.sender, str(error))
            return
        except RPCError as error:  # the sender vanished mid-stream
            await self._drop(inbox.sender, f"stream broke: {error}")
            raise
        self._note_progress()

    async def _drop(self, sender: PeerID, reason: str) -> None:
        async with self.lock:
            self.shard.reduction.drop(sender, reason)
        self._note_progress()

    def _note_progress(self) -> None:
        if self.shard.reduction.done:
            self.senders_done.set()


class _SenderRole:
    """This peer as a sender in one round: its values go to every reducer, and each reducer's
    average comes back into buffers leased for the round (``received``)."""

    def __init__(self, host: PeerHost, plan: AllReducePlan, flat: torch.Tensor, header: ReduceHeader, codec: Codec):
        self.host = host
        self.plan = plan
        self.flat = flat
        self.header = header
        self.codec = codec
        # (flat offset, averaged values) of every shard that was averaged: written into the
        # caller's tensors only when the round is over, so a cancelled round leaves them untouched
        self.averaged: list[tuple[int, torch.Tensor]] = []

    async def exchange(
        self,
        index: int,
        reducer: GroupMember,
        group: GroupInfo,
        result: AllReduceResult,
        received: BufferLease,
        reducer_timeout: float,
    ) -> None:
        """Send shard ``index`` of our values to its reducer and take back the average.

        The averaged parts count only once the whole shard has arrived and been checked: a
        reducer that fails half-way leaves the shard wholly local."""
        assert reducer.address is not None
        parts = self.plan.parts(index)
        try:
            with trio.fail_after(reducer_timeout), PartSink(received, [end - start for start, end in parts]) as sink:
                connection = await self.host.connect(reducer.address)
                async with connection.stream(REDUCE_METHOD) as stream:
                    stream.set_buffer_provider(sink)
                    await stream.send(self.header.to_body())
                    for part_index, (start, end) in enumerate(parts):
                        meta, payload = await self._encode(self.flat[start:end])
                        await stream.send(part_body(part_index, meta), payload)
                    await stream.end()
                    inbox = AverageInbox(parts, sink)
                    contributors = inbox.summary((await stream.receive()).body)
                    while not inbox.complete:
                        message = await stream.receive()
                        part = inbox.part(message.body, message.payload)
                        values = part.decode() if part.landed else await _in_thread(part.decode)
                        await _small_inline(values.numel(), inbox.accept, values)  # (see _receive)
            self.averaged.extend(inbox.averaged())
            result.contributors[index] = contributors
            result.failed_peers.update(p.peer_id for p in group.senders if p.peer_id not in contributors)
        except (trio.TooSlowError, RPCError, ConnectError, AllReduceError, ValueError, trio.EndOfChannel) as error:
            reason = "timed out" if isinstance(error, trio.TooSlowError) else f"{type(error).__name__}: {error}"
            log.warning("reducer %s failed (%s); shard %d keeps local values", reducer.peer_id, reason, index)
            result.local_shards[index] = reason
            result.failed_peers.add(reducer.peer_id)

    async def _encode(self, part: torch.Tensor) -> tuple[dict[str, Any], Any]:
        # Our flattened values were checked finite as a whole, so parts skip that pass; a codec
        # whose payload is a view of the part needs no worker thread.
        if self.codec.encodes_as_view:
            return self.codec.encode_finite(part)
        return await _in_thread(self.codec.encode_finite, part)


class AllReduceService:
    """Serves ``avg.reduce`` for every all-reduce this peer takes part in."""

    def __init__(self, host: PeerHost, router: Router | None = None):
        self.host = host
        self._buffers = PartBuffers()
        # group ID -> our reducer role in that round (None: we reduce nothing in it)
        self._rounds: dict[bytes, _ReducerRole | None] = {}
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
                    await role.serve(stream, sink, header.weight)
                except BaseException:
                    role.lease.forfeit_all()  # a reply cut short may still sit in the send queue
                    raise

    async def _find_reducer(self, group_id: bytes) -> _ReducerRole | None:
        with trio.move_on_after(ROUND_WAIT):
            while group_id not in self._rounds:
                if group_id in self._finished:
                    raise ValueError("this peer's part in that round is over")
                await self._rounds_changed.wait()
        return self._rounds.get(group_id)

    def _announce(self, group_id: bytes, role: _ReducerRole | None) -> None:
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
        sender_timeout: float = 10.0,
        reducer_timeout: float = 20.0,
        part_size: int = DEFAULT_PART_SIZE,
    ) -> AllReduceResult:
        """Average ``tensors`` in place with the other members of ``group``.

        The tensors are read while the round runs (a single contiguous float32 CPU tensor is sent
        straight from its memory, without a copy) and written only when it is over, so they must
        not change in between; a cancelled round leaves them as they were."""
        me = self.host.peer_id
        member = group.member(me)
        if member is None:
            raise AllReduceError("this peer is not a member of the group")
        tensors = list(tensors)
        the_codec = get_codec(codec)
        try:
            flat = await _in_thread(checked_flat, tensors) if member.mode.sends else None
        except BaseException:  # refused (NaN) or cancelled: we will not take part, say so at once
            self._finish(group.group_id)
            raise
        total = sum(t.numel() for t in tensors)
        plan = AllReducePlan.build(total, [m.bandwidth for m in group.reducers], part_size)
        my_shard = next((i for i, m in enumerate(group.reducers) if m.peer_id == me), None)
        # Checked here, with no await between it and the announcement below: a leader that reused a
        # live group ID would have the two rounds take each other's parts.
        if group.group_id in self._rounds:
            raise AllReduceError("another round on this peer already uses this group ID")
        self._buffers.start_round()
        with self._buffers.lease() as received, contextlib.ExitStack() as holds:
            reducer = None
            if my_shard is not None:
                reducer = self._reducer_role(
                    group, plan, my_shard, the_codec, holds.enter_context(self._buffers.lease())
                )
            sender = None
            if flat is not None:
                sender = _SenderRole(self.host, plan, flat, ReduceHeader(group.group_id, weight, total), the_codec)
            result = AllReduceResult(group, plan=plan, my_shard=my_shard)
            self._announce(group.group_id, reducer)
            try:
                async with trio.open_nursery() as nursery:
                    if reducer is not None:
                        local = flat[slice(*plan.shard_bounds(my_shard))] if flat is not None else None
                        nursery.start_soon(reducer.reduce, me, local, weight, sender_timeout)
                    if sender is not None:
                        for index, peer in enumerate(group.reducers):
                            if peer.peer_id != me:
                                nursery.start_soon(
                                    sender.exchange, index, peer, group, result, received, reducer_timeout
                                )
            finally:
                del self._rounds[group.group_id]  # ours: a second round with this ID was refused above
                self._finish(group.group_id)
                if reducer is not None and not reducer.replied.is_set():  # cancelled: free waiting handlers
                    reducer.replied.set()
            own_average = []
            if reducer is not None:
                assert my_shard is not None
                own_average = await self._own_shard(reducer, my_shard, plan, result, wanted=sender is not None)
            if sender is not None:
                await _in_thread(write_back, tensors, sender.averaged + own_average)
            for peer in result.failed_peers:
                log.info("peer %s dropped from round %s", peer, group.group_id.hex()[:8])
            return result

    def _reducer_role(
        self, group: GroupInfo, plan: AllReducePlan, my_shard: int, codec: Codec, lease: BufferLease
    ) -> _ReducerRole:
        part_sizes = [end - start for start, end in plan.parts(my_shard)]
        sum_buffer = lease.take(sum(part_sizes)) if sum(part_sizes) else None
        shard = ReducerShard(part_sizes, [m.peer_id for m in group.senders], sum_buffer)
        return _ReducerRole(shard, lease, plan.total, codec)

    async def _own_shard(
        self, reducer: _ReducerRole, my_shard: int, plan: AllReducePlan, result: AllReduceResult, *, wanted: bool
    ) -> list[tuple[int, torch.Tensor]]:
        """Record how our shard's reduction went, and return its average as ``write_back`` takes
        it if we have values to write it into (``wanted``) and there is one."""
        reply = reducer.reply
        assert reply is not None
        outcome = reducer.shard.reduction.outcome()
        result.contributors[my_shard] = list(outcome.contributors)
        result.failed_peers.update(outcome.dropped)
        if not wanted:
            return []
        if reply.error is not None:  # the other senders keep their values: so do we
            result.local_shards[my_shard] = str(reply.error)
            return []
        if outcome.averaged is None:
            result.local_shards[my_shard] = "no contribution arrived"
            return []
        own = await _in_thread(reducer.shard.own_average, reply, reducer.codec)
        return [(plan.shard_bounds(my_shard)[0], own)]


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
