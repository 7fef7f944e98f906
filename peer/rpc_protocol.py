"""The RPC multiplexing rules, sans I/O.

One ``RPCProtocol`` object per connection turns outgoing intentions into header bytes and incoming
plaintext records into events. It knows nothing of sockets, encryption or trio: ``peer/rpc.py``
drives it. Keeping the rules here means call bookkeeping (IDs, half-closes, credits, limits) is
tested with plain byte strings.

Wire format of a header (msgpack array), followed by ``payload_len`` raw bytes when non-zero:

    UNARY  [7, id, method, timeout, body, payload_len]   a whole request
    RESULT [8, id, body, payload_len]                    a whole response; ends the call
    OPEN   [1, id, method, timeout]                      opens a stream call
    DATA   [2, id, body, payload_len]                    one stream message (costs credit)
    END    [3, id]                                       the sender's half of a stream is done
    ERROR  [4, id, type_name, message]                   the handler failed; ends the call
    CANCEL [5, id]                                       the caller gave up; ends the call
    CREDIT [6, id, nbytes]                               the receiver can take nbytes more DATA

Call IDs are odd for calls opened by the connection's initiator and even for the responder, so both
sides can open calls on one connection without colliding (as in HTTP/2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .buffers import byte_view
from .framing import ProtocolError
from .packing import packb, unpackb
from .rpc_errors import BUSY

__all__ = [
    "RPCProtocol",
    "CallOpened",
    "StreamData",
    "StreamEnd",
    "CallResult",
    "CallFailed",
    "CallCancelled",
    "CreditGranted",
]

OPEN, DATA, END, ERROR, CANCEL, CREDIT, UNARY, RESULT = 1, 2, 3, 4, 5, 6, 7, 8

# A single message's raw payload may span many records; 256 MiB bounds what one hostile message
# can make us allocate, while a 64M-parameter float32 tensor still fits in one message.
MAX_PAYLOAD = 256 << 20
# HTTP/2's default SETTINGS_MAX_CONCURRENT_STREAMS is 100; tensor work needs more (1,000 in-flight
# calls are tested), and each idle call costs only a dict entry and a task.
MAX_CONCURRENT_CALLS = 4096
# Per-direction stream window: 16 MiB keeps a loopback pipe of 1 MiB records full (measured) while
# bounding what a slow reader makes the sender's peer buffer.
STREAM_WINDOW = 16 << 20
MAX_METHOD_NAME = 256
MAX_ERROR_TEXT = 4096


@dataclass(frozen=True)
class CallOpened:
    call_id: int
    method: str
    timeout: float | None
    unary: bool
    body: Any = None
    payload: bytes | bytearray = b""


@dataclass(frozen=True)
class StreamData:
    call_id: int
    body: Any
    payload: bytes | bytearray
    cost: int


@dataclass(frozen=True)
class StreamEnd:
    call_id: int


@dataclass(frozen=True)
class CallResult:
    call_id: int
    body: Any
    payload: bytes | bytearray


@dataclass(frozen=True)
class CallFailed:
    call_id: int
    type_name: str
    message: str


@dataclass(frozen=True)
class CallCancelled:
    call_id: int


@dataclass(frozen=True)
class CreditGranted:
    call_id: int
    nbytes: int


class _Call:
    __slots__ = ("local", "sent_done", "received_done", "send_credit", "receive_credit", "unacked")
    # A call the peer opened ends when we send END/RESULT/ERROR or it sends CANCEL; a call we opened
    # ends when the peer sends END/RESULT/ERROR or we cancel it.

    def __init__(self, local: bool, window: int):
        self.local = local  # True if we opened it
        self.sent_done = False
        self.received_done = False
        self.send_credit = window
        self.receive_credit = window
        self.unacked = 0  # bytes the application consumed but we have not re-granted yet


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(f"malformed RPC header: {what}")


class RPCProtocol:
    """Call multiplexing state of one connection.

    Outgoing methods return header bytes to send (followed by the payload, if any). Incoming records
    go to ``receive_header``; when it announces a payload, the driver fills ``payload_target()`` and
    calls ``payload_received``. A protocol violation on any of these paths raises ``ProtocolError``
    and leaves the object failed: every later input raises that same error. Late messages for calls
    that already ended are ignored, since they race with cancellation in normal operation.
    """

    def __init__(
        self,
        initiator: bool,
        *,
        max_concurrent_calls: int = MAX_CONCURRENT_CALLS,
        max_payload: int = MAX_PAYLOAD,
        window: int = STREAM_WINDOW,
    ):
        self.initiator = initiator
        self.max_concurrent_calls = max_concurrent_calls
        self.max_payload = max_payload
        self.window = window
        self._next_call_id = 1 if initiator else 2
        self._calls: dict[int, _Call] = {}
        self._remote_calls = 0
        self._outbox: list[bytes] = []
        self._pending: tuple | None = None  # header awaiting its payload
        # allocated only for payloads spanning records, unless the application supplied a buffer
        self._payload: Any = None
        self._payload_view: memoryview | None = None
        self._payload_len = 0
        self._payload_filled = 0
        self._header_size = 0
        # Set by the first protocol error on any incoming path; every incoming method (headers,
        # payloads, payload buffers) then raises it again, as h11's ERROR state: nothing half-works.
        self._failed: ProtocolError | None = None

    # ----------------------------------------------------------------- outgoing
    def _new_call(self) -> int:
        call_id = self._next_call_id
        self._next_call_id += 2
        self._calls[call_id] = _Call(local=True, window=self.window)
        return call_id

    def open_unary(self, method: str, body: Any, payload_len: int, timeout: float | None) -> tuple[int, bytes]:
        call_id = self._new_call()
        self._calls[call_id].sent_done = True
        return call_id, packb([UNARY, call_id, method, timeout, body, payload_len])

    def open_stream(self, method: str, timeout: float | None) -> tuple[int, bytes]:
        call_id = self._new_call()
        return call_id, packb([OPEN, call_id, method, timeout])

    def send_credit(self, call_id: int) -> int:
        call = self._calls.get(call_id)
        return call.send_credit if call is not None else 0

    def send_data(self, call_id: int, body: Any, payload_len: int) -> bytes:
        call = self._live(call_id)
        if call.sent_done:
            raise RuntimeError("cannot send on a stream after ending it")
        header = packb([DATA, call_id, body, payload_len])
        call.send_credit -= len(header) + payload_len
        return header

    def end_stream(self, call_id: int) -> bytes:
        """End our half of a stream. From the caller this is a half-close (responses may still come);
        from the handler it ends the whole call, since the handler has returned."""
        call = self._live(call_id)
        if call.local:
            call.sent_done = True
        else:
            self._forget_remote(call_id)
        return packb([END, call_id])

    def send_result(self, call_id: int, body: Any, payload_len: int) -> bytes:
        self._forget_remote(call_id)
        return packb([RESULT, call_id, body, payload_len])

    def send_error(self, call_id: int, type_name: str, message: str) -> bytes:
        self._forget_remote(call_id)
        return packb([ERROR, call_id, type_name, message[:MAX_ERROR_TEXT]])

    def cancel(self, call_id: int) -> bytes | None:
        """Abandon a call we opened; None if it already ended (nothing to tell the peer)."""
        call = self._calls.pop(call_id, None)
        if call is None:
            return None
        return packb([CANCEL, call_id])

    def consumed(self, call_id: int, nbytes: int) -> bytes | None:
        """The application took ``nbytes`` of stream data; maybe return a CREDIT header."""
        call = self._calls.get(call_id)
        if call is None or call.received_done:
            return None
        call.unacked += nbytes
        # Re-grant in halves of the window: one CREDIT per ~8 MiB instead of one per message.
        if call.unacked < self.window // 2:
            return None
        grant, call.unacked = call.unacked, 0
        call.receive_credit += grant
        return packb([CREDIT, call_id, grant])

    def take_outbox(self) -> list[bytes]:
        """Headers the protocol itself wants sent (refusals of calls over the limit)."""
        outbox, self._outbox = self._outbox, []
        return outbox

    def is_live(self, call_id: int) -> bool:
        return call_id in self._calls

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    # ----------------------------------------------------------------- incoming
    @property
    def awaiting_payload(self) -> bool:
        return self._pending is not None

    @property
    def payload_remaining(self) -> int:
        return self._payload_len - self._payload_filled

    @property
    def announced_data(self) -> tuple[int, Any] | None:
        """``(call_id, body)`` of the stream message whose payload is awaited (None otherwise), so
        that the driver can ask the application where the payload should go."""
        header = self._pending
        if header is None or header[0] != DATA or self._payload is not None:
            return None
        return header[1], header[2]

    def payload_fits_record(self, size: int) -> bool:
        """Whether a record of ``size`` plaintext bytes is the whole awaited payload and no buffer
        was supplied: the driver may then let the AEAD allocate the payload (``payload_whole``)."""
        return self._payload is None and size == self._payload_len

    def supply_payload_buffer(self, buffer: Any) -> None:
        """Receive the awaited payload into ``buffer`` (a writable buffer of exactly the announced
        length) instead of a fresh allocation; the delivered payload is then ``buffer`` itself."""
        if self._failed is not None:
            raise self._failed
        if self._pending is None or self._payload is not None or self._payload_filled:
            raise RuntimeError("no payload is awaiting a buffer")
        view = byte_view(buffer)
        if view.readonly:
            raise ValueError("a payload buffer must be writable")
        if len(view) != self._payload_len:
            raise ValueError(f"payload buffer holds {len(view)} bytes, the payload has {self._payload_len}")
        self._payload, self._payload_view = buffer, view

    def payload_whole(self, payload: bytes) -> list:
        """Deliver a payload that arrived in one piece (no buffer to allocate and fill)."""
        if self._failed is not None:
            raise self._failed
        try:
            if self._pending is None or self._payload is not None or len(payload) != self._payload_len:
                raise ProtocolError("payload record does not match the announced payload length")
            header = self._pending
            self._pending = None
            return self._dispatch(header, payload)
        except ProtocolError as error:
            self._failed = error
            raise

    def payload_target(self) -> memoryview:
        """The part of the announced payload not yet received, to decrypt or copy into."""
        if self._failed is not None:
            raise self._failed
        assert self._pending is not None
        if self._payload is None:
            self._payload = bytearray(self._payload_len)
            self._payload_view = memoryview(self._payload)
        assert self._payload_view is not None
        return self._payload_view[self._payload_filled :]

    def payload_received(self, nbytes: int) -> list:
        if self._failed is not None:
            raise self._failed
        assert self._payload is not None and self._pending is not None
        self._payload_filled += nbytes
        if self._payload_filled < self._payload_len:
            return []
        header, payload = self._pending, self._payload
        self._pending = self._payload = self._payload_view = None
        try:
            return self._dispatch(header, payload)  # its checks (credit, state) fail the protocol too
        except ProtocolError as error:
            self._failed = error
            raise

    def receive_header(self, plaintext: bytes | memoryview) -> list:
        if self._failed is not None:
            raise self._failed
        if self._pending is not None:
            raise RuntimeError("a payload is pending; feed it through payload_target")
        try:
            try:
                header = unpackb(plaintext)
            except Exception as error:  # msgpack raises many types on garbage; all mean the same
                raise ProtocolError(f"undecodable RPC header: {error}") from None
            _check(isinstance(header, list) and len(header) >= 2, "not an array of at least 2 items")
            self._header_size = len(plaintext)  # what the sender charged against its credit
            kind, call_id = header[0], header[1]
            _check(type(call_id) is int and 0 < call_id < 1 << 63, "bad call ID")
            payload_len = self._validate(kind, header)
            if payload_len:
                self._pending = header
                self._payload_len = payload_len
                self._payload_filled = 0
                return []
            return self._dispatch(header, b"")
        except ProtocolError as error:
            self._failed = error
            raise

    def _validate(self, kind: Any, header: list) -> int:
        """Check the shape of a header; return its payload length."""
        shapes = {OPEN: 4, DATA: 4, END: 2, ERROR: 4, CANCEL: 2, CREDIT: 3, UNARY: 6, RESULT: 4}
        _check(kind in shapes and type(kind) is int, f"unknown message kind {kind!r}")
        _check(len(header) == shapes[kind], f"kind {kind} needs {shapes[kind]} items, got {len(header)}")
        if kind in (OPEN, UNARY):
            method, timeout = header[2], header[3]
            _check(isinstance(method, str) and 0 < len(method) <= MAX_METHOD_NAME, "bad method name")
            _check(timeout is None or (isinstance(timeout, (int, float)) and timeout > 0), "bad timeout")
        if kind == ERROR:
            _check(isinstance(header[2], str) and isinstance(header[3], str), "bad error fields")
        if kind == CREDIT:
            _check(type(header[2]) is int and 0 < header[2] <= 1 << 40, "bad credit")
        if kind in (DATA, RESULT, UNARY):
            payload_len = header[-1]
            _check(type(payload_len) is int and 0 <= payload_len, "bad payload length")
            if payload_len > self.max_payload:
                raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {self.max_payload}")
            return payload_len
        return 0

    def _dispatch(self, header: list, payload: Any) -> list:
        kind, call_id = header[0], header[1]
        if kind in (OPEN, UNARY):
            return self._remote_open(kind, call_id, header, payload)
        call = self._calls.get(call_id)
        if call is None:
            return []  # a call that already ended here (cancelled, failed): late traffic is normal
        if kind == DATA:
            _check(not call.received_done, "data after end of stream")
            # The sender may send while its credit is positive (one message may overshoot), and
            # its view of the credit never exceeds ours, so data arriving at <= 0 is a violation.
            if call.receive_credit <= 0:
                raise ProtocolError("peer sent more stream data than its credit allows")
            cost = self._header_size + header[3]  # the announced payload length, delivered whole
            call.receive_credit -= cost
            return [StreamData(call_id, header[2], payload, cost)]
        if kind == END:
            if call.local:
                del self._calls[call_id]  # the handler returned: the call is over
            else:
                call.received_done = True
            return [StreamEnd(call_id)]
        if kind == CREDIT:
            call.send_credit += header[2]
            return [CreditGranted(call_id, header[2])]
        if kind == CANCEL:
            _check(not call.local, "cancel of a call we opened")
            self._forget_remote(call_id)
            return [CallCancelled(call_id)]
        _check(call.local, "result or error for a call the peer opened")
        del self._calls[call_id]
        if kind == RESULT:
            return [CallResult(call_id, header[2], payload)]
        return [CallFailed(call_id, header[2], header[3])]

    def _remote_open(self, kind: int, call_id: int, header: list, payload: Any) -> list:
        _check(call_id % 2 == (0 if self.initiator else 1), "call ID of the wrong parity")
        _check(call_id not in self._calls, f"call ID {call_id} reused while live")
        if self._remote_calls >= self.max_concurrent_calls:
            self._outbox.append(
                packb([ERROR, call_id, BUSY, f"too many concurrent calls (limit {self.max_concurrent_calls})"])
            )
            return []
        call = _Call(local=False, window=self.window)
        self._calls[call_id] = call
        self._remote_calls += 1
        if kind == UNARY:
            call.received_done = True
            return [CallOpened(call_id, header[2], header[3], True, header[4], payload)]
        return [CallOpened(call_id, header[2], header[3], False)]

    # ----------------------------------------------------------------- bookkeeping
    def _live(self, call_id: int) -> _Call:
        call = self._calls.get(call_id)
        if call is None:
            raise KeyError(f"call {call_id} is not live")
        return call

    def _forget_remote(self, call_id: int) -> None:
        call = self._calls.pop(call_id, None)
        if call is not None and not call.local:
            self._remote_calls -= 1
