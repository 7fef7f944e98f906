"""The RPC multiplexing rules, sans I/O.

One ``RPCProtocol`` object per connection turns outgoing intentions into header bytes and incoming
plaintext records into events. It knows nothing of sockets, encryption or trio: ``peer/rpc.py``
drives it. Keeping the rules here means call bookkeeping (IDs, half-closes, credits, limits) is
tested with plain byte strings.

Wire format of a header (msgpack array), followed by ``payload_len`` raw bytes when non-zero:

    UNARY  [7, id, method, timeout, body, payload_len]   a whole request
    RESULT [8, id, body, payload_len]                    a whole response; ends the call
    OPEN   [1, id, method, timeout, max_message]         opens a stream call
    DATA   [2, id, body, payload_len]                    one stream message (costs credit)
    END    [3, id]                                       the sender's half of a stream is done
    ERROR  [4, id, type_name, message]                   the handler failed; ends the call
    CANCEL [5, id]                                       the caller gave up; ends the call
    CREDIT [6, id, nbytes]                               the receiver can take nbytes more DATA
    GOAWAY [9, 0]                                        the sender opens no more calls here

Call IDs are odd for calls opened by the connection's initiator and even for the responder, so both
sides can open calls on one connection without colliding (as in HTTP/2).

A side that finds the connection idle says GOAWAY and opens no more calls; the other answers with
its own GOAWAY at once. Once both have said it and no call is left (calls that crossed the first
GOAWAY in flight are served as usual: ``drained``), either side may close the connection knowing
that nothing it was asked is lost.

Each side of a stream says how large a message it accepts (``max_message``): the caller in its
OPEN, the handler's side where the method is registered. A larger message is refused at its
header, before any of its payload is allocated, and ends the call with ``MessageTooLarge``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .framing import ProtocolError
from .incoming_payload import IncomingPayload
from .packing import packb, unpackb
from .receive_budget import ReceiveBudget, process_budget
from .rpc_call_state import MAX_PAYLOAD, MAX_STREAM_MESSAGE, STREAM_WINDOW, CallState, GoAway
from .rpc_errors import BUSY, MESSAGE_TOO_LARGE
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
from .rpc_headers import CANCEL, CREDIT, DATA, END, ERROR, GOAWAY, OPEN, RESULT, UNARY, check, validate

__all__ = [
    "RPCProtocol",
    "CallOpened",
    "StreamData",
    "StreamEnd",
    "CallResult",
    "CallFailed",
    "CallCancelled",
    "CreditGranted",
    "PeerLeaving",
    "MAX_STREAM_MESSAGE",
]

# HTTP/2's default SETTINGS_MAX_CONCURRENT_STREAMS is 100; tensor work needs more (1,000 in-flight
# calls are tested), and each idle call costs only a dict entry and a task.
MAX_CONCURRENT_CALLS = 4096
# Stream data received but not yet read by the application, and the payloads of unary requests
# whose handlers are still running, summed over one connection's calls. A call's window bounds
# stream data per call; this bounds a peer that opens many streams to handlers that do not read
# (or read slowly), or many unary calls with large payloads to handlers that wait: four full
# windows plus one maximal message (see ``_fits_credit``), which an honest peer reaches only with
# several bulk transfers at once.
MAX_UNREAD_PER_CONNECTION = 4 * STREAM_WINDOW + MAX_PAYLOAD
MAX_ERROR_TEXT = 4096


# What may arrive for a call we opened, by its kind (CREDIT is harmless on either).
_UNARY_ANSWERS = frozenset({RESULT, ERROR, CREDIT})
_STREAM_ANSWERS = frozenset({DATA, END, ERROR, CREDIT})


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
        max_unread: int = MAX_UNREAD_PER_CONNECTION,
        budget: ReceiveBudget | None = None,
        max_message: Callable[[str], int] | None = None,
    ):
        """``max_message(method)``: the largest stream message we accept on a stream the peer
        opens to ``method`` (default: ``MAX_STREAM_MESSAGE``)."""
        self.max_concurrent_calls = max_concurrent_calls
        self.max_payload = max_payload
        self.window = window
        self._next_call_id = 1 if initiator else 2
        self._calls: dict[int, CallState] = {}
        self._remote_calls = 0
        self._last_remote_call_id = 0
        self._outbox: list[bytes] = []
        self._max_message = max_message
        self.max_unread = max_unread
        self.budget = budget if budget is not None else process_budget()
        self._unread = 0  # stream bytes delivered to calls and not yet consumed, over all calls
        self._payload: IncomingPayload | None = None  # an announced payload, as its records arrive
        self._header_size = 0
        self.goaway = GoAway()  # who said GOAWAY: after ours, no call of ours opens
        # Set by the first protocol error on any incoming path; every incoming method (headers,
        # payloads, payload buffers) then raises it again, as h11's ERROR state: nothing half-works.
        self._failed: ProtocolError | None = None

    # ----------------------------------------------------------------- outgoing
    def _new_call(self) -> int:
        if self.goaway.sent:
            raise RuntimeError("no call opens on a connection we are leaving")
        call_id = self._next_call_id
        self._next_call_id += 2
        self._calls[call_id] = CallState(local=True, window=self.window)
        return call_id

    def open_unary(self, method: str, body: Any, payload_len: int, timeout: float | None) -> tuple[int, bytes]:
        call_id = self._new_call()
        call = self._calls[call_id]
        call.sent_done = call.unary = True
        return call_id, packb([UNARY, call_id, method, timeout, body, payload_len])

    def open_stream(
        self, method: str, timeout: float | None, max_message: int = MAX_STREAM_MESSAGE
    ) -> tuple[int, bytes]:
        """``max_message``: the largest message payload we accept from the handler."""
        if max_message < 0:
            raise ValueError("max_message must not be negative")
        call_id = self._new_call()
        self._calls[call_id].max_receive = max_message = min(max_message, self.max_payload)
        return call_id, packb([OPEN, call_id, method, timeout, max_message])

    def send_credit(self, call_id: int) -> int:
        call = self._calls.get(call_id)
        return call.send_credit if call is not None else 0

    def send_limit(self, call_id: int) -> int:
        """The largest message payload the other side accepts on a stream, as far as it has said."""
        call = self._calls.get(call_id)
        return call.max_send if call is not None else self.max_payload

    def send_data(self, call_id: int, body: Any, payload_len: int) -> bytes | None:
        """The header of a DATA message, or None if the message does not fit the credit the peer
        has granted (nothing is charged then: wait for ``CreditGranted`` and try again)."""
        call = self._live(call_id)
        if call.sent_done:
            raise RuntimeError("cannot send on a stream after ending it")
        if payload_len > call.max_send:
            raise ValueError(f"a message of {payload_len} bytes; the peer accepts at most {call.max_send}")
        header = packb([DATA, call_id, body, payload_len])
        cost = len(header) + payload_len
        if not self._fits_credit(call.send_credit, cost):
            return None
        call.send_credit -= cost
        return header

    def _fits_credit(self, credit: int, cost: int) -> bool:
        """A DATA message must fit the remaining credit. One larger than the whole window (a big
        tensor in state sharing) can never fit, so it may be sent into a full window instead: it
        is then the only unread message of its call, and ``max_payload`` still bounds it. Both
        sides apply the same rule, and the sender's credit never exceeds the receiver's view of
        it, so an honest sender never trips the receiver's check."""
        return cost <= credit or (cost > self.window and credit >= self.window)

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
        if self._pop_call(call_id) is None:
            return None
        return packb([CANCEL, call_id])

    def consumed(self, call_id: int, nbytes: int, drained: bool = False) -> bytes | None:
        """The application took ``nbytes`` of stream data (``drained``: and has read everything
        delivered so far); maybe return a CREDIT header."""
        call = self._calls.get(call_id)
        if call is None:
            return None
        self._unread -= nbytes
        call.unread -= nbytes
        if call.received_done:
            return None
        call.unacked += nbytes
        # Re-grant in halves of the window: one CREDIT per ~8 MiB instead of one per message. When
        # the reader has caught up, grant all: a sender waiting for room for a message larger
        # than the credit left (at most half a window short, or a whole window for a message
        # larger than the window) would otherwise wait for a grant that never comes.
        if call.unacked < self.window // 2 and not (drained and call.unacked):
            return None
        grant, call.unacked = call.unacked, 0
        call.receive_credit += grant
        return packb([CREDIT, call_id, grant])

    def go_away(self) -> bytes | None:
        """Leave the connection: the GOAWAY header to send, or None if we already did."""
        if self.goaway.sent:
            return None
        self.goaway.sent = True
        return packb([GOAWAY, 0])

    @property
    def drained(self) -> bool:
        """Both sides said GOAWAY and no call is open or half-received: closing loses nothing."""
        return self.goaway.sent and self.goaway.received and not self._calls and self._payload is None

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
        return self._payload is not None

    @property
    def payload_remaining(self) -> int:
        payload = self._payload
        return 0 if payload is None else payload.length - payload.filled

    def close(self) -> None:
        """The connection is gone: refund what a half-received payload holds of the budget."""
        if self._payload is not None:
            self._payload.release()

    @property
    def announced_data(self) -> tuple[int, Any] | None:
        """``(call_id, body)`` of the stream message whose payload is awaited (None otherwise), so
        that the driver can ask the application where the payload should go."""
        payload = self._payload
        if payload is None or payload.header[0] != DATA or payload.started or payload.discard:
            return None
        return payload.header[1], payload.header[2]

    def payload_fits_record(self, size: int) -> bool:
        """Whether a record of ``size`` plaintext bytes is the whole awaited payload and no buffer
        was supplied: the driver may then let the AEAD allocate the payload (``payload_whole``)."""
        payload = self._payload
        return payload is not None and not payload.started and not payload.discard and size == payload.length

    def supply_payload_buffer(self, buffer: Any) -> None:
        """Receive the awaited payload into ``buffer`` (a writable buffer of exactly the announced
        length) instead of a fresh allocation; the delivered payload is then ``buffer`` itself."""
        if self._failed is not None:
            raise self._failed
        if self.announced_data is None:
            raise RuntimeError("no payload is awaiting a buffer")
        assert self._payload is not None
        self._payload.supply(buffer)

    def payload_whole(self, payload: bytes) -> list:
        """Deliver a payload that arrived in one piece (no buffer to allocate and fill)."""
        if self._failed is not None:
            raise self._failed
        try:
            incoming = self._payload
            if incoming is None or incoming.started or len(payload) != incoming.length:
                raise ProtocolError("payload record does not match the announced payload length")
            self._payload = None
            return [] if incoming.discard else self._dispatch(incoming.header, payload)
        except ProtocolError as error:
            self._failed = error
            raise

    def payload_target(self, nbytes: int | None = None) -> memoryview:
        """Room for the next ``nbytes`` of the awaited payload (everything not yet received if
        None), to decrypt or copy into. Fresh buffers grow as records arrive (see
        ``incoming_payload.py``); a payload over the receive budget fails the protocol."""
        if self._failed is not None:
            raise self._failed
        assert self._payload is not None
        try:
            return self._payload.target(nbytes)
        except ProtocolError as error:
            self._failed = error
            raise

    def payload_received(self, nbytes: int) -> list:
        if self._failed is not None:
            raise self._failed
        assert self._payload is not None
        if not self._payload.received(nbytes):
            return []
        incoming, self._payload = self._payload, None
        payload = incoming.take()
        if incoming.discard:
            return []
        try:
            return self._dispatch(incoming.header, payload)  # its checks (credit, state) fail the protocol too
        except ProtocolError as error:
            self._failed = error
            raise

    def receive_header(self, plaintext: bytes | memoryview) -> list:
        if self._failed is not None:
            raise self._failed
        if self._payload is not None:
            raise RuntimeError("a payload is pending; feed it through payload_target")
        try:
            try:
                header = unpackb(plaintext)
            except Exception as error:  # msgpack raises many types on garbage; all mean the same
                raise ProtocolError(f"undecodable RPC header: {error}") from None
            check(isinstance(header, list) and len(header) >= 2, "not an array of at least 2 items")
            self._header_size = len(plaintext)  # what the sender charged against its credit
            kind, call_id = header[0], header[1]
            check(type(call_id) is int and (0 < call_id or kind == GOAWAY) and call_id < 1 << 63, "bad call ID")
            payload_len = validate(kind, header, self.max_payload)
            refused = self._check_data(call_id, payload_len) if kind == DATA else []
            if payload_len:
                discard = not self._wants_payload(kind, call_id)
                self._payload = IncomingPayload(payload_len, self.budget, discard=discard, header=header)
                return refused
            return self._dispatch(header, b"")
        except ProtocolError as error:
            self._failed = error
            raise

    def _check_data(self, call_id: int, payload_len: int) -> list:
        """Checked when a DATA header arrives, before any of the payload is received or allocated:
        sending past the credit breaks the protocol; a message larger than its stream accepts ends
        that call (the events that say so), and its payload is dropped as it arrives."""
        call = self._calls.get(call_id)
        if call is None:
            return []  # late traffic for an ended call: its payload is discarded as it arrives
        check(not call.received_done, "data after end of stream")
        cost = self._header_size + payload_len
        if not self._fits_credit(call.receive_credit, cost):
            raise ProtocolError(
                f"peer sent a stream message of {cost} bytes with {call.receive_credit} bytes of credit left"
            )
        call.receive_credit -= cost
        if payload_len <= call.max_receive:
            return []
        text = f"a stream message of {payload_len} bytes; this stream accepts at most {call.max_receive}"
        if call.local:  # the handler sent it: we give up the call, and our caller learns why
            self._pop_call(call_id)
            self._outbox.append(packb([CANCEL, call_id]))
            return [CallFailed(call_id, MESSAGE_TOO_LARGE, f"the handler sent {text}")]
        self._forget_remote(call_id)  # the caller sent it: its call ends with the reason
        self._outbox.append(packb([ERROR, call_id, MESSAGE_TOO_LARGE, f"refused {text}"]))
        return [CallCancelled(call_id)]

    def _wants_payload(self, kind: int, call_id: int) -> bool:
        """Whether a payload will be delivered to anyone; if not it is dropped as it arrives."""
        if kind == UNARY:
            return self._remote_calls < self.max_concurrent_calls  # otherwise the call is refused
        call = self._calls.get(call_id)
        return call is not None and (kind == DATA or call.local)

    def _dispatch(self, header: list, payload: Any) -> list:
        kind, call_id = header[0], header[1]
        if kind in (OPEN, UNARY):
            return self._remote_open(kind, call_id, header, payload)
        if kind == GOAWAY:
            check(call_id == 0, "GOAWAY names no call")
            self.goaway.received = True
            return [PeerLeaving()]
        call = self._calls.get(call_id)
        if call is None:
            return []  # a call that already ended here (cancelled, failed): late traffic is normal
        if call.local:
            # A unary call is answered by RESULT or ERROR, a stream by DATA, END or ERROR: anything
            # else would leave our caller waiting for an answer that cannot come.
            answers = _UNARY_ANSWERS if call.unary else _STREAM_ANSWERS
            check(kind in answers, f"message kind {kind} does not answer a {'unary' if call.unary else 'stream'} call")
        if kind == DATA:
            # Credit was checked and charged when the header arrived (``_check_credit``).
            cost = self._header_size + header[3]
            self._unread += cost
            call.unread += cost
            if self._unread > self.max_unread:
                raise ProtocolError(f"peer's unread stream data on this connection exceeds {self.max_unread} bytes")
            return [StreamData(call_id, header[2], payload, cost)]
        if kind == END:
            if call.local:
                self._pop_call(call_id)  # the handler returned: the call is over
            else:
                call.received_done = True
            return [StreamEnd(call_id)]
        if kind == CREDIT:
            call.send_credit += header[2]
            return [CreditGranted(call_id, header[2])]
        if kind == CANCEL:
            check(not call.local, "cancel of a call we opened")
            self._forget_remote(call_id)
            return [CallCancelled(call_id)]
        check(call.local, "result or error for a call the peer opened")
        self._pop_call(call_id)
        if kind == RESULT:
            return [CallResult(call_id, header[2], payload)]
        return [CallFailed(call_id, header[2], header[3])]

    def _remote_open(self, kind: int, call_id: int, header: list, payload: Any) -> list:
        check(call_id % 2 != self._next_call_id % 2, "call ID of the wrong parity")  # ours have the other
        check(not self.goaway.received, "a call opened after GOAWAY")
        # Call IDs only grow (as HTTP/2 stream IDs do): a reused ID could alias a call whose handler
        # is still unwinding, leaving a second handler that nothing counts or can cancel.
        if call_id <= self._last_remote_call_id:
            check(False, f"call ID {call_id} is not above the last one opened")
        self._last_remote_call_id = call_id
        if self._remote_calls >= self.max_concurrent_calls:
            self._outbox.append(
                packb([ERROR, call_id, BUSY, f"too many concurrent calls (limit {self.max_concurrent_calls})"])
            )
            return []
        call = CallState(local=False, window=self.window)
        self._calls[call_id] = call
        self._remote_calls += 1
        if kind == OPEN:
            call.max_send = header[4]
            if self._max_message is not None:
                call.max_receive = self._max_message(header[2])
        if kind == UNARY:
            call.received_done = True
            # The handler holds the payload until it returns: it counts as unread until then.
            call.unread = header[5]
            self._unread += call.unread
            if self._unread > self.max_unread:
                raise ProtocolError(f"peer's unread data on this connection exceeds {self.max_unread} bytes")
            return [CallOpened(call_id, header[2], header[3], True, header[4], payload)]
        return [CallOpened(call_id, header[2], header[3], False)]

    # ----------------------------------------------------------------- bookkeeping
    def _live(self, call_id: int) -> CallState:
        call = self._calls.get(call_id)
        if call is None:
            raise KeyError(f"call {call_id} is not live")
        return call

    def _pop_call(self, call_id: int) -> CallState | None:
        """Remove a call; what it had delivered unread no longer counts (no more can arrive)."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            self._unread -= call.unread
        return call

    def _forget_remote(self, call_id: int) -> None:
        call = self._pop_call(call_id)
        if call is not None and not call.local:
            self._remote_calls -= 1
