"""Fault-tolerant butterfly all-reduce over the peer RPC.

Every sender streams the slice of its flattened tensors that belongs to reducer ``r`` to ``r``
(reduce-scatter); each reducer averages its shard and streams the result back to every sender on
the same stream (all-gather). Deadlines make it fault tolerant:

- ``sender_timeout``: a reducer waits that long for the senders' data; a sender that died or
  stalled by then is dropped and the average is taken over the contributions that arrived whole;
- ``reducer_timeout``: a sender waits that long for a reducer's averaged shard; if the reducer
  died or stalled, that shard keeps the sender's own local values.

``AllReduceResult`` says what happened, so a caller can log it and decide what to do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import trio

from peer import ConnectError, PeerHost, PeerID, Router, RPCError
from peer.tensors import all_finite, tensor_bytes

from .compression import NoCompression, get_codec
from .flat_parts import (
    RAW_META,
    check_finite,
    decode,
    decode_shard,
    encode_shard,
    flat_view,
    flatten,
    write_back,
)
from .group import GroupInfo, GroupMember
from .part_buffers import PartBuffers, RawPartSink
from .partition import DEFAULT_PART_SIZE, AllReducePlan
from .reduction import ContributionRejected, ReductionOutcome, ShardReduction

__all__ = ["AllReduceService", "AllReduceResult", "AllReduceError", "tensor_work_limiter"]

log = logging.getLogger("peerd.averaging")

REDUCE_METHOD = "avg.reduce"
# How long a reducer's handler waits for its own session to appear: the leader's announcement can
# reach a follower a little after another follower has started sending to it.
SESSION_WAIT = 5.0

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


class AllReduceError(RuntimeError):
    pass


@dataclass
class AllReduceResult:
    group: GroupInfo
    # shard index -> peers whose contribution is in that shard's average
    contributors: dict[int, list[PeerID]] = field(default_factory=dict)
    # shards that kept this peer's local values (their reducer died, stalled or got nothing)
    local_shards: dict[int, str] = field(default_factory=dict)
    # peers that failed this peer in some way (as reducer, or dropped as sender by some reducer)
    failed_peers: set[PeerID] = field(default_factory=set)

    @property
    def succeeded(self) -> bool:
        return not self.local_shards and not self.failed_peers


class _Session:
    """One peer's part in one all-reduce (known to the service so incoming streams find it)."""

    def __init__(
        self,
        group: GroupInfo,
        me: PeerID,
        flat: torch.Tensor | None,
        weight: float,
        codec: str,
        sender_timeout: float,
        part_size: int,
    ):
        self.group = group
        self.me = me
        self.flat = flat
        self.weight = weight
        self.codec = codec
        self.sender_timeout = sender_timeout
        total = flat.numel() if flat is not None else None
        self.total = total
        self.plan: AllReducePlan | None = None
        self.part_size = part_size
        self.reduction: ShardReduction | None = None
        self.my_shard: int | None = None
        self.reduction_lock = trio.Lock()
        self.senders_done = trio.Event()  # every sender committed or dropped
        self.outcome_ready = trio.Event()  # the average is computed; replies may go out
        self.outcome: ReductionOutcome | None = None
        # The averaged shard, encoded once for all senders (codecs are deterministic), or why not
        self.reply_parts: list[tuple[dict, Any]] = []
        self.reply_error: Exception | None = None
        self.own_average: torch.Tensor | None = None  # with a lossy codec: our shard as others get it
        self.raw = codec == NoCompression.name or isinstance(codec, NoCompression)
        # The reduction's sum (then the average) comes from the buffer pool and goes back to it
        # once the round is over and no reducer handler can still be sending replies from it.
        self.sum_buffer: torch.Tensor | None = None
        self.handlers = 0  # reducer handlers attached to this session
        self.finished = False
        self.sum_buffer_in_flight = False  # then it is left to the garbage collector, not pooled

    def prepare(self, total: int, buffers: PartBuffers) -> None:
        reducers = self.group.reducers
        self.plan = AllReducePlan.build(total, [m.bandwidth for m in reducers], self.part_size)
        for index, member in enumerate(reducers):
            if member.peer_id == self.me:
                self.my_shard = index
        if self.my_shard is not None:
            part_sizes = [end - start for start, end in self.plan.parts(self.my_shard)]
            if sum(part_sizes):
                self.sum_buffer = buffers.take(sum(part_sizes))
            self.reduction = ShardReduction(part_sizes, [m.peer_id for m in self.group.senders], self.sum_buffer)

    def release_sum_buffer(self, buffers: PartBuffers) -> None:
        if self.finished and self.handlers == 0 and self.sum_buffer is not None:
            if not self.sum_buffer_in_flight:
                buffers.give([self.sum_buffer])
            self.sum_buffer = None


class AllReduceService:
    """Serves ``avg.reduce`` for every all-reduce this peer takes part in."""

    def __init__(self, host: PeerHost, router: Router | None = None):
        self.host = host
        self._buffers = PartBuffers()
        self._sessions: dict[bytes, _Session] = {}
        self._sessions_changed = trio.Event()
        (router or host.router).add_stream(REDUCE_METHOD, self._handle_reduce, prepare=self._prepare_reduce)

    async def _find_session(self, group_id: bytes) -> _Session | None:
        with trio.move_on_after(SESSION_WAIT):
            while group_id not in self._sessions:
                await self._sessions_changed.wait()
        return self._sessions.get(group_id)

    def _prepare_reduce(self, stream) -> None:
        # Before any message is processed: parts follow the header at once, often before our own
        # session is announced; their sizes are checked once the header names the session.
        stream.set_buffer_provider(RawPartSink(self._buffers))

    async def _handle_reduce(self, stream) -> None:
        sink = stream.buffer_provider
        assert isinstance(sink, RawPartSink)
        header = (await stream.receive()).body
        if not (isinstance(header, dict) and isinstance(header.get("group_id"), bytes)):
            raise ValueError("avg.reduce expects {'group_id': bytes, 'weight': float, 'total': int}")
        session = await self._find_session(header["group_id"])
        if session is None or session.reduction is None:
            raise ValueError("this peer reduces no shard in that group")
        sender = stream.peer
        reduction = session.reduction
        total = header.get("total")
        if total != session.total:
            raise ValueError(f"tensor size mismatch: this group averages {session.total} values, got {total!r}")
        sink.part_sizes = reduction.part_sizes
        session.handlers += 1
        served = False
        try:
            await self._serve_sender(session, stream, sender, header.get("weight"), sink)
            served = True
        finally:
            session.handlers -= 1
            if not served:  # a reply cut short may still sit in the connection's send queue
                session.sum_buffer_in_flight = True
            session.release_sum_buffer(self._buffers)

    async def _serve_sender(self, session: _Session, stream, sender: PeerID, weight: Any, sink: RawPartSink) -> None:
        reduction = session.reduction
        assert reduction is not None
        try:
            async with session.reduction_lock:
                reduction.set_weight(sender, weight)
        except ContributionRejected as error:
            await self._drop(session, sender, str(error))
            raise
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive_parts, session, stream, sender, sink)
                await session.outcome_ready.wait()
                nursery.cancel_scope.cancel()  # a stalled sender's receive loop ends with the round
        finally:
            if sender in reduction.pending:  # the sender cancelled its call or its stream broke
                with trio.CancelScope(shield=True):
                    await self._drop(session, sender, "the sender abandoned the stream")
        await self._reply(session, stream)

    async def _receive_parts(self, session: _Session, stream, sender: PeerID, sink: RawPartSink) -> None:
        reduction = session.reduction
        assert reduction is not None and session.plan is not None
        staged: list[torch.Tensor] = []  # our buffers that the reduction holds for this sender
        try:
            await self._stage_parts(session, stream, sender, staged, sink)
        finally:
            if sender not in reduction.pending:  # committed or dropped: the reduction let go of them
                self._buffers.give(staged)

    async def _stage_parts(
        self, session: _Session, stream, sender: PeerID, staged: list[torch.Tensor], sink: RawPartSink
    ) -> None:
        reduction = session.reduction
        assert reduction is not None
        try:
            async for message in stream:
                body = message.body
                if not (isinstance(body, dict) and type(body.get("part")) is int):
                    raise ContributionRejected("each part needs {'part': int, 'meta': dict}")
                index = body["part"]
                if not 0 <= index < len(reduction.part_sizes):
                    raise ContributionRejected(f"part index {index} out of range")
                values = sink.claim(index, message.payload, reduction.part_sizes[index])
                if values is None:
                    values = await self._decode_part(body.get("meta"), message.payload, reduction.part_sizes[index])
                staged.append(values)
                async with session.reduction_lock:
                    # add_part checks the part for NaN/inf: on the event loop for parts of the
                    # usual size (a fraction of a millisecond, while the part is still in cache; a
                    # thread hop costs more), in a worker thread for unusually large ones.
                    await _small_inline(values.numel(), reduction.add_part, sender, index, values)
            async with session.reduction_lock:
                await _in_thread(reduction.finish_sender, sender)  # adds the whole contribution
        except (ContributionRejected, ValueError, TypeError) as error:
            log.warning("refusing contribution of %s: %s", sender, error)
            await self._drop(session, sender, str(error))
            return
        except RPCError as error:  # the sender vanished mid-stream
            await self._drop(session, sender, f"stream broke: {error}")
            raise
        if reduction.done:
            session.senders_done.set()

    async def _drop(self, session: _Session, sender: PeerID, reason: str) -> None:
        assert session.reduction is not None
        async with session.reduction_lock:
            session.reduction.drop(sender, reason)
        if session.reduction.done:
            session.senders_done.set()

    async def _reply(self, session: _Session, stream) -> None:
        assert session.reduction is not None and session.plan is not None and session.my_shard is not None
        outcome = session.outcome
        if outcome is None:
            raise AllReduceError("the all-reduce was cancelled on this peer")
        contributors = [p.to_bytes() for p in outcome.contributors]
        if outcome.averaged is None:
            await stream.send({"contributors": contributors, "averaged": False})
            return
        if session.reply_error is not None:
            raise session.reply_error
        await stream.send({"contributors": contributors, "averaged": True})
        for index, (meta, payload) in enumerate(session.reply_parts):
            await stream.send({"part": index, "meta": meta}, payload)

    # ------------------------------------------------------------------ one round
    async def run(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        codec: str = "none",
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
        flat = await _in_thread(checked_flat, tensors) if member.mode.sends else None
        session = _Session(group, me, flat, weight, codec, sender_timeout, part_size)
        total = flat.numel() if flat is not None else sum(t.numel() for t in tensors)
        session.total = total
        self._buffers.start_round()
        session.prepare(total, self._buffers)
        try:
            return await self._run_session(session, tensors, flat, reducer_timeout)
        finally:
            session.finished = True
            session.release_sum_buffer(self._buffers)

    async def _run_session(
        self, session: _Session, tensors: list[torch.Tensor], flat: torch.Tensor | None, reducer_timeout: float
    ) -> AllReduceResult:
        group, me = session.group, session.me
        self._sessions[group.group_id] = session
        self._sessions_changed.set()
        self._sessions_changed = trio.Event()
        result = AllReduceResult(group)
        # (flat offset, averaged values) of every shard that was averaged: written into the caller's
        # tensors only when the round is over, so a cancelled round leaves them untouched
        averaged: list[tuple[int, torch.Tensor]] = []
        local: list[tuple[int, torch.Tensor]] = []  # our own shard's average
        try:
            async with trio.open_nursery() as nursery:
                if session.reduction is not None:
                    nursery.start_soon(self._reduce_locally, session)
                if flat is not None:
                    for index, reducer in enumerate(group.reducers):
                        if reducer.peer_id != me:
                            nursery.start_soon(
                                self._exchange_with, session, index, reducer, result, averaged, reducer_timeout
                            )
        finally:
            del self._sessions[group.group_id]
            if not session.outcome_ready.is_set():  # cancelled: release handlers still waiting
                session.outcome_ready.set()
        if session.reduction is not None:
            outcome = session.outcome
            assert outcome is not None
            result.contributors[session.my_shard] = list(outcome.contributors)
            result.failed_peers.update(outcome.dropped)
            if flat is not None:
                start, end = session.plan.shard_bounds(session.my_shard)
                if session.reply_error is not None:  # the other senders keep their values: so do we
                    result.local_shards[session.my_shard] = str(session.reply_error)
                elif outcome.averaged is not None:
                    local = [(start, session.own_average if session.own_average is not None else outcome.averaged)]
                else:
                    result.local_shards[session.my_shard] = "no contribution arrived"
        if flat is not None:
            await _in_thread(write_back, tensors, averaged + local)
            self._buffers.give(values for _start, values in averaged)
        return result

    async def _send_part(self, stream, part_index: int, meta: dict, payload) -> None:
        """One part to a reducer (a seam for fault-injection tests)."""
        await stream.send({"part": part_index, "meta": meta}, payload)

    async def _reduce_locally(self, session: _Session) -> None:
        """Add our own slice, then wait (up to sender_timeout) for the other senders."""
        reduction = session.reduction
        assert reduction is not None and session.plan is not None and session.my_shard is not None
        if session.flat is not None:
            start, end = session.plan.shard_bounds(session.my_shard)
            async with session.reduction_lock:
                await _in_thread(reduction.add_local, session.me, session.flat[start:end], session.weight)
        if reduction.done:
            session.senders_done.set()
        with trio.move_on_after(session.sender_timeout):
            await session.senders_done.wait()
        async with session.reduction_lock:
            if not reduction.done:
                log.info("dropping senders that did not finish in time: %s", [str(p) for p in reduction.pending])
                reduction.drop_pending("did not finish sending before the sender deadline")
        outcome = session.outcome = await _in_thread(reduction.outcome)
        if outcome.averaged is not None:
            try:
                parts = await _in_thread(encode_shard, session.codec, outcome.averaged, reduction.part_sizes)
                session.reply_parts = parts
                if not session.raw and session.flat is not None:
                    # Keep what the other peers will decode, not the unrounded average: replicas
                    # that differ by a rounding error each round would drift apart for good.
                    session.own_average = await _in_thread(decode_shard, parts, reduction.part_sizes)
            except ValueError as error:  # e.g. weighted values overflowed to inf: senders keep theirs
                session.reply_error = error
        session.outcome_ready.set()

    async def _exchange_with(
        self,
        session: _Session,
        index: int,
        reducer: GroupMember,
        result: AllReduceResult,
        averaged: list[tuple[int, torch.Tensor]],
        reducer_timeout: float,
    ) -> None:
        """Send shard ``index`` of our values to its reducer and take back the average.

        The averaged parts are kept (in ``averaged``) only once the whole shard has arrived and
        been checked: a reducer that fails half-way leaves the shard wholly local."""
        assert session.plan is not None and session.flat is not None and reducer.address is not None
        parts = session.plan.parts(index)
        codec = get_codec(session.codec)
        values: list[torch.Tensor] = []
        sink = RawPartSink(self._buffers, [end - start for start, end in parts])
        try:
            with trio.fail_after(reducer_timeout):
                connection = await self.host.connect(reducer.address)
                async with connection.stream(REDUCE_METHOD) as stream:
                    stream.set_buffer_provider(sink)
                    header = {"group_id": session.group.group_id, "weight": session.weight, "total": session.total}
                    await stream.send(header)
                    for part_index, (start, end) in enumerate(parts):
                        part = session.flat[start:end]
                        if session.raw:  # the flattened tensor was checked finite as a whole
                            meta, payload = RAW_META, tensor_bytes(part)
                        else:
                            meta, payload = await _in_thread(codec.encode, part)
                        await self._send_part(stream, part_index, meta, payload)
                    await stream.end()
                    summary = (await stream.receive()).body
                    if not (isinstance(summary, dict) and isinstance(summary.get("contributors"), list)):
                        raise AllReduceError("reducer sent a malformed summary")
                    contributors = [PeerID(raw) for raw in summary["contributors"] if isinstance(raw, bytes)]
                    if summary.get("averaged") is not True:
                        raise AllReduceError("the reducer received no contribution")
                    for part_index, (start, end) in enumerate(parts):
                        reply = await stream.receive()
                        body = reply.body
                        if not (isinstance(body, dict) and body.get("part") == part_index):
                            raise AllReduceError("reducer sent parts out of order")
                        part = sink.claim(part_index, reply.payload, end - start)
                        if part is None:
                            part = await self._decode_part(body.get("meta"), reply.payload, end - start)
                        values.append(part)
                        await _small_inline(part.numel(), check_finite, [part])  # (see add_part)
            averaged.extend((start, part) for (start, _end), part in zip(parts, values, strict=True))
            result.contributors[index] = contributors
            result.failed_peers.update(p.peer_id for p in session.group.senders if p.peer_id not in contributors)
        except (trio.TooSlowError, RPCError, ConnectError, AllReduceError, ValueError, trio.EndOfChannel) as error:
            reason = "timed out" if isinstance(error, trio.TooSlowError) else f"{type(error).__name__}: {error}"
            log.warning("reducer %s failed (%s); shard %d keeps local values", reducer.peer_id, reason, index)
            result.local_shards[index] = reason
            result.failed_peers.add(reducer.peer_id)
            self._buffers.give(values)

    async def _decode_part(self, meta, payload, numel: int) -> torch.Tensor:
        """A received part as float32 values that nobody else modifies (finiteness is checked by
        whoever uses them). An uncompressed part that did not arrive in a lent buffer is one copy
        into a reused buffer (on the event loop unless it is unusually large: a thread hop would
        cost about as much as the copy); anything else goes through its codec in a worker thread."""
        if meta == RAW_META and 0 < numel and isinstance(payload, (bytes, bytearray)) and len(payload) == 4 * numel:
            values = self._buffers.take(numel)
            await _small_inline(numel, _copy_raw_part, values, payload)
            return values
        return await _in_thread(decode, meta, payload, numel)


def _copy_raw_part(values: torch.Tensor, payload) -> None:
    values.numpy()[:] = np.frombuffer(payload, dtype=np.float32)


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
