"""RPC over real encrypted connections on 127.0.0.1: every call kind, concurrency, cancellation,
deadlines, errors, backpressure and the connection pool."""

from __future__ import annotations

import math

import pytest
import trio

from peer import (
    BadRequest,
    BadRequestError,
    CallTimeoutError,
    ConnectionLost,
    Identity,
    Message,
    RemoteError,
    Router,
    StreamClosed,
    UnknownMethodError,
    open_peer_host,
)
from peer.rpc_protocol import STREAM_WINDOW


class Probe:
    """What the server-side handlers saw, for assertions."""

    def __init__(self) -> None:
        self.cancelled = trio.Event()
        self.started = trio.Event()
        self.deadline_budget: float | None = None
        self.received: list[int] = []
        self.reader_done = trio.Event()


def make_router(probe: Probe) -> Router:
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return Message(request.body, request.payload)

    @router.unary("add")
    async def add(request):
        body = request.body
        if not (isinstance(body, dict) and type(body.get("a")) is int and type(body.get("b")) is int):
            raise BadRequest("add needs {'a': int, 'b': int}")
        return body["a"] + body["b"]

    @router.unary("fail")
    async def fail(request):
        raise RuntimeError("the disk is on fire")

    @router.unary("hang")
    async def hang(request):
        probe.started.set()
        probe.deadline_budget = trio.current_effective_deadline() - trio.current_time()
        try:
            await trio.sleep_forever()
        finally:
            probe.cancelled.set()

    @router.stream("range")
    async def range_stream(stream):
        async for message in stream:
            for i in range(message.body):
                await stream.send(i, bytes([i % 256]) * 1000)
            return

    @router.stream("blobs")
    async def blobs(stream):
        count, size = (await stream.receive()).body
        for i in range(count):
            await stream.send(i, bytes([i]) * size)

    @router.stream("sum")
    async def sum_stream(stream):
        total = 0
        async for message in stream:
            total += message.body
        await stream.send(total)

    @router.stream("echo_stream")
    async def echo_stream(stream):
        async for message in stream:
            await stream.send(message.body, message.payload)

    @router.stream("double")
    async def double(stream):
        async for message in stream:
            await stream.send(message.body * 2)

    @router.stream("slow_reader")
    async def slow_reader(stream):
        probe.started.set()
        await probe.cancelled.wait()  # reused here as "start reading now"
        async for message in stream:
            probe.received.append(len(message.payload))
        probe.reader_done.set()

    return router


@pytest.fixture
async def peers():
    probe = Probe()
    async with open_peer_host(Identity.generate(), router=make_router(probe)) as server:
        async with open_peer_host(Identity.generate(), listen=None) as client:
            connection = await client.connect(server.listen_address)
            yield server, client, connection, probe


async def test_unary_round_trip_with_body_and_payload(peers):
    _, _, connection, _ = peers
    reply = await connection.call("echo", {"k": [1, 2.5, "s", b"b"]}, payload=b"\x00\x01" * 1000)
    assert reply.body == {"k": [1, 2.5, "s", b"b"]}
    assert bytes(reply.payload) == b"\x00\x01" * 1000


async def test_large_payload_spanning_many_records(peers):
    _, _, connection, _ = peers
    blob = bytes(range(256)) * (5 * 4096 + 3)  # ~5 MiB, not a multiple of the record size
    reply = await connection.call("echo", None, payload=memoryview(blob))
    assert reply.payload == blob


@pytest.mark.parametrize("empty", [b"", bytearray(), memoryview(b"")], ids=["bytes", "bytearray", "memoryview"])
async def test_an_empty_payload_is_a_payload_for_calls_replies_and_streams(peers, empty):
    # A lone call with a small message takes the send queue's fast path; an empty payload there
    # must not become an empty record, which the receiver would take for an undecodable header.
    _, _, connection, _ = peers
    with trio.fail_after(5):
        for _ in range(3):
            reply = await connection.call("echo", "nothing attached", payload=empty)
            assert reply.body == "nothing attached" and bytes(reply.payload) == b""
        async with connection.stream("echo_stream") as stream:
            for i in range(3):
                await stream.send(i, empty)
                message = await stream.receive()
                assert message.body == i and bytes(message.payload) == b""
            await stream.end()
        assert (await connection.call("add", {"a": 1, "b": 2})).body == 3
    assert not connection.is_closed


async def test_server_client_and_bidirectional_streams(peers):
    _, _, connection, _ = peers
    async with connection.stream("range") as stream:
        await stream.send(5)
        got = [(m.body, bytes(m.payload[:1])) async for m in stream]
    assert got == [(i, bytes([i])) for i in range(5)]

    async with connection.stream("sum") as stream:
        for i in range(100):
            await stream.send(i)
        await stream.end()
        assert (await stream.receive()).body == sum(range(100))
        with pytest.raises(trio.EndOfChannel):
            await stream.receive()

    async with connection.stream("double") as stream:
        for i in range(10):
            await stream.send(i)
            assert (await stream.receive()).body == 2 * i
        await stream.end()


async def test_thousand_concurrent_calls_share_one_connection(peers):
    server, client, connection, _ = peers
    results = {}

    async def one(i: int) -> None:
        results[i] = (await connection.call("add", {"a": i, "b": 1}, timeout=30)).body

    async with trio.open_nursery() as nursery:
        for i in range(1000):
            nursery.start_soon(one, i)
    assert results == {i: i + 1 for i in range(1000)}
    assert client.connected_peers == [server.peer_id]
    assert connection.protocol.active_calls == 0


async def test_cancelling_a_call_cancels_the_remote_handler_within_a_second(peers):
    _, _, connection, probe = peers
    async with trio.open_nursery() as nursery:
        cancel_scope = trio.CancelScope()

        async def caller() -> None:
            with cancel_scope:
                await connection.call("hang")

        nursery.start_soon(caller)
        with trio.fail_after(5):
            await probe.started.wait()
        cancel_scope.cancel()
    with trio.fail_after(1):
        await probe.cancelled.wait()
    assert (await connection.call("echo", "still fine")).body == "still fine"


async def test_deadline_raises_timeout_and_reaches_the_handler(peers):
    _, _, connection, probe = peers
    start = trio.current_time()
    with pytest.raises(CallTimeoutError, match="hang"):
        await connection.call("hang", timeout=0.3)
    assert 0.25 < trio.current_time() - start < 2
    assert probe.deadline_budget is not None and probe.deadline_budget <= 0.3
    with trio.fail_after(1):
        await probe.cancelled.wait()


async def test_enclosing_deadline_is_sent_to_the_handler(peers):
    _, _, connection, probe = peers
    with trio.move_on_after(0.4):
        await connection.call("hang")
    assert probe.deadline_budget is not None and probe.deadline_budget <= 0.4
    with trio.fail_after(1):
        await probe.cancelled.wait()


async def test_remote_exception_arrives_typed_with_its_message(peers):
    _, _, connection, _ = peers
    with pytest.raises(RemoteError) as caught:
        await connection.call("fail")
    assert caught.value.type_name == "RuntimeError"
    assert "the disk is on fire" in str(caught.value)
    assert caught.value.method == "fail"
    assert (await connection.call("add", {"a": 1, "b": 2})).body == 3


async def test_wrong_argument_types_get_a_bad_request_error(peers):
    _, _, connection, _ = peers
    for bad in ({"a": "1", "b": 2}, [1, 2], None, {"a": 1}):
        with pytest.raises(BadRequestError, match="add needs"):
            await connection.call("add", bad)
    assert (await connection.call("add", {"a": 2, "b": 2})).body == 4


async def test_unknown_method_names_the_method(peers):
    _, _, connection, _ = peers
    with pytest.raises(UnknownMethodError, match="no such method 'nope'"):
        await connection.call("nope")
    with pytest.raises(UnknownMethodError, match="is a stream method"):
        await connection.call("sum")


async def test_slow_reader_bounds_what_the_sender_buffers(peers):
    _, _, connection, probe = peers
    chunk = bytes(1 << 20)
    sent = 0
    async with connection.stream("slow_reader", timeout=30) as stream:
        with trio.move_on_after(1.0):
            while True:
                await stream.send(None, chunk)
                sent += 1
        # The receiver reads nothing yet: the sender must have stopped at about one window.
        assert sent <= STREAM_WINDOW // len(chunk) + 1
        assert sent >= STREAM_WINDOW // len(chunk) - 1
        probe.cancelled.set()  # let the handler read; the sender can go on
        for _ in range(10):
            await stream.send(None, chunk)
        await stream.end()
        with trio.fail_after(10):
            await probe.reader_done.wait()
    assert probe.received == [len(chunk)] * (sent + 10)


async def test_pool_reconnects_after_the_connection_dies(peers):
    server, client, connection, _ = peers
    connection.close()
    with trio.fail_after(2):
        await connection.closed.wait()
    with pytest.raises(ConnectionLost):
        await connection.call("echo", 1)
    fresh = await client.connect(server.listen_address)
    assert fresh is not connection
    assert (await fresh.call("echo", 7)).body == 7
    assert await client.connect(server.listen_address) is fresh


async def test_pending_calls_fail_when_the_peer_goes_away():
    probe = Probe()
    server_scope = trio.CancelScope()
    ready = trio.Event()
    address = []

    async def run_server() -> None:
        with server_scope:
            async with open_peer_host(Identity.generate(), router=make_router(probe)) as server:
                address.append(server.listen_address)
                ready.set()
                await trio.sleep(math.inf)

    async def stop_server_when_handler_runs() -> None:
        await probe.started.wait()
        server_scope.cancel()

    async with open_peer_host(Identity.generate(), listen=None) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_server)
            await ready.wait()
            connection = await client.connect(address[0])
            nursery.start_soon(stop_server_when_handler_runs)
            with pytest.raises(ConnectionLost), trio.fail_after(5):
                await connection.call("hang")
        assert client.connected_peers == []


async def test_stream_send_after_the_handler_returned_is_refused(peers):
    _, _, connection, _ = peers
    async with connection.stream("range") as stream:
        await stream.send(1)
        assert [m.body async for m in stream] == [0]
        with pytest.raises(StreamClosed):
            await stream.send(2)


async def test_both_sides_can_call_each_other_on_one_connection():
    router_a, router_b = Router(), Router()
    router_a.add_unary("who", lambda request: _value("a"))
    router_b.add_unary("who", lambda request: _value("b"))
    async with open_peer_host(Identity.generate(), router=router_a) as a:
        async with open_peer_host(Identity.generate(), router=router_b) as b:
            accepted = trio.Event()
            a.on_connection.append(lambda connection, incoming: accepted.set())
            connection = await b.connect(a.listen_address)
            assert (await connection.call("who")).body == "a"
            with trio.fail_after(2):
                await accepted.wait()
            assert (await a.connection_to(b.peer_id).call("who")).body == "b"


async def _value(value):
    return value


async def test_traffic_counters_count_what_crossed_the_wire(peers):
    server, client, connection, _ = peers
    sent_before, received_before = client.traffic.bytes_sent, server.traffic.bytes_received
    await connection.call("echo", None, payload=bytes(3 << 20))
    sent = client.traffic.bytes_sent - sent_before
    assert 3 << 20 < sent < (3 << 20) + 4096  # payload plus a few record headers and tags
    assert server.traffic.bytes_received - received_before == sent
    assert client.traffic.bytes_received >= 3 << 20  # the echo came back


@pytest.mark.parametrize("size", [1000, 1536 * 1024])  # within one record, and spanning two
async def test_payloads_are_received_into_buffers_the_caller_supplies(peers, size):
    _, _, connection, _ = peers
    supplied: dict[int, bytearray] = {}

    def provider(body, nbytes):
        assert nbytes == size
        if body % 4 == 0:
            supplied[body] = bytearray(nbytes)
            return supplied[body]
        if body % 4 == 1:
            return None  # receive into a fresh buffer as usual
        if body % 4 == 2:
            raise KeyError("a provider bug costs a copy, not the stream")
        return bytearray(nbytes - 1)  # the wrong size: refused, a fresh buffer instead

    async with connection.stream("blobs") as stream:
        stream.set_buffer_provider(provider)
        await stream.send((8, size))
        received = [message async for message in stream]
    assert [m.body for m in received] == list(range(8))
    for message in received:
        assert bytes(message.payload) == bytes([message.body]) * size
        assert (message.payload is supplied.get(message.body)) == (message.body % 4 == 0)
    assert sorted(supplied) == [0, 4]


async def test_dialing_from_a_host_that_has_shut_down_is_a_clean_connect_error():
    from peer import ConnectError

    async with open_peer_host(Identity.generate(), router=Router()) as server:
        async with open_peer_host(Identity.generate(), listen=None) as client:
            pass  # a task that outlives its host (e.g. an all-reduce round) may still try to dial
        with pytest.raises(ConnectError, match="shutting down"):
            await client.connect(server.listen_address)


async def test_a_prepare_hook_supplies_buffers_before_the_first_message_arrives():
    seen: list[bool] = []
    lent: list[bytearray] = []

    def prepare(stream):
        stream.set_buffer_provider(lambda body, nbytes: lent.append(bytearray(nbytes)) or lent[-1])

    async def collect(stream):
        seen.extend([message.payload is lent[i] async for i, message in _enumerate(stream)])
        await stream.send(len(seen))

    def broken_prepare(stream):
        raise RuntimeError("prepare is broken")

    router = Router()
    router.add_stream("collect", collect, prepare=prepare)
    router.add_stream("broken", collect, prepare=broken_prepare)
    async with open_peer_host(Identity.generate(), router=router) as server:
        async with open_peer_host(Identity.generate(), listen=None) as client:
            connection = await client.connect(server.listen_address)
            async with connection.stream("collect") as stream:
                for i in range(5):  # sent at once: they arrive before the handler task runs
                    await stream.send(i, bytes([i]) * 3000)
                await stream.end()
                assert (await stream.receive()).body == 5
            assert seen == [True] * 5 and [bytes(b) for b in lent] == [bytes([i]) * 3000 for i in range(5)]
            with pytest.raises(RemoteError, match="prepare is broken"):
                async with connection.stream("broken") as stream:
                    await stream.send(0)
                    await stream.receive()
            async with connection.stream("collect") as stream:  # the connection still serves
                await stream.end()
                assert (await stream.receive()).body == 5


async def _enumerate(stream):
    i = 0
    async for message in stream:
        yield i, message
        i += 1
