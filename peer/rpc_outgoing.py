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
"""

from __future__ import annotations

from collections import deque

import trio

from .framing import AEAD_TAG_SIZE, HEADER, MAX_RECORD_PLAINTEXT
from .rpc_protocol import MAX_PAYLOAD, STREAM_WINDOW
from .secure_channel import SecureChannel

__all__ = ["SendQueue", "TrafficCounter", "RepliesUnread"]

# One send buffer: a full record plus room for the small messages around it (the header that
# announces a payload goes out in the same syscall as the payload's first record). Not more: a
# buffer of several records makes the receiver idle while the sender encrypts all of them, and
# measured no cheaper per byte.
SEND_BUFFER_SIZE = MAX_RECORD_PLAINTEXT + 64 * 1024 + 2 * (HEADER.size + AEAD_TAG_SIZE)
# Most connections (DHT, matchmaking) only ever carry small messages: start small, grow to
# SEND_BUFFER_SIZE on the first large payload. A 50-node swarm in one process otherwise holds
# 50 x 49 x 4 MiB of zeroed buffers.
INITIAL_SEND_BUFFER_SIZE = 64 * 1024
_RECORD_OVERHEAD = HEADER.size + AEAD_TAG_SIZE
# The fast path takes messages up to this size (header plus payload): DHT and control traffic.
# Larger payloads go through the writer, which splits them into records and batches them.
FAST_PATH_MAX = 16 * 1024
# Replies (results, errors, refusals) queued for a peer that does not read them: one maximal
# payload plus a window of small ones. Beyond that the peer is making us buffer what it asks for
# faster than it takes it, and the connection is closed.
MAX_QUEUED_REPLY_BYTES = MAX_PAYLOAD + STREAM_WINDOW


class RepliesUnread(Exception):
    """The peer left more than ``MAX_QUEUED_REPLY_BYTES`` of replies unread."""


class TrafficCounter:
    """Bytes on the wire (records and their headers, after the handshake), for metrics and for
    comparing how much each training mode communicates."""

    __slots__ = ("bytes_sent", "bytes_received")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


# A queued message: (header, payload or None, ``encrypted`` event or None, bytes counted against
# MAX_QUEUED_REPLY_BYTES until written, records the fast path already encrypted or None). A plain
# tuple: one is made per message, and a class's __init__ cost a Python call each.
_Outgoing = tuple[bytes, "memoryview | None", "trio.Event | None", int, "bytes | None"]


class SendQueue:
    """What a connection has yet to send, in order, and the loop that sends it."""

    def __init__(self, channel: SecureChannel, traffic: TrafficCounter) -> None:
        self._channel = channel
        self._traffic = traffic
        self._items: deque[_Outgoing] = deque()
        self._queued_reply_bytes = 0
        self._wakeup = trio.Event()
        # True only while the writer waits for work with nothing queued: the fast path may then use
        # the send buffer and the socket, which nothing else is touching. Read-only for others (a
        # sender need not work out whether it may go direct while the writer is busy anyway).
        self.idle = False
        self._fast = channel.can_send_now
        self._buffer = bytearray(INITIAL_SEND_BUFFER_SIZE)
        self._view = memoryview(self._buffer)

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
        self._items.append((header, payload, encrypted, 0, None))
        self._wakeup.set()

    def append_reply(self, header: bytes, payload: memoryview | None = None, *, direct: bool = False) -> None:
        """Queue what the peer asked for, within ``MAX_QUEUED_REPLY_BYTES`` (else RepliesUnread)."""
        size = len(header) + (len(payload) if payload is not None else 0)
        if self._queued_reply_bytes + size > MAX_QUEUED_REPLY_BYTES:
            raise RepliesUnread(f"{self._queued_reply_bytes} bytes of replies unread")
        if direct and self.idle and not self._send_now(header, payload, None, size):
            return
        self._queued_reply_bytes += size
        self._items.append((header, payload, None, size, None))
        self._wakeup.set()

    def _send_now(self, header: bytes, payload: memoryview | None, encrypted: trio.Event | None, reply: int) -> bool:
        """The fast path (see the module docstring); False once the message is handled, True if it
        is for the writer (too large, or no socket to write to directly)."""
        size = len(header) + (len(payload) if payload is not None else 0)
        if not self._fast or size > FAST_PATH_MAX or self._items:
            return True
        view, seal = self._view, self._channel.seal_into
        position = seal(header, view)
        # An empty payload is no record at all: its header announces 0 bytes, so the receiver reads
        # the next record as a header (as the writer's split into records yields none for it).
        if payload:
            position += seal(payload, view[position:])
        sent = self._channel.send_now(view[:position])
        self._traffic.bytes_sent += sent
        if sent == position:
            if encrypted is not None:
                encrypted.set()
            return False
        # The kernel took only part: the rest goes first, from the writer, which we wake.
        self.idle = False
        self._queued_reply_bytes += reply
        self._items.append((header, None, encrypted, reply, bytes(view[sent:position])))
        self._wakeup.set()
        return False

    def release(self) -> None:
        """The connection is gone: wake every sender still waiting for its payload to go out."""
        for item in self._items:
            if item[2] is not None:
                item[2].set()
        self._items.clear()

    async def write_loop(self) -> None:
        """Send queued messages until cancelled (or the channel breaks)."""
        channel, traffic = self._channel, self._traffic
        buffer, view = self._buffer, self._view
        seal = channel.seal_into
        items = self._items
        item: _Outgoing | None = None
        try:
            while True:
                while not items:
                    self._wakeup = trio.Event()
                    self.idle = True
                    try:
                        await self._wakeup.wait()
                    finally:
                        self.idle = False
                position = 0
                while items:
                    item = items.popleft()
                    header, payload, encrypted, reply_bytes, sealed = item
                    self._queued_reply_bytes -= reply_bytes
                    if sealed is not None:
                        if position:  # (never: a sealed item is queued only with nothing ahead of it)
                            await channel.send_all(view[:position])
                            traffic.bytes_sent += position
                            position = 0
                        await channel.send_all(memoryview(sealed))
                        traffic.bytes_sent += len(sealed)
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
                                    view.release()
                                    buffer = self._buffer = bytearray(SEND_BUFFER_SIZE)
                                    view = self._view = memoryview(buffer)
                            position += seal(chunk, view[position:])
                    if encrypted is not None:
                        encrypted.set()
                    if position >= len(buffer) // 2:
                        break  # flush what we have; the rest goes in the next batch
                if position:
                    await channel.send_all(view[:position])
                    traffic.bytes_sent += position
        finally:
            self.idle = False
            # A message cut off half-way (the writer was cancelled in a send_all) is never finished:
            # it goes back to the queue, whose senders ``release()`` wakes once the connection has
            # recorded its error, so its sender sees that error instead of returning as if sent.
            if item is not None and item[2] is not None and not item[2].is_set():
                items.appendleft(item)
