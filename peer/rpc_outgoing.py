"""A connection's outgoing messages: the queue that callers and handlers fill, and the writer that
drains it into encrypted records.

The writer encrypts as many queued messages as fit into one send buffer before one ``send_all``:
64 concurrent callers cost a handful of syscalls, not 64. A sender whose message carries a payload
waits for the message's ``encrypted`` event before reusing its buffer; when the connection dies,
``release`` sets every such event that is still unset (the buffers will never be read again), so no
sender is left waiting on a writer that is gone.

Fast path: a small message whose sender says it is alone (a unary call or its reply while it is the
only call in progress on the connection) and that finds the writer idle (nothing queued, no write
in progress) is encrypted and written by the sender itself, with one non-blocking syscall, instead
of waking the writer: a sequential RPC then costs no pass through the scheduler on its way out (two
task switches per RPC, ~10% of a DHT get's CPU, measured). With several calls in flight, messages
come in bursts (64 concurrent callers, handlers woken together) that the writer sends with one
syscall; one syscall per message there cost ~35% more CPU per call (measured), so those queue.
Order is kept because the fast path runs only when nothing is ahead of it, and records are
encrypted in the order they go on the wire. What the kernel does not take (a full socket buffer)
becomes an already-encrypted item at the head of the queue, which the writer sends before anything
else; its sender's ``encrypted`` event is set only once those bytes are out, so a message cut off
by a dying connection still fails its send.

Replies are what a peer makes us hold by asking: a result stays queued, with its payload, until the
peer reads enough for the writer to send it. Results are admitted within a budget per connection
and one for the whole process (``ReplyBudget``); a result that does not fit is not queued, and the
caller answers with a small Busy error in its place (``Connection`` also refuses a backlogged
peer's new calls before running their handlers). Errors are small and have a room of their own; a
peer that fills even that while it keeps calling is cut off (``RepliesUnread``).
"""

from __future__ import annotations

import math
from collections import deque

import trio

from .framing import AEAD_TAG_SIZE, HEADER, MAX_RECORD_PLAINTEXT
from .rpc_protocol import STREAM_WINDOW
from .secure_channel import SecureChannel

__all__ = ["SendQueue", "TrafficCounter", "RepliesUnread", "ReplyBudget", "process_reply_budget"]

# One send buffer: a full record plus room for the small messages around it (the header that
# announces a payload goes out in the same syscall as the payload's first record). Not more: a
# buffer of several records makes the receiver idle while the sender encrypts all of them, and
# measured no cheaper per byte.
SEND_BUFFER_SIZE = MAX_RECORD_PLAINTEXT + 64 * 1024 + 2 * (HEADER.size + AEAD_TAG_SIZE)
# Most connections (DHT, matchmaking) only ever carry small messages and are idle most of the time:
# start small, grow (doubling, or to what a record needs) up to SEND_BUFFER_SIZE as payloads need,
# and go back to the small buffer after SEND_BUFFER_IDLE_RELEASE seconds with nothing to send. A
# peer holds a connection to each of the dozens of peers its DHT and groups talk to.
INITIAL_SEND_BUFFER_SIZE = 4 * 1024
BATCH_BUFFER_SIZE = 64 * 1024  # what a burst of small messages grows the buffer to, to go out in few writes
SEND_BUFFER_IDLE_RELEASE = 1.0
_RECORD_OVERHEAD = HEADER.size + AEAD_TAG_SIZE
# The fast path takes messages up to this size (header plus payload): DHT and control traffic.
# Larger payloads go through the writer, which splits them into records and batches them.
FAST_PATH_MAX = 16 * 1024
# Results queued for one peer and not yet written: two stream windows, room for a result being
# written and one behind it as large as a maximal expert output (4096 samples of width 1024 are
# 16 MiB). A result past it gets a Busy error in its place, and once half of it is unread so does
# every new call from that peer, before its handler runs, until it reads. One result larger than
# this is still queued while nothing else is, so an answer is never refused for its size alone
# (it is bounded by the sender's ``MAX_PAYLOAD``).
REPLY_BUDGET_PER_CONNECTION = 2 * STREAM_WINDOW
# Results queued over every connection of the process: half the receive budget (what peers may make
# us hold while their messages arrive, an eighth of a 4 GiB volunteer machine), so that peers that
# do not read, however many, add at most half as much again. One result larger than this is queued
# only while no other result is.
REPLY_BUDGET = 256 << 20
# Error replies (refusals among them; each a short header and at most ``MAX_ERROR_TEXT``) queued for
# one peer: about 250 of the longest. A peer that leaves this much unread while it keeps calling is
# not reading at all, and its connection is closed.
ERROR_ROOM = 1 << 20


class RepliesUnread(Exception):
    """The peer left more than ``ERROR_ROOM`` of error replies unread while it kept calling."""


class ReplyBudget:
    """Bytes of results queued on a set of connections (by default every connection of the
    process) and not yet written."""

    __slots__ = ("limit", "used", "peak")

    def __init__(self, limit: int = REPLY_BUDGET) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0  # for tests and metrics: the most ever held at once

    def admits(self, nbytes: int) -> bool:
        """Whether a result of ``nbytes`` may be queued now (a lone one always may)."""
        return self.used == 0 or self.used + nbytes <= self.limit

    def charge(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def refund(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "refunded more than was charged"


_PROCESS_REPLY_BUDGET = ReplyBudget()


def process_reply_budget() -> ReplyBudget:
    """The reply budget every connection of this process shares unless given its own."""
    return _PROCESS_REPLY_BUDGET


class TrafficCounter:
    """Bytes on the wire (records and their headers, after the handshake), for metrics and for
    comparing how much each training mode communicates."""

    __slots__ = ("bytes_sent", "bytes_received")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


# A queued message: (header, payload or None, ``encrypted`` event or None, bytes counted as a
# queued result until written, bytes counted as a queued error until written, records the fast path
# already encrypted or None). A plain tuple: one is made per message, and a class's __init__ cost a
# Python call each.
_Outgoing = tuple[bytes, "memoryview | None", "trio.Event | None", int, int, "bytes | None"]


class SendQueue:
    """What a connection has yet to send, in order, and the loop that sends it."""

    def __init__(self, channel: SecureChannel, traffic: TrafficCounter, replies: ReplyBudget | None = None) -> None:
        self._channel = channel
        self._traffic = traffic
        self._items: deque[_Outgoing] = deque()
        self._replies = replies if replies is not None else process_reply_budget()
        self.queued_results = 0  # bytes of results queued and not yet written (read-only for others)
        self._queued_errors = 0
        self._released = False  # the connection is gone: nothing queued now would be written
        self._wakeup = trio.Event()
        # True only while the writer waits for work with nothing queued: the fast path may then use
        # the send buffer and the socket, which nothing else is touching. Read-only for others (a
        # sender need not work out whether it may go direct while the writer is busy anyway).
        self.idle = False
        self._fast = channel.can_send_now
        self._buffer = bytearray(INITIAL_SEND_BUFFER_SIZE)
        self._view = memoryview(self._buffer)
        self._sent_now_at = -math.inf  # when the fast path last wrote (the buffer is in use)

    def append(
        self,
        header: bytes,
        payload: memoryview | None = None,
        encrypted: trio.Event | None = None,
        *,
        direct: bool = False,
    ) -> None:
        """Queue a message; ``direct``: the caller allows the fast path (see the module docstring)."""
        if direct and self.idle and not self._send_now(header, payload, encrypted, 0):
            return
        self._items.append((header, payload, encrypted, 0, 0, None))
        self._wakeup.set()

    @property
    def backlogged(self) -> bool:
        """Whether the peer has left half its reply budget unread: its new calls are then refused
        until it reads, and the other half is room for the results of handlers already running."""
        return self.queued_results >= REPLY_BUDGET_PER_CONNECTION // 2

    def refusal_text(self) -> str:
        """What a call refused for the reply budgets is told."""
        if self.queued_results:
            return f"{self.queued_results} bytes of replies to you are unsent: read them before asking for more"
        return "this peer holds as many unsent replies as it can; try again shortly"

    def append_result(self, header: bytes, payload: memoryview | None = None, *, direct: bool = False) -> bool:
        """Queue what the peer asked for if the reply budgets hold it (the module docstring); False
        if they do not, and nothing was queued: the caller then answers with a refusal instead."""
        size = len(header) + (len(payload) if payload is not None else 0)
        if direct and self.idle and not self._send_now(header, payload, None, size):
            return True
        queued = self.queued_results
        if self._released or (queued and queued + size > REPLY_BUDGET_PER_CONNECTION):
            return False
        if not self._replies.admits(size):
            return False
        self._charge(size)
        self._items.append((header, payload, None, size, 0, None))
        self._wakeup.set()
        return True

    def append_error(self, header: bytes) -> None:
        """Queue an error reply (a refusal, a handler's failure) within ``ERROR_ROOM``, else
        raise RepliesUnread."""
        if self._queued_errors + len(header) > ERROR_ROOM:
            raise RepliesUnread(
                f"{self._queued_errors} bytes of error replies and {self.queued_results} of results unread"
            )
        self._queued_errors += len(header)
        self._items.append((header, None, None, 0, len(header), None))
        self._wakeup.set()

    def _charge(self, result_bytes: int) -> None:
        self.queued_results += result_bytes
        self._replies.charge(result_bytes)

    def _written(self, item: _Outgoing) -> None:
        """An item left the queue for the wire: its reply bytes no longer count."""
        if item[3]:
            self.queued_results -= item[3]
            self._replies.refund(item[3])
        self._queued_errors -= item[4]

    def _send_now(self, header: bytes, payload: memoryview | None, encrypted: trio.Event | None, result: int) -> bool:
        """The fast path (see the module docstring); False once the message is handled, True if it
        is for the writer (too large, or no socket to write to directly)."""
        size = len(header) + (len(payload) if payload is not None else 0)
        if not self._fast or size > FAST_PATH_MAX or self._items:
            return True
        self._ensure_room(size + 2 * _RECORD_OVERHEAD)
        view, seal = self._view, self._channel.seal_into
        position = seal(header, view)
        # An empty payload is no record at all: its header announces 0 bytes, so the receiver reads
        # the next record as a header (as the writer's split into records yields none for it).
        if payload:
            position += seal(payload, view[position:])
        sent = self._channel.send_now(view[:position])
        self._sent_now_at = trio.current_time()
        self._traffic.bytes_sent += sent
        if sent == position:
            if encrypted is not None:
                encrypted.set()
            return False
        # The kernel took only part: the rest goes first, from the writer, which we wake. (A result
        # counts whole: the budgets then hold at most one small message more than they say.)
        self.idle = False
        self._charge(result)
        self._items.append((header, None, encrypted, result, 0, bytes(view[sent:position])))
        self._wakeup.set()
        return False

    def _ensure_room(self, needed: int) -> None:
        """A send buffer of at least ``needed`` bytes: doubled (or as large as needed) up to
        BATCH_BUFFER_SIZE for small messages; for a larger record the full SEND_BUFFER_SIZE, which
        has room for the messages around it, so a payload goes out in as few writes as before."""
        if len(self._buffer) < needed:
            size = SEND_BUFFER_SIZE if needed > BATCH_BUFFER_SIZE else max(needed, 2 * len(self._buffer))
            self._buffer = bytearray(min(size, SEND_BUFFER_SIZE))
            self._view = memoryview(self._buffer)
            if self.idle:  # grown by the fast path: the idle writer must time its release again
                self._wakeup.set()

    async def _wait_for_work(self) -> None:
        """Until something is queued; the send buffer goes back to its small size once the
        connection has had nothing to send for SEND_BUFFER_IDLE_RELEASE seconds."""
        while not self._items:
            self._wakeup = trio.Event()
            self.idle = True
            try:
                if len(self._buffer) <= INITIAL_SEND_BUFFER_SIZE:
                    await self._wakeup.wait()
                    continue
                with trio.move_on_after(SEND_BUFFER_IDLE_RELEASE) as quiet:
                    await self._wakeup.wait()
                quiet_for = trio.current_time() - self._sent_now_at  # the fast path uses it too
                if quiet.cancelled_caught and quiet_for >= SEND_BUFFER_IDLE_RELEASE:
                    self._buffer = bytearray(INITIAL_SEND_BUFFER_SIZE)
                    self._view = memoryview(self._buffer)
            finally:
                self.idle = False

    @property
    def buffer_size(self) -> int:
        """Bytes of send buffer held now (what this connection's sending costs at rest)."""
        return len(self._buffer)

    def release(self) -> None:
        """The connection is gone: wake every sender still waiting for its payload to go out."""
        self._released = True
        for item in self._items:
            self._written(item)  # (never will be: what it held goes back to the budgets)
            if item[2] is not None:
                item[2].set()
        self._items.clear()

    async def write_loop(self) -> None:
        """Send queued messages until cancelled (or the channel breaks)."""
        channel, traffic = self._channel, self._traffic
        seal = channel.seal_into
        items = self._items
        item: _Outgoing | None = None
        counted = False
        try:
            while True:
                await self._wait_for_work()
                buffer, view = self._buffer, self._view  # the fast path or the idle release may have replaced them
                position = 0
                while items:
                    item = items.popleft()
                    header, payload, encrypted, _result, _error, sealed = item
                    counted = True  # its reply bytes count until it is out of our hands
                    if sealed is not None:
                        if position:  # (never: a sealed item is queued only with nothing ahead of it)
                            await channel.send_all(view[:position])
                            traffic.bytes_sent += position
                            position = 0
                        await channel.send_all(memoryview(sealed))
                        traffic.bytes_sent += len(sealed)
                        self._written(item)
                        counted = False
                        if encrypted is not None:
                            encrypted.set()
                        continue
                    if payload is None and position + len(header) + _RECORD_OVERHEAD <= len(buffer):
                        position += seal(header, view[position:])  # most messages: one small record
                    else:
                        chunks = [header]
                        if payload is not None:
                            chunks.extend(
                                payload[i : i + MAX_RECORD_PLAINTEXT]
                                for i in range(0, len(payload), MAX_RECORD_PLAINTEXT)
                            )
                        for chunk in chunks:
                            if position + len(chunk) + _RECORD_OVERHEAD > len(buffer):
                                if position:
                                    await channel.send_all(view[:position])
                                    traffic.bytes_sent += position
                                    position = 0
                                if len(chunk) + _RECORD_OVERHEAD > len(buffer):
                                    self._ensure_room(len(chunk) + _RECORD_OVERHEAD)
                                    buffer, view = self._buffer, self._view
                            position += seal(chunk, view[position:])
                    self._written(item)
                    counted = False
                    if encrypted is not None:
                        encrypted.set()
                    if position >= len(buffer) // 2:
                        break  # flush what we have; the rest goes in the next batch
                if position:
                    await channel.send_all(view[:position])
                    traffic.bytes_sent += position
                if items and len(buffer) < BATCH_BUFFER_SIZE:  # a burst of small messages: batch more
                    self._ensure_room(2 * len(buffer))
        finally:
            self.idle = False
            # A message cut off half-way (the writer was cancelled in a send_all) is never finished:
            # it goes back to the queue, whose senders ``release()`` wakes once the connection has
            # recorded its error, so its sender sees that error instead of returning as if sent.
            if item is not None and item[2] is not None and not item[2].is_set():
                items.appendleft(item)  # (still counted: release() refunds it with the rest)
            elif item is not None and counted:
                self._written(item)
