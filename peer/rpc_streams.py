"""The application's side of RPC streams, and the per-call state the connection keeps for them.

``Connection`` (``peer/rpc.py``) creates these. A stream sees its connection only through
``StreamTransport``: the call rules to build headers with, a queue to hand them to, and a way to
return credit. It waits on the call's events and holds no I/O of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import trio

from .buffers import byte_view
from .identity import PeerID
from .message import Message
from .rpc_errors import MESSAGE_TOO_LARGE, MessageTooLargeError, StreamClosed
from .rpc_protocol import RPCProtocol, StreamData

__all__ = ["BufferProvider", "ClientStream", "PendingCall", "ServerStream", "StreamTransport"]


class StreamTransport(Protocol):
    """The part of a connection that its streams use (``Connection`` provides it)."""

    remote_peer_id: PeerID
    protocol: RPCProtocol  # the call's state: liveness, credit, and the headers to send

    def enqueue(self, header: bytes, payload: memoryview | None = None, encrypted: trio.Event | None = None) -> None:
        """Queue ``header`` (then ``payload``) for sending; set ``encrypted`` once the payload has
        been encrypted, or the connection has died (the call's ``error`` then says so), after which
        its buffer may be reused."""

    def grant(self, call_id: int, nbytes: int, drained: bool = False) -> None:
        """The application has taken ``nbytes`` of the call's stream data (``drained``: and all
        that had arrived): let the peer send more."""

    def link_progress(self) -> tuple[int, int]:
        """``(delivered, arrived)`` bytes of the whole connection so far, counted at the socket."""

    def set_pacing_rate(self, bytes_per_s: float | None) -> bool:
        """Cap how fast the whole connection sends (None: no cap); False where it cannot."""


class PendingCall:
    """Caller-side state of one call: a result slot (unary) or a queue of messages (stream)."""

    __slots__ = ("method", "done", "result", "error", "queue", "arrived", "credit", "ended", "buffer_provider")

    def __init__(self, method: str) -> None:
        self.method = method
        self.done = trio.Event()
        self.result: Message | None = None
        self.error: BaseException | None = None
        self.queue: deque[StreamData] = deque()
        self.arrived = trio.Event()
        self.credit = trio.Event()
        self.ended = False  # the other side will send nothing more
        self.buffer_provider: BufferProvider | None = None

    def fail(self, error: BaseException) -> None:
        """The call ends with ``error`` (or the error it already has): wake whoever waits on it."""
        if self.error is None:
            self.error = error
        self.done.set()
        self.arrived.set()
        self.credit.set()


# ``provider(body, nbytes)``: a writable buffer of exactly ``nbytes`` for the payload of the stream
# message whose body is ``body``, or None for a fresh one.
BufferProvider = Callable[[Any, int], Any]


class _StreamBase:
    """Shared by both ends of a stream call: credit-limited sends and an ordered receive queue."""

    def __init__(self, transport: StreamTransport, call_id: int, method: str, state: PendingCall):
        self._transport = transport
        self._call_id = call_id
        self.method = method
        self._state = state

    @property
    def peer(self) -> PeerID:
        return self._transport.remote_peer_id

    @property
    def link(self) -> StreamTransport:
        """The connection this stream runs on, as far as watching its progress goes
        (``link.link_progress()``); streams on one connection share one link."""
        return self._transport

    async def send(self, body: Any = None, payload: Any = None) -> None:
        """Send one message; waits until it fits the receiver's window (a message larger than the
        whole window waits for all of it). Returns once the payload has been encrypted, so the
        caller may reuse its buffer. A payload larger than the receiver accepts on this stream
        raises MessageTooLargeError (here, if the receiver said so in advance, or from the
        receiver, which then ends the call)."""
        transport, protocol, state = self._transport, self._transport.protocol, self._state
        view = byte_view(payload) if payload is not None else None
        nbytes = len(view) if view is not None else 0
        if nbytes > protocol.send_limit(self._call_id):
            limit = protocol.send_limit(self._call_id)
            text = f"a message of {nbytes} bytes; the receiver accepts at most {limit} on this stream"
            raise MessageTooLargeError(self.method, self.peer, MESSAGE_TOO_LARGE, text)
        while True:
            if state.error is not None:
                raise state.error
            if not protocol.is_live(self._call_id):
                raise StreamClosed(f"stream {self.method} to {self.peer} is closed")
            header = protocol.send_data(self._call_id, body, nbytes)
            if header is not None:
                break
            state.credit = trio.Event()
            await state.credit.wait()
        encrypted = trio.Event() if view is not None else None
        transport.enqueue(header, view, encrypted)
        if encrypted is not None:
            await encrypted.wait()
            if state.error is not None:  # released by a connection that died before sending it all
                raise state.error

    def set_buffer_provider(self, provider: BufferProvider | None) -> None:
        """Decrypt the payloads of incoming messages straight into buffers of the caller's choosing.

        ``provider(body, nbytes)`` is called on the connection's reader as soon as a message's
        header arrives (so it must be quick and must not block) with the message's body as the peer
        sent it (validate it: it comes from the network) and its payload size. It returns a
        writable, contiguous buffer of exactly ``nbytes`` bytes, which then becomes the payload of
        that message, or None to receive that payload into a fresh buffer as usual. This saves an
        allocation and a copy per message when the receiver has somewhere to put the bytes (the
        tensor a part belongs in, a buffer from a pool), as ``recv_into`` does for sockets. Up to a
        credit window of messages may be received before the application reads them, so a buffer
        must not be handed out again while its message may still be unread.

        A buffer handed out belongs to the connection until its message is received: if the stream
        fails first, the reader may still write into it, so do not reuse such a buffer. A server
        handler sets its provider in the ``prepare`` hook of ``Router.add_stream``: the handler
        task itself may start after the first messages have been received."""
        self._state.buffer_provider = provider

    @property
    def buffer_provider(self) -> BufferProvider | None:
        return self._state.buffer_provider

    async def receive(self) -> Message:
        """The next message; raises ``trio.EndOfChannel`` when the other side has ended."""
        state = self._state
        while not state.queue:
            if state.ended:  # (all it sent is here, even if the connection went down since)
                raise trio.EndOfChannel
            if state.error is not None:
                raise state.error
            state.arrived = trio.Event()
            await state.arrived.wait()
        item = state.queue.popleft()
        self._transport.grant(self._call_id, item.cost, drained=not state.queue)
        return Message(item.body, item.payload)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.receive()
            except trio.EndOfChannel:
                return


class ClientStream(_StreamBase):
    async def end(self) -> None:
        """Half-close: tell the handler no more messages will come (responses may still arrive)."""
        protocol = self._transport.protocol
        if protocol.is_live(self._call_id) and not self._state.ended:
            self._transport.enqueue(protocol.end_stream(self._call_id))


class ServerStream(_StreamBase):
    pass
