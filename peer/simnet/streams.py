"""Simulated connections: pairs of in-memory trio streams whose bytes arrive when the model says.

Each direction of a connection is a ``Flow``: segments in the order they were sent, each with the
time it arrives. A receiver takes a segment once trio's clock has reached its arrival and the link
is alive; a sender hands its bytes to the model in segments of ``SEGMENT_BYTES`` and is held while
more than ``SEND_BUFFER_BYTES`` of what its host gave the uplink has not left it yet (a socket whose
send buffer is full), so a fast writer cannot run ahead of its link, and a small message costs no
wait. While the link is dead (``model.py``) nothing is delivered and senders wait for it.

A reader waiting for bytes sleeps until the head segment's arrival; a segment sent to a reader
that waits moves its wake-up to that segment's arrival (``Flow.waiting``) instead of waking it to
look: a simulation of many peers is mostly small messages, and each spurious wake-up is a trip
through trio's scheduler.
A flow holds at most ``RECEIVE_WINDOW_BYTES`` that its reader has not taken (in flight or
arrived): a sender to a reader that does not read waits, as on a full TCP window, until it reads.

Closing one end delivers the end of the stream to the other after what was sent before it; a
sender whose far end is closed gets ``BrokenResourceError`` (the reset a closed TCP socket sends).
A host that left the network breaks its own ends at once (``BrokenResourceError``); the far ends
hear nothing, as from a switched-off machine, and find out by their own deadlines: closing an
end on a host that left (its tasks cancelled) marks only that end closed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import trio

from .model import NetworkModel

__all__ = ["SimStream", "Flow", "SEGMENT_BYTES", "SEND_BUFFER_BYTES", "RECEIVE_WINDOW_BYTES"]

# Bytes per segment given to the model: small enough that connections sharing an uplink take turns
# (64 KiB is ~50 ms at 10 Mbit/s), large enough that a sender makes few trips through the loop.
SEGMENT_BYTES = 64 * 1024

# What a sender may have given its uplink beyond what has left it before ``send_all`` holds it: a
# socket's send buffer at Linux's initial size (tcp_wmem's default, 16 KiB) and then some: a
# request or a reply leaves the writer at once, a bulk transfer keeps pace with the link.
SEND_BUFFER_BYTES = 64 * 1024

# Unread bytes a flow holds before its sender waits: of the order of what Linux lets one TCP
# connection buffer for a reader that does not read (its receive buffer plus its send buffer, each
# autotuned by default up to a few MiB).
# More than any simulated path has in flight (100 Mbit/s for ~150 ms is ~1.9 MB), so a reader that
# keeps up never meets it.
RECEIVE_WINDOW_BYTES = 4 * 1024 * 1024


class Flow:
    """One direction of a simulated connection: segments in flight, then possibly its end."""

    def __init__(self, source: str, destination: str):
        self.source, self.destination = source, destination
        # (arrives at, bytes, how many bytes on the links each stands for: ``bulk_scale``), in order
        self.segments: deque[tuple[float, bytes, float]] = deque()
        self.unread = 0.0  # bytes on the links that ``segments`` stand for: sent, not yet taken
        self.ends_at: float | None = None  # when the end of the stream arrives, once the sender closed
        self.receiver_closed = False
        self.changed = trio.lowlevel.ParkingLot()
        self.waiting: trio.CancelScope | None = None  # the reader's sleep until the head arrives
        self.accepted = 0  # bytes the sender handed over (those waiting for the link or room too)
        self.sent = 0  # bytes of them on the links: in ``segments`` or taken since
        self.unsent = 0  # bytes of a write waiting for room in the receiver's window, not the link

    def arrived(self, now: float) -> int:
        """Bytes of those sent that have reached the receiver by ``now`` (taken or not)."""
        in_transit = 0
        for arrives_at, piece, _ in reversed(self.segments):  # (the latest sent arrive last)
            if arrives_at <= now:
                break
            in_transit += len(piece)
        return self.sent - in_transit

    def arriving(self, arrives_at: float) -> None:
        """A segment was added: a reader asleep until later wakes at its arrival instead."""
        if self.waiting is not None and arrives_at < self.waiting.deadline:
            self.waiting.deadline = arrives_at

    def notify(self) -> None:
        self.changed.unpark_all()


class SimStream(trio.abc.HalfCloseableStream):
    """One end of a simulated connection: ``local`` and ``remote`` are ``(host, port)``."""

    def __init__(
        self,
        model: NetworkModel,
        local: tuple[str, int],
        remote: tuple[str, int],
        outgoing: Flow,
        incoming: Flow,
        on_close: Callable[[SimStream], None],
    ):
        self.model = model
        self.on_close = on_close  # the network forgets a closed end
        self.local, self.remote = local, remote
        self._outgoing, self._incoming = outgoing, incoming
        self._closed = False
        self._link_seen = (0, 0)  # (delivered, arrived) when the link was last seen alive

    @property
    def flows(self) -> tuple[Flow, Flow]:
        return self._outgoing, self._incoming

    # ------------------------------------------------------------------ sending
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if not view:
            await trio.lowlevel.checkpoint()
            self._check_can_send()
        # A bulk write stands for ``scale`` times its bytes: it goes in pieces that stand for a
        # segment each, so that other connections' segments take turns with it on the uplink.
        scale = self.model.write_scale(len(view))
        step = max(1, int(SEGMENT_BYTES / scale))
        for start in range(0, len(view), step):
            piece = bytes(view[start : start + step])  # a copy: callers reuse their buffers
            size = len(piece) * scale
            flow = self._outgoing
            flow.accepted += len(piece)
            try:
                await self._wait_for_link_and_room(size, len(piece))
                self._check_can_send()
            except BaseException:
                flow.accepted -= len(piece)  # (a write given up: its bytes never went out)
                raise
            segment = self.model.send(flow.source, flow.destination, trio.current_time(), round(size))
            flow.segments.append((segment.arrives_at, piece, scale))
            flow.sent += len(piece)
            flow.unread += size
            flow.arriving(segment.arrives_at)
            room_at = segment.sent_at - SEND_BUFFER_BYTES / self.model.hosts[flow.source].uplink
            if room_at > trio.current_time():
                await trio.sleep_until(room_at)
            else:
                await trio.lowlevel.checkpoint()

    def link_counts(self) -> tuple[int, int, int]:
        """What a TCP socket's kernel tells of its link: ``(delivered, arrived, in_flight)``, the
        bytes of ours that reached the far end, the bytes of its that reached us, and the bytes we
        handed over that have not reached it (``SecureChannel.link_progress`` and ``in_flight``).
        A write held while the link is down counts as in flight, as a socket's kernel holds it
        unacknowledged; one held by a full receive window does not, as it waits unsent in a
        socket's queue. The connection's dead-link check (``peer/link_silence.py``) then sees
        what it sees on a real socket, and drops a connection whose link stays silent."""
        outgoing = self._outgoing
        if self.model.linked(outgoing.source, outgoing.destination):  # (a dead link delivers nothing)
            now = trio.current_time()
            self._link_seen = outgoing.arrived(now), self._incoming.arrived(now)
        delivered, arrived = self._link_seen
        return delivered, arrived, outgoing.accepted - outgoing.unsent - delivered

    def _check_can_send(self) -> None:
        if self._closed or self._outgoing.ends_at is not None:
            raise trio.ClosedResourceError("this end of the stream is closed")
        self._check_host()
        if self._outgoing.receiver_closed:
            raise trio.BrokenResourceError("the far end closed the connection")

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._outgoing.ends_at is None:
            self._end_outgoing()

    def _end_outgoing(self) -> None:
        flow = self._outgoing
        model = self.model
        now = trio.current_time()
        last = flow.segments[-1][0] if flow.segments else now
        linked = model.linked(flow.source, flow.destination)
        delay = model.one_way_delay(flow.source, flow.destination) if linked else 0.0
        flow.ends_at = max(now + delay, last)
        flow.notify()

    # ------------------------------------------------------------------ receiving
    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while True:
            ready = self._ready()
            if ready is not None:
                data = self._take(ready, max_bytes) if ready else b""
                await trio.lowlevel.cancel_shielded_checkpoint()  # taken: a cancel must not lose it
                return data
            await self._wait_for_arrival()

    async def peek_first_byte(self) -> bytes:
        """The next byte this end will receive, left in place (b"" at the end of the stream)."""
        while True:
            ready = self._ready()
            if ready is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return ready[1][:1] if ready else b""
            await self._wait_for_arrival()

    def _ready(self) -> tuple[float, bytes, float] | tuple[()] | None:
        """The head segment if it has arrived, () at an arrived end of stream, None otherwise."""
        if self._closed:
            raise trio.ClosedResourceError("this end of the stream is closed")
        self._check_host()
        flow = self._incoming
        now = trio.current_time()
        if not self.model.linked(flow.source, flow.destination):
            return None
        if flow.segments:
            head = flow.segments[0]
            return head if head[0] <= now else None
        if flow.ends_at is not None and flow.ends_at <= now:
            return ()
        return None

    def _take(self, head: tuple[float, bytes, float], max_bytes: int | None) -> bytes:
        flow = self._incoming
        arrived, data, scale = head
        if max_bytes is not None and max_bytes < len(data):
            flow.segments[0] = (arrived, data[max_bytes:], scale)
            data = data[:max_bytes]
        else:
            flow.segments.popleft()
        flow.unread = max(0.0, flow.unread - len(data) * scale)
        flow.notify()  # a sender waiting for room in the window goes on
        return data

    async def _wait_for_arrival(self) -> None:
        flow = self._incoming
        if not self.model.linked(flow.source, flow.destination):
            await flow.changed.park()  # the network wakes every flow when a link changes
            return
        if flow.segments:
            wake_at = flow.segments[0][0]
        else:
            wake_at = flow.ends_at if flow.ends_at is not None else math.inf
        with trio.move_on_at(wake_at) as sleep:
            flow.waiting = sleep
            try:
                await flow.changed.park()
            finally:
                flow.waiting = None

    async def _wait_for_link_and_room(self, size: float, piece: int) -> None:
        flow = self._outgoing
        while not (linked := self.model.linked(flow.source, flow.destination)) or (
            flow.unread + size > RECEIVE_WINDOW_BYTES
        ):
            self._check_can_send()
            flow.unsent = piece if linked else 0  # (a closed window holds it in our own queue)
            try:
                await flow.changed.park()  # woken by link changes, the reader taking, the far end closing
            finally:
                flow.unsent = 0

    def _check_host(self) -> None:
        if self.local[0] not in self.model.hosts:
            raise trio.BrokenResourceError(f"{self.local[0]} has left the network")

    # ------------------------------------------------------------------ closing
    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        """``aclose`` without the checkpoint (for an end whose dial was given up)."""
        if not self._closed:
            self._closed = True
            if self.local[0] in self.model.hosts:
                self._close_flows()
            # else: a host that left sends nothing more, not even its close; the far end hears nothing
            self.on_close(self)

    def _close_flows(self) -> None:
        """The end of our stream to the far end, and a reset for whatever it sends us from now on."""
        if self._outgoing.ends_at is None:
            self._end_outgoing()
        incoming = self._incoming
        incoming.receiver_closed = True
        incoming.segments.clear()
        incoming.unread = 0.0
        incoming.notify()
        self._outgoing.notify()  # a send of ours stalled on a dead link or a full window gives up
