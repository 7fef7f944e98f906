"""What a hostile peer can make the wire layer hold, driven with bytes (sans I/O) where possible;
a payload announced and then stalled commits only what arrived (``peer/incoming_payload.py``).

Each test states the bound it checks; the numbers before this work are in the comments (the same
inputs made the old code allocate the announced size, keep four records per connection, accept any
message while credit remained, and wait forever for a stalled payload).
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

import peer.rpc_outgoing
import peer.rpc_reading
from peer import Identity, Message, MessageTooLargeError, Router, open_peer_host
from peer.framing import HEADER, IDLE_BUFFER_SIZE, MAX_RECORD_SIZE, READ_SLACK, ProtocolError, RecordDecoder
from peer.packing import packb, unpackb
from peer.receive_budget import ReceiveBudget, ReceiveBudgetExceeded
from peer.rpc_events import CallCancelled
from peer.rpc_outgoing import INITIAL_SEND_BUFFER_SIZE, ReplyBudget
from peer.rpc_protocol import MAX_PAYLOAD, STREAM_WINDOW, RPCProtocol, StreamData
from tests.wire.test_hostile import authenticated_raw

MIB = 1 << 20


def vm_rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def opened_stream(window: int = STREAM_WINDOW, **options) -> tuple[RPCProtocol, int]:
    client, server = RPCProtocol(True, window=window), RPCProtocol(False, window=window, **options)
    call_id, header = client.open_stream("s", None)
    server.receive_header(header)
    return server, call_id


# ---------------------------------------------------------------------- payloads
def test_a_stalled_payload_commits_what_arrived_not_what_was_announced():
    """256 MiB announced, 1 MiB sent: the old code allocated all 256 MiB at the first record."""
    server = RPCProtocol(False, budget=ReceiveBudget())
    tracemalloc.start()
    try:
        server.receive_header(packb([7, 1, "peer.ping", None, None, MAX_PAYLOAD]))
        for _ in range(2):
            target = server.payload_target(MIB // 2)
            target[:] = b"x" * len(target)
            del target
            assert server.payload_received(MIB // 2) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB  # one record's step, doubled at most once
    assert server.budget.used <= 2 * MIB
    server.close()
    assert server.budget.used == 0


def test_a_payload_grown_in_steps_arrives_intact():
    client, server = RPCProtocol(True), RPCProtocol(False, budget=ReceiveBudget())
    data = bytes(range(256)) * (5 * MIB // 256 + 3)
    _, header = client.open_unary("m", None, len(data), None)
    server.receive_header(header)
    events, offset = [], 0
    while offset < len(data):
        chunk = data[offset : offset + MIB]
        server.payload_target(len(chunk))[:] = chunk
        events = server.payload_received(len(chunk))
        offset += len(chunk)
    [opened] = events
    assert opened.payload == data and server.budget.used == 0


def test_partial_payloads_share_one_budget_and_the_one_over_it_fails():
    budget = ReceiveBudget(limit=5 * MIB // 2)
    first, second = RPCProtocol(False, budget=budget), RPCProtocol(False, budget=budget)
    for protocol in (first, second):
        protocol.receive_header(packb([7, 1, "m", None, None, 64 * MIB]))
    first.payload_target(MIB)
    first.payload_received(MIB)
    second.payload_target(MIB)
    second.payload_received(MIB)
    with pytest.raises(ReceiveBudgetExceeded):
        first.payload_target(MIB)  # would double its buffer to 2 MiB: 3 MiB in all
    with pytest.raises(ReceiveBudgetExceeded):  # sticky, like every protocol error
        first.payload_received(0)
    first.close()
    assert budget.used == MIB  # only the second connection's buffer is still held


def test_payload_of_an_ended_call_is_dropped_as_it_arrives():
    client = RPCProtocol(True, budget=ReceiveBudget())
    call_id, _ = client.open_unary("m", None, 0, None)
    client.cancel(call_id)
    tracemalloc.start()
    try:
        client.receive_header(packb([8, call_id, None, 8 * MIB]))  # a RESULT nobody awaits
        for _ in range(8):
            client.payload_target(MIB)
            assert client.payload_received(MIB) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB and not client.awaiting_payload


# ---------------------------------------------------------------------- credit
def test_credit_overshoot_is_refused_at_the_header_before_any_payload():
    """The old rule let one message of up to 256 MiB in while any credit remained."""
    server, call_id = opened_stream()
    filler = STREAM_WINDOW - 64 - 16
    server.receive_header(packb([2, call_id, None, filler]))
    server.payload_target()[:] = bytes(filler)
    [data] = server.payload_received(filler)
    assert isinstance(data, StreamData)
    with pytest.raises(ProtocolError, match="credit"):
        server.receive_header(packb([2, call_id, None, 64 * MIB]))
    assert not server.awaiting_payload


def test_a_message_larger_than_the_window_goes_only_into_a_full_window():
    client, server = RPCProtocol(True, window=1000), RPCProtocol(False, window=1000)
    call_id, header = client.open_stream("s", None)
    server.receive_header(header)
    assert client.send_data(call_id, None, 5000) is not None  # a full window: allowed alone
    big = packb([2, call_id, None, 5000])
    server.receive_header(big)
    server.payload_target()[:] = bytes(5000)
    [data] = server.payload_received(5000)
    assert client.send_data(call_id, None, 10) is None  # the honest sender waits for credit
    # the reader drains its only message: all credit comes back, even below half a window
    credit = server.consumed(call_id, data.cost, drained=True)
    client.receive_header(credit)
    assert client.send_data(call_id, None, 900) is not None
    server.receive_header(packb([2, call_id, None, 900]))
    server.payload_target()[:] = bytes(900)
    server.payload_received(900)
    with pytest.raises(ProtocolError, match="credit"):  # a big one into a part-used window
        server.receive_header(packb([2, call_id, None, 5000]))


def test_unread_stream_data_per_connection_is_capped():
    client = RPCProtocol(True, window=1000)
    server = RPCProtocol(False, window=1000, max_unread=2500)
    calls = []
    for _ in range(3):
        call_id, header = client.open_stream("s", None)
        server.receive_header(header)
        calls.append(call_id)
    for call_id in calls[:2]:
        server.receive_header(packb([2, call_id, None, 990]))
        server.payload_whole(bytes(990))
    with pytest.raises(ProtocolError, match="unread"):
        server.receive_header(packb([2, calls[2], None, 990]))
        server.payload_whole(bytes(990))


# ---------------------------------------------------------------------- message sizes
def test_a_stream_message_larger_than_its_receiver_accepts_is_dropped_and_ends_the_call():
    """A 20 MiB message into an empty 16 MiB window used to be taken whole, as every message larger
    than the window was (four 250 MiB ones unread on live streams held +514 MB). Now the handler's
    side accepts what its method registered (16 MiB by default): the call ends, and the payload is
    dropped as it arrives, with nothing allocated or charged to the budget."""
    budget = ReceiveBudget()
    client, server = RPCProtocol(True), RPCProtocol(False, budget=budget)
    call_id, header = client.open_stream("s", None)
    server.receive_header(header)
    assert client.send_data(call_id, None, 20 * MIB) is not None  # the sender's window admits it
    [cancelled] = server.receive_header(packb([2, call_id, None, 20 * MIB]))
    assert cancelled == CallCancelled(call_id)  # the handler is cancelled: its call is over
    [refusal] = server.take_outbox()
    assert unpackb(refusal)[:3] == [4, call_id, "MessageTooLarge"]
    assert "at most 16777216" in unpackb(refusal)[3] and not server.is_live(call_id)
    for _ in range(20):  # the payload keeps coming; none of it is held
        server.payload_target(MIB)[:] = bytes(MIB)
        assert server.payload_received(MIB) == []
        assert budget.used == budget.peak == 0
    other, header = client.open_stream("s", None)  # the connection serves on
    [opened] = server.receive_header(header)
    assert opened.call_id == other


def test_a_stream_accepts_the_messages_its_receiver_registered_for():
    limits = {"big": 64 * MIB}
    client = RPCProtocol(True)
    server = RPCProtocol(False, budget=ReceiveBudget(), max_message=lambda method: limits.get(method, 1000))
    call_id, header = client.open_stream("big", None)
    server.receive_header(header)
    assert server.receive_header(packb([2, call_id, None, 2 * MIB])) == []  # accepted: it arrives
    server.payload_target()[:] = bytes(2 * MIB)
    [data] = server.payload_received(2 * MIB)
    assert isinstance(data, StreamData) and len(data.payload) == 2 * MIB
    small, header = client.open_stream("small", None)
    server.receive_header(header)
    assert server.receive_header(packb([2, small, None, 1001])) == [CallCancelled(small)]


def test_the_callers_limit_travels_in_its_open_and_binds_the_handlers_side():
    client, server = RPCProtocol(True, budget=ReceiveBudget()), RPCProtocol(False)
    call_id, header = client.open_stream("s", None, max_message=1000)
    server.receive_header(header)
    assert server.send_limit(call_id) == 1000
    with pytest.raises(ValueError, match="at most 1000"):  # an honest handler's side never sends it
        server.send_data(call_id, None, 1001)
    # One sent anyway (a hostile handler) ends the call at the caller, before any of it is held.
    [failed] = client.receive_header(packb([2, call_id, None, 5000]))
    assert failed.type_name == "MessageTooLarge" and "at most 1000" in failed.message
    assert unpackb(client.take_outbox()[0]) == [5, call_id]  # the handler is told to stop
    client.payload_target()[:] = bytes(5000)
    assert client.payload_received(5000) == [] and client.budget.peak == 0


async def test_a_message_over_the_handlers_limit_fails_the_call_and_the_connection_serves_on():
    router, received = Router(), []

    async def collect(stream):
        async for message in stream:
            received.append(len(message.payload))

    router.add_stream("collect", collect, max_message=MIB)

    @router.unary("echo")
    async def echo(request):
        return request.body

    async with (
        open_peer_host(Identity.generate(), router=router) as server,
        open_peer_host(Identity.generate(), listen=None) as client,
    ):
        connection = await client.connect(server.listen_address)
        with trio.fail_after(10):
            with pytest.raises(MessageTooLargeError, match=f"at most {MIB}"):
                async with connection.stream("collect") as stream:
                    await stream.send(None, bytes(MIB))
                    await stream.send(None, bytes(2 * MIB))  # sent: the handler's side refuses it
                    await stream.receive()
            assert (await connection.call("echo", "still here")).body == "still here"
        assert received == [MIB]


async def test_a_handler_sending_more_than_its_caller_accepts_is_stopped_before_sending():
    router, failures = Router(), []

    async def big(stream):
        try:
            await stream.send(None, bytes(2 * MIB))
        except MessageTooLargeError as error:
            failures.append(error)
            await stream.send("too large")

    router.add_stream("big", big)
    async with (
        open_peer_host(Identity.generate(), router=router) as server,
        open_peer_host(Identity.generate(), listen=None) as client,
    ):
        connection = await client.connect(server.listen_address)
        with trio.fail_after(10):
            async with connection.stream("big", max_message=MIB) as stream:
                assert (await stream.receive()).body == "too large"
        [error] = failures
        assert f"at most {MIB}" in str(error)


# ---------------------------------------------------------------------- records
def test_decoder_buffer_never_exceeds_one_record_plus_slack():
    """The old decoder grew to four maximal records per connection."""
    budget = ReceiveBudget()
    decoder = RecordDecoder(budget=budget)
    body = bytes(MAX_RECORD_SIZE)
    stream = (HEADER.pack(len(body)) + body + HEADER.pack(3) + b"abc") * 4
    offset = 0
    while offset < len(stream):
        view = decoder.writable()
        n = min(len(view), 300_000, len(stream) - offset)
        view[:n] = stream[offset : offset + n]
        del view
        decoder.commit(n)
        offset += n
        while decoder.next_record() is not None:
            pass
        assert decoder.buffer_size <= HEADER.size + MAX_RECORD_SIZE + READ_SLACK
    assert decoder.release() and budget.used == 0


def test_half_sent_records_commit_half_a_record_and_give_it_back_on_close():
    """64 connections each holding half of a maximal record: the old decoder kept ~4 MiB each
    (about 256 MiB here), and glibc did not return it after close."""
    budget = ReceiveBudget()
    half = HEADER.pack(MAX_RECORD_SIZE) + bytes(MAX_RECORD_SIZE // 2)
    gc.collect()
    before = vm_rss_kb()
    decoders = []
    for _ in range(64):
        decoder = RecordDecoder(budget=budget)
        decoder.receive_data(half)
        assert decoder.next_record() is None
        decoders.append(decoder)
    held_mib = (vm_rss_kb() - before) / 1024
    assert held_mib < 48  # 0.5 MiB of record each, plus slack: ~34 MiB
    assert budget.used == 64 * (HEADER.size + MAX_RECORD_SIZE + READ_SLACK)
    for decoder in decoders:
        decoder.release(closing=True)
    del decoders, decoder
    gc.collect()
    assert budget.used == 0
    assert (vm_rss_kb() - before) / 1024 < 8  # the mappings went back to the OS


# ---------------------------------------------------------------------- the driver
async def test_a_stalled_payload_costs_its_connection_after_the_timeout(monkeypatch):
    monkeypatch.setattr(peer.rpc_reading, "STALLED_MESSAGE_TIMEOUT", 0.5)
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return request.body

    async with open_peer_host(Identity.generate(), router=router, run_id="r") as host:
        stream, channel = await authenticated_raw(host)
        await channel.send_record(packb([7, 1, "echo", None, None, 64 * MIB]))
        await channel.send_record(bytes(MIB))  # the first MiB, then silence
        with trio.fail_after(5):
            with pytest.raises((trio.EndOfChannel, trio.BrokenResourceError)):
                await channel.receive_record()  # the server closes the connection
        await trio.aclose_forcefully(stream)
        async with open_peer_host(Identity.generate(), listen=None, run_id="r") as client:
            connection = await client.connect(host.listen_address)
            assert (await connection.call("echo", "still here", timeout=5)).body == "still here"


async def test_answers_a_peer_leaves_unread_are_bounded_and_its_further_calls_refused(monkeypatch):
    """A DHT node asked 40 times for a 15 MiB dictionary value over one connection, by a peer that
    reads nothing, held +300 MB until the connection was cut (every result was queued up to 272 MiB).
    Scaled down: 40 answers of 1 MiB against a budget of 4 MiB."""
    monkeypatch.setattr(peer.rpc_outgoing, "REPLY_BUDGET_PER_CONNECTION", 4 * MIB)
    budget = ReplyBudget()
    monkeypatch.setattr(peer.rpc_outgoing, "process_reply_budget", lambda: budget)
    router, answered = Router(), []

    @router.unary("find")
    async def find(request):
        answered.append(request.body)
        return Message(None, bytes(MIB))

    async with open_peer_host(Identity.generate(), router=router, run_id="r") as host:
        stream, channel = await authenticated_raw(host)
        calls = range(1, 81, 2)
        for call_id in calls:
            await channel.send_record(packb([7, call_id, "find", None, call_id, 0]))
            if call_id == 39:
                await wait_all_tasks_blocked()  # the first 20 are answered (or refused) and queued
        await wait_all_tasks_blocked()  # the node has taken every request; the peer reads now
        replies = {}
        with trio.fail_after(10):
            while len(replies) < len(calls):
                header = unpackb(await channel.receive_record())
                replies[header[1]] = header
                if header[0] == 8:
                    received = 0
                    while received < header[3]:
                        received += len(await channel.receive_record())
        results = [i for i, header in replies.items() if header[0] == 8]
        refused = [i for i, header in replies.items() if header[0] == 4 and header[2] == "Busy"]
        assert len(results) + len(refused) == len(calls) and refused  # each answered, some with Busy
        # What waited for the peer: the budget, one answer over it, and what the writer holds.
        assert budget.peak <= 5 * MIB + 64 * 1024
        # Calls made while it was backlogged (all of the second 20) never reached the handler.
        assert answered and max(answered) <= 39
        await channel.send_record(packb([7, 81, "find", None, 81, 0]))  # having read, it is served
        with trio.fail_after(5):
            assert unpackb(await channel.receive_record())[:2] == [8, 81]
        await trio.aclose_forcefully(stream)


async def test_a_quiet_connection_holds_small_buffers_whatever_it_carried_before(monkeypatch):
    """A peer keeps connections to dozens of peers, most of them quiet: each end's buffers grow
    for a large payload and go back to a few KiB once the connection has been quiet a moment."""
    monkeypatch.setattr(peer.rpc_reading, "IDLE_BUFFER_RELEASE", 0.2)
    monkeypatch.setattr(peer.rpc_outgoing, "SEND_BUFFER_IDLE_RELEASE", 0.2)
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return Message(None, request.payload)

    quiet = IDLE_BUFFER_SIZE + INITIAL_SEND_BUFFER_SIZE
    async with (
        open_peer_host(Identity.generate(), router=router) as server,
        open_peer_host(Identity.generate()) as client,
    ):
        reply = await client.call(server.listen_address, "echo", None, payload=b"x" * 100, timeout=5)
        connection = client.connection_to(server.peer_id)
        served = server.connection_to(client.peer_id)
        assert bytes(reply.payload) == b"x" * 100
        with trio.fail_after(5):  # (a read that filled a small buffer widened it; quiet, it goes back)
            while connection.buffer_bytes > quiet or served.buffer_bytes > quiet:
                await trio.sleep(0.05)
        big = bytes(3 << 20)
        reply = await client.call(server.listen_address, "echo", None, payload=big, timeout=10)
        assert len(reply.payload) == len(big)
        assert connection.buffer_bytes > 1 << 20 and served.buffer_bytes > 1 << 20
        with trio.fail_after(5):
            while max(connection.buffer_bytes, served.buffer_bytes) > IDLE_BUFFER_SIZE + INITIAL_SEND_BUFFER_SIZE:
                await trio.sleep(0.05)
