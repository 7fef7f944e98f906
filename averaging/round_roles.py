"""The two parts a peer plays in one all-reduce round, driven by trio.

``ReducerRole``: one shard's reduction, fed by a handler per sender stream; ``SenderRole``: one
exchange per reducer. How long each waits for the other follows the bytes that move
(``link_speed.ProgressDeadline``, watched by the round's ``RoundLinks``): a sender that keeps
delivering keeps its place however slow its link, one that stops is dropped ``STALL`` seconds
later, and one whose connection dies or is refused is dropped at once.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import torch
import trio
from trio.lowlevel import ParkingLot

from peer import ConnectError, ConnectionLost, PeerHost, PeerID, RemoteError, RPCError
from peer.worker_threads import run_blocking

from .allreduce_protocol import (
    MAX_PART_MESSAGE,
    REDUCE_METHOD,
    ROUND_OVER,
    AllReduceError,
    AverageInbox,
    ContributionInbox,
    ReduceHeader,
    part_body,
)
from .compression import Codec
from .group import GroupMember
from .link_speed import DeadlineRules, ProgressDeadline
from .part_buffers import BufferLease, PartSink
from .reducer_shard import ReducerShard
from .reduction import ContributionRejected
from .round_links import RoundLinks
from .round_state import AllReduceRound
from .uplink import AVERAGES, PARTS

__all__ = ["INLINE_WORK_LIMIT", "ReducerRole", "RoleState", "SenderRole", "in_thread", "tensor_work_limiter"]

log = logging.getLogger("peerd.averaging")

_limiter: trio.CapacityLimiter | None = None


def tensor_work_limiter() -> trio.CapacityLimiter:
    """One process-wide limit for heavy tensor work in worker threads (2 threads: enough to overlap
    compression with reduction, few enough to leave the event loop a core on small machines)."""
    global _limiter
    if _limiter is None:
        _limiter = trio.CapacityLimiter(2)
    return _limiter


async def in_thread(fn, *args):
    return await run_blocking(fn, *args, limiter=tensor_work_limiter())


# Tensor work on at most this many values runs on the event loop (~0.4 ms), larger in a thread.
INLINE_WORK_LIMIT = 1 << 20


async def _small_inline(numel: int, fn, *args):
    if numel <= INLINE_WORK_LIMIT:
        return fn(*args)
    return await in_thread(fn, *args)


async def _alongside(side: Callable[[], Awaitable[None]], main: Callable[[], Awaitable[None]]) -> None:
    """Run ``side`` while ``main`` runs, and cancel it once ``main`` returns. The first ordinary
    exception of either cancels both and comes out as itself, not in an exception group, so that
    callers can tell a broken stream from a protocol error."""
    failures: list[Exception] = []

    async def guarded(fn: Callable[[], Awaitable[None]], ends_all: bool) -> None:
        try:
            await fn()
        except Exception as error:
            failures.append(error)
            nursery.cancel_scope.cancel()
        else:
            if ends_all:
                nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guarded, side, False)
        await guarded(main, True)
    if failures:
        raise failures[0]


class RoleState(enum.Enum):
    """A reducer role's lifecycle: REDUCING -> CLOSED (every reply made, or none will be any
    more) or REDUCING -> CANCELLED (the round ended before its replies were all made)."""

    REDUCING = "reducing"
    CLOSED = "closed"
    CANCELLED = "cancelled"


class ReducerRole:
    """This peer as the reducer of one shard in one round: the shard's reduction, fed by one
    handler per sender stream and by the round itself (our own values), and its replies, part by
    part, which every handler sends on to its sender as soon as they are made.

    ``lease`` holds the running sum, which becomes the averages the replies are sent from: the
    round and every handler still replying hold it, and the last one out gives it back."""

    def __init__(self, shard: ReducerShard, lease: BufferLease, total: int, codec: Codec, links: RoundLinks):
        self.shard = shard
        self.lease = lease
        self.total = total
        self.codec = codec
        self.links = links
        self.state = RoleState.REDUCING
        self.lock = trio.Lock()  # one ShardReduction call at a time (several run in worker threads)
        self._arrivals = ParkingLot()  # the reduction waits here for a part staged or a sender dropped
        self._replies = ParkingLot()  # handlers wait here for a reply made or the role's end
        self._streams: dict[Any, trio.CancelScope] = {}  # sender -> its stream's receive loop

    async def reduce(self, me: PeerID, local: torch.Tensor | None, weight: float, rules: DeadlineRules) -> None:
        """Add our own slice, then average and encode each part as soon as every sender still in
        the round has delivered it, waiting for the senders while their bytes keep coming (see
        the module docstring)."""
        shard = self.shard
        if local is not None:
            async with self.lock:
                shard.add_local(me, local, weight)  # staged as views: no tensor work yet
        # A sender streams its whole vector to all reducers at once, so what it could owe us at
        # the floor rate is the whole vector's bytes (uncompressed float32: an upper bound).
        now, owed = trio.current_time(), 4 * self.total
        watches = [
            self.links.watch(sender, ProgressDeadline(rules, owed, now), self._give_up_on(sender), incoming=True)
            for sender in shard.pending
        ]
        try:
            while not shard.finished and shard.pending:  # every watch ends by its cap at the latest
                await self._reply_ready(shard.work_per_part)
                if not shard.finished and shard.pending and not shard.ready():  # (no await since)
                    await self._arrivals.park()
        finally:
            for watch in watches:
                self.links.unwatch(watch)
        async with self.lock:
            await in_thread(shard.close, "did not finish sending", self.codec)
        self._end(RoleState.CLOSED)

    async def _reply_ready(self, work: int) -> None:
        """Make the reply of every part that is ready now."""
        while True:
            async with self.lock:
                if not self.shard.ready():
                    return
                await _small_inline(work, self.shard.reply_next, self.codec)
            self._replies.unpark_all()

    def cancel(self) -> None:
        """The round ends before its replies were all made: handlers waiting for them give up."""
        self._end(RoleState.CANCELLED)

    def _end(self, state: RoleState) -> None:
        if self.state is RoleState.REDUCING:
            self.state = state
            self._replies.unpark_all()

    async def report(self, round_: AllReduceRound) -> None:
        """Tell the round how our shard's reduction went (once the role is closed), with its
        average as the senders decode it if we have values to write it into."""
        shard = self.shard
        outcome = shard.outcome()
        error = None if shard.error is None else str(shard.error)
        average = None
        if round_.sends and error is None and outcome.averaged is not None:
            average = await in_thread(shard.own_average, self.codec)
        round_.own_shard_reduced(outcome, error, average)

    def _note_arrival(self) -> None:
        self._arrivals.unpark_all()

    def _give_up_on(self, sender: PeerID):
        async def give_up(reason: str) -> None:
            if sender in self.shard.pending:
                log.info("dropping sender %s: %s", sender, reason)
                await self._drop(sender, reason)
                scope = self._streams.get(sender)
                if scope is not None:
                    scope.cancel()

        return give_up

    async def serve(self, stream, sink: PartSink, header: ReduceHeader) -> None:
        """One sender's stream: its parts until it ends (or the round moves on), and at the same
        time the replies, each as soon as it is made."""
        sender = stream.peer
        self.links.add(sender, stream.link, carries=AVERAGES)
        try:
            async with self.lock:
                self.shard.set_weight(sender, header.weight)
            inbox = self.shard.inbox(sender, sink, header)
        except ContributionRejected as error:
            await self._drop(sender, str(error))
            raise
        # once every reply is sent, every part is averaged: nothing more is needed from the sender
        await _alongside(partial(self._receive, inbox, stream), partial(self._send_replies, stream))

    async def _send_replies(self, stream) -> None:
        shard, sent = self.shard, 0
        while True:
            while sent < len(shard.replies):
                body, payload = shard.replies[sent]
                await stream.send(body, payload)
                sent += 1
            if shard.error is not None:
                raise shard.error
            if sent == shard.num_parts:
                return
            if self.state is RoleState.CANCELLED:
                raise AllReduceError("the all-reduce was cancelled on this peer")
            await self._replies.park()  # (no await since the checks: no reply can slip by)

    async def _receive(self, inbox: ContributionInbox, stream) -> None:
        # The sink's lease holds this sender's staged parts: they go back to the pool once their
        # parts are averaged (the replies are sent from the sum, not from them), so the averages
        # this peer receives next can reuse them. Any the reduction may still read when the loop
        # ends otherwise (the round was cancelled) are forfeited, never handed out again.
        shard = self.shard
        with inbox.sink.lease, inbox.sink, trio.CancelScope() as scope:
            self._streams[inbox.sender] = scope
            try:
                await self._receive_parts(inbox, stream)
                while shard.holds(inbox.sender) and self.state is RoleState.REDUCING:
                    await self._replies.park()
            finally:
                if inbox.sender in shard.pending:  # cancelled: the round moved on
                    with trio.CancelScope(shield=True):
                        await self._drop(inbox.sender, "the sender abandoned the stream")
                for buffer in inbox.unaveraged_buffers():
                    inbox.sink.lease.forfeit(buffer)

    async def _receive_parts(self, inbox: ContributionInbox, stream) -> None:
        try:
            async for message in stream:
                part = inbox.part(message.body, message.payload)
                # A payload that landed in its buffer is only checked; anything else is decoded
                # (a copy at least) in a worker thread.
                # (A committed one is hashed and checked too: inline for usual sizes.)
                if part.landed and inbox.signing is None:
                    values = inbox.decode(part)
                elif part.landed:
                    values = await _small_inline(part.numel, inbox.decode, part)
                else:
                    values = await in_thread(inbox.decode, part)
                async with self.lock:
                    # stage checks the part for NaN/inf: on the event loop for parts of the usual
                    # size (a fraction of a millisecond, while the part is still in cache; a thread
                    # hop costs more), in a worker thread for unusually large ones.
                    await _small_inline(values.numel(), inbox.stage, part.index, values, part.signed)
                self._note_arrival()
            async with self.lock:
                inbox.finish()  # drops the sender if parts are missing
        except (ContributionRejected, ValueError, TypeError) as error:
            log.warning("refusing contribution of %s: %s", inbox.sender, error)
            await self._drop(inbox.sender, str(error))
            return
        except RPCError as error:  # the sender vanished mid-stream
            await self._drop(inbox.sender, f"stream broke: {error}")
            raise
        self._note_arrival()

    async def _drop(self, sender: PeerID, reason: str) -> None:
        async with self.lock:
            self.shard.drop(sender, reason)
        self._note_arrival()
        self._replies.unpark_all()  # (its receive loop may be waiting for its staged parts to go)


# How many parts ahead of its slowest stream a sender's stream to one reducer may get.
PACING_WINDOW = 2


class PartPacer:
    """Keeps a sender's streams to its reducers within ``window`` parts of each other.

    A reducer answers part ``p`` once every sender has delivered it, so a sender whose streams
    drift apart (TCP shares an uplink unevenly between flows: one stream was seen done in 0.6 s
    while another took 2 s) holds every reducer's answers back to its slowest stream, and the
    fast streams' bandwidth is wasted in the meantime. Taking turns part by part keeps the
    reduce-scatter moving on all shards at once, so the averages can flow back from all of them.
    A stream that keeps the others waiting for ``patience`` seconds (its reducer stopped reading)
    no longer paces them: the healthy reducers must keep getting our bytes, or they drop us."""

    def __init__(self, window: int = PACING_WINDOW):
        self.window = window
        self._sent: dict[int, int] = {}  # stream (shard index) -> parts sent
        self._changed = trio.Event()

    def join(self, key: int) -> None:
        self._sent[key] = 0

    def leave(self, key: int) -> None:
        self._sent.pop(key, None)
        self._wake()

    async def turn(self, key: int, patience: float) -> None:
        """Wait until stream ``key`` may send its next part."""
        with trio.move_on_after(patience) as waiting:
            while self._sent.get(key, 0) > min(self._sent.values(), default=0) + self.window:
                changed = self._changed
                await changed.wait()
        if waiting.cancelled_caught and self._sent:
            lowest = min(self._sent.values())
            if self._sent.get(key, 0) > lowest + self.window:  # still held back (not by a stream
                # another waiter already let go): every stream at the lowest count stops pacing
                for stalled in [k for k, count in self._sent.items() if count == lowest]:
                    self.leave(stalled)  # (it does not join again)

    def sent(self, key: int) -> None:
        if key in self._sent:
            self._sent[key] += 1
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class SenderRole:
    """This peer as a sender in one round: its values go to every reducer of ``shards``, and each
    reducer's average comes back into buffers leased for the round (``received``); the round
    (``AllReduceRound``) learns of each exchange's end. ``prepared``: a checked round's parts,
    encoded before it and committed to (``commitments.py``), by (reducer, part index)."""

    def __init__(
        self,
        host: PeerHost,
        flat: torch.Tensor,
        header: ReduceHeader,
        codec: Codec,
        links: RoundLinks,
        shards: list[int],
        prepared: dict[tuple[PeerID, int], tuple[Any, Any]] | None = None,
    ):
        self.host = host
        self.flat = flat
        self.header = header
        self.codec = codec
        # What the reducers answer in: parts prepared (committed to) are a checked round's
        # (``RoundStrategy.reply_codec``); a sparse one is required of every reply.
        reply_codec = codec.reply_codec(checked=prepared is not None)
        self.sparse_reply = reply_codec if reply_codec.sparse else None
        self.links = links
        self.shards = shards
        self.prepared = prepared
        self.pacer = PartPacer()
        for index in shards:  # every stream is paced from the start, before any exchange runs
            self.pacer.join(index)

    async def exchange(self, index: int, round_: AllReduceRound, received: BufferLease, rules: DeadlineRules) -> None:
        """Send shard ``index`` of our values to its reducer and take back the average.

        The reducer must keep taking our parts, and answers part by part while they come; once
        our parts are all sent it may wait for the other senders before the rest of its answers
        (the cap bounds that: their whole vectors at the floor rate), and once it says that every
        contribution is in, it must keep sending. The averaged parts count only once the whole
        shard has arrived and been checked: a reducer that fails half-way leaves the shard wholly
        local."""
        reducer = round_.group.reducers[index]
        assert reducer.address is not None
        parts = round_.plan.parts(index)
        senders = [member.peer_id for member in round_.group.senders]
        # owed: the other senders' vectors (what the reducer may wait for) and its answers to all
        progress = ProgressDeadline.for_replies(rules, 3 * 4 * round_.plan.total, trio.current_time())
        gave_up: list[str] = []
        try:
            with trio.CancelScope() as scope, PartSink(received, [end - start for start, end in parts]) as sink:

                async def expired(reason: str) -> None:
                    gave_up.append(reason)
                    scope.cancel()

                watch = self.links.watch(reducer.peer_id, progress, expired, incoming=False)
                try:
                    inbox = await self._exchange(
                        index,
                        reducer,
                        AverageInbox(parts, sink, senders, self.sparse_reply),
                        progress,
                    )
                finally:
                    self.links.unwatch(watch)
                    self.pacer.leave(index)
            if scope.cancelled_caught:
                raise trio.TooSlowError(gave_up[0] if gave_up else "timed out")
            averaged = inbox.averaged()
        except (trio.TooSlowError, RPCError, ConnectError, AllReduceError, ValueError, trio.EndOfChannel) as error:
            if isinstance(error, (ConnectError, ConnectionLost)):
                self.links.lost(reducer.peer_id, f"connection lost: {error}")
            elif isinstance(error, RemoteError) and error.type_name == ROUND_OVER:
                self.links.lost(reducer.peer_id, "its round is over")  # (it sends us no parts either)
            reason = f"gave up: {error}" if isinstance(error, trio.TooSlowError) else f"{type(error).__name__}: {error}"
            log.warning("reducer %s failed (%s); shard %d keeps local values", reducer.peer_id, reason, index)
            round_.shard_failed(index, reason)
        else:
            round_.shard_averaged(index, inbox.part_contributors, averaged)

    async def _exchange(
        self, index: int, reducer: GroupMember, inbox: AverageInbox, progress: ProgressDeadline
    ) -> AverageInbox:
        """Our parts go out while the reducer's averages come back, on the same stream."""
        assert reducer.address is not None
        connection = await self.host.connect(reducer.address)
        self.links.add(reducer.peer_id, connection, carries=PARTS)
        async with connection.stream(REDUCE_METHOD, max_message=MAX_PART_MESSAGE) as stream:
            stream.set_buffer_provider(inbox.sink)
            # once the reducer has answered in full, sending is over (it may have dropped us)
            sending = partial(self._send_parts, index, reducer.peer_id, stream, inbox, progress)
            await _alongside(sending, partial(self._receive_average, stream, inbox, progress))
        return inbox

    async def _receive_average(self, stream, inbox: AverageInbox, progress: ProgressDeadline) -> None:
        while not inbox.complete:
            message = await stream.receive()
            part = inbox.part(message.body, message.payload)
            if progress.quiet and inbox.all_in:
                progress.resume(trio.current_time())
            values = inbox.decode(part) if part.landed else await in_thread(inbox.decode, part)
            await _small_inline(values.numel(), inbox.accept, values)  # (see ReducerRole._receive)

    async def _send_parts(
        self, index: int, reducer: PeerID, stream, inbox: AverageInbox, progress: ProgressDeadline
    ) -> None:
        try:
            await stream.send(self.header.to_body())
            for part_index, (start, end) in enumerate(inbox.ranges):
                await self.pacer.turn(index, progress.rules.stall / 2)
                meta, payload = await self._encode(self.flat[start:end], reducer, part_index)
                await stream.send(part_body(part_index, meta), payload)
                self.pacer.sent(index)
            await stream.end()
        except RPCError:
            return  # the stream broke or the reducer ended it: its half says how far it got
        finally:
            self.pacer.leave(index)
        if not inbox.all_in:
            progress.quiet = True  # the reducer may wait for the other senders before it answers

    async def _encode(self, part: torch.Tensor, reducer: PeerID, index: int) -> tuple[dict[str, Any], Any]:
        # Our flattened values were checked finite as a whole, so parts skip that pass; a codec
        # whose payload is a view of the part needs no worker thread.
        if self.prepared is not None:
            return self.prepared[(reducer, index)]
        if self.codec.encodes_as_view:
            return self.codec.encode_finite(part)
        return await in_thread(self.codec.encode_finite, part)
