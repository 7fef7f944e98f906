"""The call multiplexing rules, driven without sockets: two RPCProtocol objects talk by handing
each other header bytes (and payload bytes through payload_target)."""

import msgpack
import pytest

from peer.framing import ProtocolError
from peer.packing import packb
from peer.rpc_headers import OPEN
from peer.rpc_protocol import (
    CallCancelled,
    CallFailed,
    CallOpened,
    CallResult,
    CreditGranted,
    RPCProtocol,
    StreamData,
    StreamEnd,
)


def deliver(receiver: RPCProtocol, header: bytes, payload: bytes = b"") -> list:
    events = receiver.receive_header(header)
    if receiver.awaiting_payload:
        target = receiver.payload_target()
        target[: len(payload)] = payload
        events = receiver.payload_received(len(payload))
    return events


def pair() -> tuple[RPCProtocol, RPCProtocol]:
    return RPCProtocol(initiator=True), RPCProtocol(initiator=False)


def test_unary_round_trip_with_payload():
    client, server = pair()
    call_id, header = client.open_unary("echo", {"a": 1}, 3, timeout=2.5)
    [opened] = deliver(server, header, b"xyz")
    assert opened == CallOpened(call_id, "echo", 2.5, True, {"a": 1}, bytearray(b"xyz"))
    [result] = deliver(client, server.send_result(call_id, [1, 2], 2), b"ok")
    assert result == CallResult(call_id, [1, 2], bytearray(b"ok"))
    assert client.active_calls == 0 and server.active_calls == 0


def test_single_record_payload_can_be_delivered_whole():
    client, server = pair()
    call_id, header = client.open_unary("m", None, 4, timeout=None)
    assert server.receive_header(header) == [] and server.payload_remaining == 4
    [opened] = server.payload_whole(b"abcd")
    assert opened.payload == b"abcd"


def test_an_empty_payload_is_carried_by_the_header_alone():
    # payload_len 0: the message is whole with its header, for calls, replies and stream data.
    client, server = pair()
    call_id, header = client.open_unary("echo", "x", 0, timeout=None)
    [opened] = server.receive_header(header)
    assert not server.awaiting_payload and opened.payload == b""
    [result] = client.receive_header(server.send_result(call_id, "y", 0))
    assert not client.awaiting_payload and result == CallResult(call_id, "y", b"")
    stream_id, header = client.open_stream("s", timeout=None)
    server.receive_header(header)
    [data] = server.receive_header(client.send_data(stream_id, 1, 0))
    assert not server.awaiting_payload and data.payload == b""


def test_call_ids_do_not_collide_between_sides():
    client, server = pair()
    ids_client = {client.open_unary("m", None, 0, None)[0] for _ in range(3)}
    ids_server = {server.open_unary("m", None, 0, None)[0] for _ in range(3)}
    assert all(i % 2 == 1 for i in ids_client) and all(i % 2 == 0 for i in ids_server)


def test_stream_with_half_close_and_credit():
    client = RPCProtocol(initiator=True, window=100)
    server = RPCProtocol(initiator=False, window=100)
    call_id, header = client.open_stream("sum", timeout=None)
    [opened] = deliver(server, header)
    assert not opened.unary
    sent = consumed = 0
    while (data_header := client.send_data(call_id, sent, 30)) is not None:
        [data] = deliver(server, data_header, b"z" * 30)
        assert isinstance(data, StreamData) and data.body == sent
        sent, consumed = sent + 1, consumed + data.cost
    assert sent == 2  # 100 bytes of window, ~35 bytes per message: a third would not fit
    grant = server.consumed(call_id, consumed)
    [credit] = deliver(client, grant)
    assert isinstance(credit, CreditGranted) and client.send_credit(call_id) > 0
    assert deliver(server, client.end_stream(call_id)) == [StreamEnd(call_id)]
    [data] = deliver(client, server.send_data(call_id, "answer", 0))
    assert data.body == "answer"
    assert deliver(client, server.end_stream(call_id)) == [StreamEnd(call_id)]
    assert client.active_calls == 0 and server.active_calls == 0


def test_sender_exceeding_its_window_is_a_protocol_error():
    client = RPCProtocol(initiator=True, window=10, max_payload=100)
    server = RPCProtocol(initiator=False, window=10, max_payload=100)
    call_id, header = client.open_stream("s", None)
    deliver(server, header)
    with pytest.raises(ProtocolError, match="credit"):
        for _ in range(50):  # a hostile sender ignores credit
            deliver(server, packb([2, call_id, None, 100]), b"x" * 100)


def test_cancel_ends_the_call_on_both_sides_and_late_traffic_is_ignored():
    client, server = pair()
    call_id, header = client.open_unary("slow", None, 0, None)
    deliver(server, header)
    assert deliver(server, client.cancel(call_id)) == [CallCancelled(call_id)]
    assert client.cancel(call_id) is None  # already gone
    assert deliver(client, packb([8, call_id, "late", 0])) == []  # result after cancel: dropped


def test_error_reaches_the_caller():
    client, server = pair()
    call_id, header = client.open_unary("boom", None, 0, None)
    deliver(server, header)
    [failed] = deliver(client, server.send_error(call_id, "ValueError", "bad"))
    assert failed == CallFailed(call_id, "ValueError", "bad")


def test_an_answer_of_the_wrong_kind_for_our_call_is_a_protocol_error():
    # A RESULT for a stream we opened would leave our receive() waiting for ever; stream DATA or
    # END for a unary call would leave the caller waiting for its result. Both break the protocol.
    client, server = pair()
    stream_id, header = client.open_stream("s", None)
    deliver(server, header)
    with pytest.raises(ProtocolError, match="does not answer a stream call"):
        deliver(client, server.send_result(stream_id, "not a stream reply", 0))
    for wrong in ("end", "data"):
        client, server = pair()
        unary_id, header = client.open_unary("u", None, 0, None)
        deliver(server, header)
        raw = packb([3, unary_id]) if wrong == "end" else packb([2, unary_id, "x", 0])
        with pytest.raises(ProtocolError, match="does not answer a unary call"):
            deliver(client, raw)
    client, server = pair()
    stream_id, header = client.open_stream("s", None)
    deliver(server, header)
    assert deliver(client, server.send_error(stream_id, "ValueError", "bad")) == [
        CallFailed(stream_id, "ValueError", "bad")
    ]


def test_concurrency_limit_refuses_with_busy_error():
    client = RPCProtocol(initiator=True)
    server = RPCProtocol(initiator=False, max_concurrent_calls=2)
    for _ in range(3):
        deliver(server, client.open_unary("m", None, 0, None)[1])
    [refusal] = server.take_outbox()
    [failed] = deliver(client, refusal)
    assert failed.type_name == "Busy"


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # truncated array
        msgpack.packb({"not": "an array"}),
        msgpack.packb([99, 1]),  # unknown kind
        msgpack.packb([7, 1, "m", None, None, 0]),  # odd call ID from the initiator's peer side
        msgpack.packb([7, 2, "", None, None, 0]),  # empty method name
        msgpack.packb([7, 2, "m", -1, None, 0]),  # negative timeout
        msgpack.packb([7, 2, "m", None, None, -5]),  # negative payload length
        msgpack.packb([7, 2, "m", None, None, 1 << 40]),  # payload beyond the limit
        msgpack.packb([7, "2", "m", None, None, 0]),  # call ID of the wrong type
        msgpack.packb([6, 2]),  # wrong arity
        msgpack.packb([OPEN, 2, "s", None]),  # an OPEN without the largest message its caller accepts
        msgpack.packb([OPEN, 2, "s", None, -1]),  # a negative one
        msgpack.packb([OPEN, 2, "s", None, "16 MiB"]),  # not a number
        b"\x91" * 5000,  # nesting far too deep
    ],
)
def test_malformed_headers_fail_the_connection(raw):
    server = RPCProtocol(initiator=True)  # expects even call IDs from its peer
    with pytest.raises(ProtocolError):
        server.receive_header(raw)
    with pytest.raises(ProtocolError):  # failed for good, like h11's ERROR state
        server.receive_header(packb([7, 2, "m", None, None, 0]))


def test_reusing_a_live_call_id_is_a_protocol_error():
    server = RPCProtocol(initiator=False)
    server.receive_header(packb([7, 1, "m", None, None, 0]))
    with pytest.raises(ProtocolError, match="not above the last"):
        server.receive_header(packb([7, 1, "m", None, None, 0]))


def test_reopening_a_cancelled_call_id_is_a_protocol_error():
    """OPEN x, CANCEL x, OPEN x: the first handler, still unwinding, would clean up the second
    call's bookkeeping and leave its handler running uncounted and uncancellable."""
    client, server = pair()
    call_id, header = client.open_stream("m", None)
    deliver(server, header)
    deliver(server, client.cancel(call_id))
    with pytest.raises(ProtocolError, match="not above the last"):
        server.receive_header(header)
    later, header = client.open_stream("m", None)  # honest peers only ever count up
    assert later > call_id


def test_stream_payload_goes_into_a_supplied_buffer():
    client, server = pair()
    call_id, header = client.open_stream("s", None)
    deliver(server, header)
    assert server.receive_header(client.send_data(call_id, {"part": 3}, 6)) == []
    assert server.announced_data == (call_id, {"part": 3})
    assert server.payload_fits_record(6)  # one record could be delivered whole, until a buffer is given
    buffer = bytearray(6)
    with pytest.raises(ValueError, match="holds 5 bytes"):
        server.supply_payload_buffer(bytearray(5))
    with pytest.raises(ValueError, match="writable"):
        server.supply_payload_buffer(b"\0" * 6)
    server.supply_payload_buffer(buffer)
    assert server.announced_data is None and not server.payload_fits_record(6)
    target = server.payload_target()
    target[:4] = b"abcd"
    assert server.payload_received(4) == []
    server.payload_target()[:2] = b"ef"
    [data] = server.payload_received(2)
    assert data.payload is buffer and buffer == b"abcdef"
    assert data.cost == len(client.send_data(call_id, {"part": 3}, 6)) + 6  # credit as announced


def test_only_stream_data_asks_for_a_buffer():
    client, server = pair()
    call_id, header = client.open_unary("m", None, 4, timeout=None)
    server.receive_header(header)
    assert server.awaiting_payload and server.announced_data is None
    assert server.payload_fits_record(4) and not server.payload_fits_record(3)


# Each returns a protocol object and the input that breaks the protocol, by path: a header, a
# payload delivered whole, a payload's own checks once its records are in.
def _undecodable_header():
    protocol = RPCProtocol(initiator=True)
    return protocol, lambda: protocol.receive_header(b"\xc1")


def _payload_record_of_the_wrong_length():
    client, server = pair()
    server.receive_header(client.open_unary("m", None, 4, timeout=None)[1])
    return server, lambda: server.payload_whole(b"abc")


def _stream_payload_beyond_credit():
    client = RPCProtocol(initiator=True, window=10)
    server = RPCProtocol(initiator=False, window=10)
    call_id, header = client.open_stream("s", None)
    deliver(server, header)
    deliver(server, packb([2, call_id, None, 0]))  # 5 bytes of the 10-byte window used
    # 105 bytes with 5 of credit left: refused at the header, before any payload is taken in
    return server, lambda: server.receive_header(packb([2, call_id, None, 100]))


def _stream_payload_after_end():
    client, server = pair()
    call_id, header = client.open_stream("s", None)
    deliver(server, header)
    deliver(server, client.end_stream(call_id))
    return server, lambda: server.receive_header(packb([2, call_id, None, 3]))


def _cancel_of_a_call_we_opened():
    client, _ = pair()
    call_id, _ = client.open_unary("m", None, 0, timeout=None)
    return client, lambda: client.receive_header(packb([5, call_id]))


@pytest.mark.parametrize(
    "violation",
    [
        _undecodable_header,
        _payload_record_of_the_wrong_length,
        _stream_payload_beyond_credit,
        _stream_payload_after_end,
        _cancel_of_a_call_we_opened,
    ],
)
def test_a_protocol_error_on_any_path_fails_every_later_input(violation):
    """Whichever path found the violation, the object stays failed, like h11's ERROR state: each
    incoming method raises that same error from then on, even for input that would be valid."""
    protocol, break_it = violation()
    with pytest.raises(ProtocolError) as caught:
        break_it()
    later_inputs = [
        lambda: protocol.receive_header(packb([3, 2])),
        lambda: protocol.payload_whole(b""),
        lambda: protocol.payload_target(),
        lambda: protocol.payload_received(0),
        lambda: protocol.supply_payload_buffer(bytearray()),
    ]
    for later in later_inputs:
        with pytest.raises(ProtocolError) as again:
            later()
        assert again.value is caught.value


def test_payloads_held_by_running_unary_handlers_count_toward_the_unread_cap():
    """Handlers keep their request's payload until they return: a peer making many large unary
    calls to handlers that wait must hit the connection's cap, and a finished call frees its share."""
    server = RPCProtocol(initiator=False, max_unread=3000)
    client = RPCProtocol(initiator=True)
    first, header = client.open_unary("wait", None, 2000, None)
    deliver(server, header, bytes(2000))
    server.send_result(first, None, 0)  # that handler returned: its payload is released
    second, header = client.open_unary("wait", None, 2000, None)
    deliver(server, header, bytes(2000))
    third, header = client.open_unary("wait", None, 2000, None)
    with pytest.raises(ProtocolError, match="unread"):
        deliver(server, header, bytes(2000))
