"""RPC over one secure channel: the trio driver around ``RPCProtocol``.

A ``Connection`` runs two tasks (a reader and a writer) plus one task per incoming call, all in the
nursery of ``Connection.run``; when the peer goes away, everything it started is cancelled and every
call waiting on it fails with ``ConnectionLost``, and every send waiting for its message to go out
is released (``rpc_outgoing.py``: the queue of outgoing messages and the writer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from .address import PeerAddress, Route
from .buffers import byte_view
from .framing import ProtocolError
from .identity import PeerID
from .link_silence import UNANSWERED_PROBES, LinkSilence
from .node_id import NodeIDProof
from .router import Message, Request, Router
from .rpc_errors import (
    BUSY,
    DEADLINE_EXCEEDED,
    UNKNOWN_METHOD,
    CallTimeoutError,
    ConnectionLost,
    error_code,
    remote_error,
)
from .rpc_events import (
    CallCancelled,
    CallFailed,
    CallOpened,
    CallResult,
    CreditGranted,
    PeerLeaving,
    StreamData,
    StreamEnd,
)
from .rpc_outgoing import RepliesUnread, SendQueue, TrafficCounter
from .rpc_protocol import MAX_STREAM_MESSAGE, RPCProtocol
from .rpc_reading import RecordReader
from .rpc_streams import ClientStream, PendingCall, ServerStream
from .secure_channel import SecureChannel

__all__ = ["Connection", "ClientStream", "ServerStream", "TrafficCounter"]

log = logging.getLogger("peerd.rpc")

# A retiring connection (GOAWAY said, see ``rpc_protocol.py``) closes once drained, looked at first
# after RETIRE_POLL and then at doubling intervals up to RETIRE_POLL_MAX (most drain within a round
# trip; a call that crossed the GOAWAY may take minutes, a state download). A peer that has not
# answered our GOAWAY within RETIRE_GRACE is closed on; calls it crossed with end by their own deadlines.
RETIRE_POLL = 0.01
RETIRE_POLL_MAX = 1.0
RETIRE_GRACE = 30.0
RETIRED = "connection retired (idle)"


class Connection:
    """One RPC connection to a peer. Use ``await connection.run()`` in a nursery to drive it."""

    def __init__(
        self,
        channel: SecureChannel,
        router: Router | None,
        *,
        serve: bool = True,
        traffic: TrafficCounter | None = None,
        relayed_via: PeerID | None = None,
        seen_from: tuple[str, int] | None = None,
    ):
        """``relayed_via``: the relay this connection runs through (None: a direct connection);
        ``seen_from``: the far end's ``(host, port)`` as our transport sees it (None for a relayed
        connection, whose stream ends at the relay)."""
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.channel = channel
        self.router = router if router is not None else Router()
        self.serve = serve  # False for client-mode peers: incoming calls are refused
        self.protocol = RPCProtocol(channel.initiator, max_message=self.router.max_message)
        self.remote_hello = channel.remote_hello
        self.route = Route(relayed_via, seen_from)
        self.closed = trio.Event()
        self._outgoing = SendQueue(channel, self.traffic)
        self._pending: dict[int, PendingCall] = {}
        self._handler_scopes: dict[int, trio.CancelScope] = {}
        self._woken = 0  # callers whose result has arrived and who have not run since (see _alone)
        self._nursery: trio.Nursery | None = None
        self._cancel_scope = trio.CancelScope()
        self._close_reason: str = "connection closed"
        self.silence = LinkSilence()  # how long calls have waited on a link that said nothing

    @property
    def relayed_via(self) -> PeerID | None:
        return self.route.relayed_via

    @property
    def seen_from(self) -> tuple[str, int] | None:
        return self.route.seen_from

    @property
    def remote_peer_id(self) -> PeerID:
        """Who is at the other end, as the handshake authenticated it."""
        return self.channel.remote_peer_id

    @functools.cached_property
    def remote_listen_address(self) -> PeerAddress | None:
        """Where the peer accepts connections, as its hello says (``Hello.listen_address``). Worked
        out once: every request a handler receives carries it."""
        return self.remote_hello.listen_address(self.remote_peer_id, self._seen_host)

    def _seen_host(self) -> str | None:
        return None if self.seen_from is None else self.seen_from[0]

    def remote_moved(self, listen_addresses: tuple[str, ...]) -> None:
        """The peer told us where it is reached now (``peer/nat.py``): those addresses replace its
        hello's on this connection (none: it serves no calls, as a client-mode peer)."""
        self.remote_hello = dataclasses.replace(
            self.remote_hello, listen_addresses=listen_addresses, client_mode=not listen_addresses
        )
        self.__dict__.pop("remote_listen_address", None)  # worked out again from the new hello

    @functools.cached_property
    def remote_node_id(self) -> NodeIDProof:
        """The node-ID proof the peer showed in its hello (verified by the handshake). Worked out
        once: both of its hashes would otherwise be redone for every request to or from the peer."""
        return NodeIDProof(self.remote_peer_id, self.remote_hello.node_id_nonce)

    # ------------------------------------------------------------------ lifetime
    async def run(self) -> None:
        """Serve the connection until the peer leaves, a protocol error occurs, or ``close()``.

        Never raises for anything the peer does: a misbehaving peer costs its own connection only.
        """
        try:
            with self._cancel_scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._until_failure, self._write)
                    nursery.start_soon(self._until_failure, self._read)
        finally:
            self._fail_all(ConnectionLost(self._close_reason))
            self._outgoing.release()  # after _fail_all: a released sender finds its call's error
            self.protocol.close()
            self.closed.set()
            await self.channel.aclose()

    async def _until_failure(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run the reader or writer; whichever stops first takes the connection down with it."""
        try:
            await loop()
        except ProtocolError as error:
            self._close_reason = f"protocol error from peer {self.remote_peer_id}: {error}"
            log.warning("dropping connection: %s", self._close_reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self._close_reason = f"connection to {self.remote_peer_id} broke: {error!r}"
        except Exception as error:  # a bug of ours: log it loudly, but keep the process serving
            self._close_reason = f"internal error on connection to {self.remote_peer_id}: {error!r}"
            log.exception("closing connection after an internal error")
        finally:
            self._cancel_scope.cancel()

    @property
    def takes_calls(self) -> bool:
        """Whether a new call may start here: not closed or closing, and not retiring."""
        return not self.is_closed and not self.protocol.goaway.sent

    def retire(self) -> None:
        """Close the connection without losing a call: say GOAWAY, open no more calls here, and
        close once both sides have said it and every call that crossed it has ended."""
        if self.is_closed or self._nursery is None or (header := self.protocol.go_away()) is None:
            return
        self.enqueue(header)
        self._nursery.start_soon(self._close_when_drained)

    @property
    def retired(self) -> bool:
        """Both sides said GOAWAY: it closes (or closed) because it was idle, not for a failure."""
        return self.protocol.goaway.sent and self.protocol.goaway.received

    async def _close_when_drained(self) -> None:
        give_up, delay = trio.current_time() + RETIRE_GRACE, RETIRE_POLL
        while not (self.protocol.drained and self._outgoing.idle):
            if not self.protocol.goaway.received and trio.current_time() >= give_up:
                self._close_reason = f"peer {self.remote_peer_id} did not answer GOAWAY within {RETIRE_GRACE:g} s"
                break
            await trio.sleep(delay)
            delay = min(2 * delay, RETIRE_POLL_MAX)
        else:
            self._close_reason = RETIRED
        self._cancel_scope.cancel()

    def close(self) -> None:
        """Stop the connection (non-blocking; ``closed`` is set once it is down)."""
        self._close_reason = "connection closed locally"
        self._cancel_scope.cancel()  # also works before run() has started: it then exits at once

    @property
    def is_closed(self) -> bool:
        """Closed, or closing: once the connection is told to go (``close()``, a failure, a silent
        link), no new call may start on it, and the host's pool dials afresh instead of handing it
        out again before its tasks have wound down."""
        return self._cancel_scope.cancel_called or self.closed.is_set()

    def set_pacing_rate(self, bytes_per_s: float | None) -> bool:
        """Cap how fast this connection sends (None: no cap), where its socket allows it
        (``SecureChannel.set_pacing_rate``)."""
        return self.channel.set_pacing_rate(bytes_per_s)

    @property
    def buffer_bytes(self) -> int:
        """Bytes its send and receive buffers hold now: small while the connection is quiet."""
        return self._outgoing.buffer_size + self.channel.decoder.buffer_size

    def link_progress(self) -> tuple[int, int]:
        """``(delivered, arrived)`` bytes of this connection so far, counted at the socket (see
        ``SecureChannel.link_progress``): what a caller watches to tell a slow peer from a stalled one."""
        return self.channel.link_progress()

    @property
    def close_reason(self) -> str:
        """Why the connection closed (meaningful once ``closed`` is set)."""
        return self._close_reason

    def _fail_all(self, error: BaseException) -> None:
        for state in self._pending.values():
            state.fail(error)
        self._pending.clear()

    # ------------------------------------------------------------------ calls
    def _deadline_budget(self, timeout: float | None) -> float | None:
        """The handler's time budget: our timeout, capped by any deadline of enclosing scopes."""
        deadline = trio.current_effective_deadline()
        if deadline != math.inf:
            remaining = max(deadline - trio.current_time(), 1e-3)
            timeout = remaining if timeout is None else min(timeout, remaining)
        return timeout

    def _check_open(self) -> None:
        if self.is_closed:
            raise ConnectionLost(self._close_reason)
        if self.protocol.goaway.sent:
            raise ConnectionLost(f"the connection to {self.remote_peer_id} is retiring: dial again")

    async def call(
        self, method: str, body: Any = None, *, payload: Any = None, timeout: float | None = None
    ) -> Message:
        """A unary call. Raises RemoteError (and subclasses), CallTimeoutError or ConnectionLost."""
        self._check_open()
        view = byte_view(payload) if payload is not None else None
        call_id, header = self.protocol.open_unary(
            method, body, len(view) if view is not None else 0, self._deadline_budget(timeout)
        )
        state = self._pending[call_id] = PendingCall(method)
        sent_at, progress = trio.current_time(), self.link_progress()
        outgoing = self._outgoing
        outgoing.append(header, view, direct=outgoing.idle and self._alone())
        try:
            with trio.move_on_after(timeout if timeout is not None else math.inf) as scope:
                await state.done.wait()
        finally:
            if state.result is not None:
                self._woken -= 1
            if not state.done.is_set():  # timed out or cancelled from outside: tell the peer
                self._abandon(call_id)
        if scope.cancelled_caught:
            self._check_link(sent_at, progress)
            raise CallTimeoutError(f"{method} on peer {self.remote_peer_id} timed out after {timeout} s")
        if state.error is not None:
            raise state.error
        assert state.result is not None
        self.silence.answered()
        return state.result

    def _check_link(self, sent_at: float, progress: tuple[int, int]) -> None:
        """A call timed out: close the connection if its link has been silent too long
        (``link_silence.py``), so that the next call dials a fresh one."""
        if self.is_closed:  # already going, for its own reason
            return
        if self.channel.in_flight() == 0 and self.channel.unanswered_probes() < UNANSWERED_PROBES:
            # Nothing we sent waits for the peer's kernel: the request is still in our own queue
            # (our event loop was held up), it waits for a peer that stopped reading to open its
            # receive window (its kernel answers the window probes), or everything was
            # acknowledged. No evidence against the link.
            return
        now = trio.current_time()
        if self.silence.call_timed_out(sent_at, progress, self.link_progress(), now):
            self._close_reason = (
                f"the link to {self.remote_peer_id} said nothing for {self.silence.limit:g} s while calls"
                " waited: taken for down"
            )
            log.info("dropping connection: %s", self._close_reason)
            self._cancel_scope.cancel()

    @asynccontextmanager
    async def stream(
        self, method: str, *, timeout: float | None = None, max_message: int = MAX_STREAM_MESSAGE
    ) -> AsyncIterator[ClientStream]:
        """Open a stream call; leaving the block early cancels it at the peer. ``max_message``: the
        largest message payload we accept from the handler (a larger one ends the call)."""
        self._check_open()
        call_id, header = self.protocol.open_stream(method, self._deadline_budget(timeout), max_message)
        state = self._pending[call_id] = PendingCall(method)
        self.enqueue(header)
        stream = ClientStream(self, call_id, method, state)
        try:
            with trio.fail_after(timeout if timeout is not None else math.inf):
                yield stream
        except trio.TooSlowError:
            raise CallTimeoutError(
                f"stream {method} on peer {self.remote_peer_id} timed out after {timeout} s"
            ) from None
        finally:
            if not state.ended:
                self._abandon(call_id)
            self._pending.pop(call_id, None)

    def _abandon(self, call_id: int) -> None:
        self._pending.pop(call_id, None)
        if not self.is_closed:
            header = self.protocol.cancel(call_id)
            if header is not None:
                self.enqueue(header)

    # ------------------------------------------------------------------ what streams use
    # (``StreamTransport`` in rpc_streams.py: the connection as its streams see it)
    def grant(self, call_id: int, nbytes: int, drained: bool = False) -> None:
        """The application took ``nbytes`` of a stream's data; re-grant credit when enough has."""
        header = self.protocol.consumed(call_id, nbytes, drained)
        if header is not None and not self.is_closed:
            self.enqueue(header)

    def enqueue(self, header: bytes, payload: memoryview | None = None, encrypted: trio.Event | None = None) -> None:
        """Queue a header built by ``self.protocol`` (and its payload) for the writer; ``encrypted``
        is set once the payload has been encrypted or the connection is gone, so its buffer may be
        reused."""
        self._outgoing.append(header, payload, encrypted)

    def _alone(self) -> bool:
        """Whether only one call (the caller's) is in progress on this connection: its messages
        may then take the send queue's fast path (``rpc_outgoing.py``). Callers woken by results
        that came in together count until they run: each is about to send its next call, and the
        first of them must not go out alone ahead of the rest, which the writer sends as one."""
        return len(self._pending) + len(self._handler_scopes) + self._woken == 1

    def _reply_result(self, call_id: int, header: bytes, payload: memoryview | None, direct: bool) -> None:
        """Queue a handler's result, or a Busy error in its place when the reply budgets do not hold
        it (the peer has left too much unread; ``rpc_outgoing.py``)."""
        if not self._outgoing.append_result(header, payload, direct=direct):
            self._reply(self.protocol.send_error(call_id, BUSY, self._outgoing.refusal_text()))

    def _reply(self, header: bytes) -> None:
        """Queue an error reply (a refusal, a handler's failure), within the room for errors."""
        try:
            self._outgoing.append_error(header)
        except RepliesUnread as error:
            self._close_reason = f"peer {self.remote_peer_id} left {error}"
            log.warning("dropping connection: %s", self._close_reason)
            self._cancel_scope.cancel()

    # ------------------------------------------------------------------ writing
    async def _write(self) -> None:
        await self._outgoing.write_loop()

    # ------------------------------------------------------------------ reading
    async def _read(self) -> None:
        reader = RecordReader(
            self.channel,
            self.protocol,
            self.traffic,
            on_event=self._handle_event,
            on_refusal=self._reply,
            payload_buffer=self._payload_buffer,
        )
        await reader.run()
        self._close_reason = RETIRED if self.retired else f"peer {self.remote_peer_id} closed the connection"

    def _payload_buffer(self, call_id: int, body: Any, nbytes: int) -> Any:
        """Where a stream message's payload goes: its stream's buffer provider's choice, if any."""
        state = self._pending.get(call_id)
        if state is None or state.buffer_provider is None:
            return None
        return state.buffer_provider(body, nbytes)

    def _handle_event(self, event: Any) -> None:
        if isinstance(event, CallOpened):
            self._start_handler(event)
        elif isinstance(event, CallResult):
            state = self._pending.pop(event.call_id, None)
            if state is not None:
                state.result = Message(event.body, event.payload)
                state.done.set()
                self._woken += 1
        elif isinstance(event, StreamData):
            state = self._pending.get(event.call_id)
            if state is not None:
                state.queue.append(event)
                state.arrived.set()
        elif isinstance(event, StreamEnd):
            state = self._pending.get(event.call_id)
            if state is not None:
                state.ended = True
                state.arrived.set()
                state.credit.set()
        elif isinstance(event, CreditGranted):
            state = self._pending.get(event.call_id)
            if state is not None:
                state.credit.set()
        elif isinstance(event, CallFailed):
            state = self._pending.pop(event.call_id, None)
            if state is not None:
                state.fail(remote_error(state.method, self.remote_peer_id, event.type_name, event.message))
        elif isinstance(event, CallCancelled):
            scope = self._handler_scopes.get(event.call_id)
            if scope is not None:
                scope.cancel()
        elif isinstance(event, PeerLeaving):
            self.retire()  # our GOAWAY answers theirs: neither side opens calls here any more

    # ------------------------------------------------------------------ serving
    def _start_handler(self, event: CallOpened) -> None:
        handler = self.router.lookup(event.method, event.unary) if self.serve else None
        if handler is None:
            if not self.serve:
                reason = "this peer is in client mode and serves no calls"
            elif self.router.lookup(event.method, not event.unary) is not None:
                actual, use = ("stream", "stream()") if event.unary else ("unary", "call()")
                reason = f"method {event.method!r} is a {actual} method; call it with {use}"
            else:
                reason = f"no such method {event.method!r}"
            self._reply(self.protocol.send_error(event.call_id, UNKNOWN_METHOD, reason))
            return
        if self._outgoing.backlogged:  # its earlier answers are unread: no handler runs for more
            self._reply(self.protocol.send_error(event.call_id, BUSY, self._outgoing.refusal_text()))
            return
        scope = trio.CancelScope()
        if event.timeout is not None:
            scope.deadline = trio.current_time() + event.timeout
        self._handler_scopes[event.call_id] = scope
        stream = None
        if not event.unary:
            # Registered now, not in the handler task: stream data may arrive before the task runs.
            state = self._pending[event.call_id] = PendingCall(event.method)
            stream = ServerStream(self, event.call_id, event.method, state)
            prepare = self.router.preparation(event.method)
            if prepare is not None:
                try:
                    prepare(stream)
                except Exception as error:  # a bug of the handler's: it fails this call only
                    log.exception("preparing a %s stream failed", event.method)
                    del self._pending[event.call_id], self._handler_scopes[event.call_id]
                    self._reply_error(event.call_id, error_code(error), str(error))
                    return
        assert self._nursery is not None
        self._nursery.start_soon(self._run_handler, event, handler, scope, stream)

    async def _run_handler(
        self, event: CallOpened, handler: Any, scope: trio.CancelScope, stream: ServerStream | None
    ) -> None:
        call_id = event.call_id
        try:
            with scope:
                if event.unary:
                    request = Request(self.remote_peer_id, event.body, event.payload, self.remote_listen_address, self)
                    result = await handler(request)
                    if not isinstance(result, Message):
                        result = Message(result)
                    view = byte_view(result.payload) if len(result.payload) else None
                    header = self.protocol.send_result(call_id, result.body, len(view) if view is not None else 0)
                    self._reply_result(call_id, header, view, self._outgoing.idle and self._alone())
                else:
                    try:
                        await handler(stream)
                    finally:
                        self._pending.pop(call_id, None)
                    if self.protocol.is_live(call_id):
                        self.enqueue(self.protocol.end_stream(call_id))
            if scope.cancelled_caught and self.protocol.is_live(call_id):
                self._reply(self.protocol.send_error(call_id, DEADLINE_EXCEEDED, "the handler ran out of time"))
        except Exception as error:
            log.debug("handler %s failed for %s", event.method, self.remote_peer_id, exc_info=True)
            self._reply_error(call_id, error_code(error), str(error))
        finally:
            self._handler_scopes.pop(call_id, None)

    def _reply_error(self, call_id: int, type_name: str, message: str) -> None:
        if self.protocol.is_live(call_id) and not self.is_closed:
            self._reply(self.protocol.send_error(call_id, type_name, message))
