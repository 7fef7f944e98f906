"""Bad input from strangers and from authenticated peers: each costs the offender its connection,
never the server, which keeps serving a well-behaved client afterwards."""

from __future__ import annotations

import os

import pytest
import trio

from peer import LOCAL_DIFFICULTY, Identity, NodeIDProof, Router, open_peer_host
from peer.framing import HEADER
from peer.packing import packb, unpackb
from peer.secure_channel import PROTOCOL_VERSION, Hello, secure_handshake

HANDSHAKE_TIMEOUT = 0.5


def echo_router() -> Router:
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return request.body

    return router


@pytest.fixture
async def server():
    async with open_peer_host(
        Identity.generate(), router=echo_router(), run_id="r", handshake_timeout=HANDSHAKE_TIMEOUT
    ) as host:
        yield host


async def assert_still_serving(server) -> None:
    with trio.fail_after(5):
        async with open_peer_host(Identity.generate(), listen=None, run_id="r") as client:
            connection = await client.connect(server.listen_address)
            assert (await connection.call("echo", "alive", timeout=2)).body == "alive"


async def raw_connection(server) -> trio.SocketStream:
    return await trio.open_tcp_stream(server.listen_address.host, server.listen_address.port)


async def assert_dropped(stream: trio.SocketStream, within: float = 3.0) -> None:
    """The server closes the connection (we read EOF or a reset) within ``within`` seconds."""
    with trio.fail_after(within):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass


async def authenticated_raw(server) -> tuple[trio.SocketStream, object]:
    """A real handshake done by hand, so the test can then write arbitrary records."""
    stream = await raw_connection(server)
    identity = Identity.generate()
    nonce = NodeIDProof.solve(identity.peer_id, LOCAL_DIFFICULTY).nonce
    hello = Hello(PROTOCOL_VERSION, "r", node_id_nonce=nonce)
    channel = await secure_handshake(stream, identity, hello, initiator=True, timeout=5)
    return stream, channel


async def test_random_bytes_instead_of_a_handshake(server):
    stream = await raw_connection(server)
    await stream.send_all(os.urandom(3000))
    await assert_dropped(stream)
    await assert_still_serving(server)


async def test_oversized_length_during_the_handshake(server):
    stream = await raw_connection(server)
    await stream.send_all(HEADER.pack(0x7FFFFFFF) + b"\0" * 100)
    await assert_dropped(stream)
    await assert_still_serving(server)


async def test_half_finished_handshake_is_dropped_at_its_deadline(server):
    stream = await raw_connection(server)
    await stream.send_all(HEADER.pack(32) + os.urandom(32))  # a valid first Noise message, then silence
    await assert_still_serving(server)  # served while the stalled one is pending
    start = trio.current_time()
    await assert_dropped(stream, within=HANDSHAKE_TIMEOUT + 2)
    assert trio.current_time() - start <= HANDSHAKE_TIMEOUT + 1


async def test_tampered_ciphertext_drops_the_connection(server):
    stream, channel = await authenticated_raw(server)
    plaintext = packb([7, 1, "echo", None, "tampered", 0])  # a well-formed unary call
    record = bytearray(HEADER.size + len(plaintext) + 16)
    channel.seal_into(plaintext, memoryview(record))
    record[20] ^= 0x01  # flip one bit of ciphertext
    await stream.send_all(record)
    await assert_dropped(stream)
    await assert_still_serving(server)


async def test_oversized_frame_length_after_the_handshake(server):
    stream, _ = await authenticated_raw(server)
    await stream.send_all(HEADER.pack(0xFFFFFFFF))
    await assert_dropped(stream)
    await assert_still_serving(server)


@pytest.mark.parametrize(
    "plaintext", [b"\xc1\xc1\xc1", b"\x91" * 3000, b"\x92\x07"], ids=["invalid-byte", "deep-nesting", "truncated"]
)
async def test_malformed_msgpack_from_an_authenticated_peer(server, plaintext):
    stream, channel = await authenticated_raw(server)
    await channel.send_record(plaintext)
    await assert_dropped(stream)
    await assert_still_serving(server)


async def test_flood_of_connections(server):
    idle, junk = [], []
    try:
        for _ in range(200):
            idle.append(await raw_connection(server))
        for _ in range(50):
            stream = await raw_connection(server)
            await stream.send_all(os.urandom(500))
            junk.append(stream)
        await assert_still_serving(server)  # while all of them are still open
        for stream in junk:
            await assert_dropped(stream)
    finally:
        for stream in idle + junk:
            await trio.aclose_forcefully(stream)
    await assert_still_serving(server)


async def test_a_flood_of_tiny_records_does_not_stall_the_event_loop(server):
    """An authenticated peer sends ~120,000 tiny (ignored) records back to back; the server's event
    loop, shared with this test, must keep ticking while the flood is processed."""
    stream, channel = await authenticated_raw(server)
    record = packb([6, 99, 1])  # CREDIT for a call that does not exist: late traffic, ignored
    flood = bytearray(120_000 * (HEADER.size + len(record) + 16))
    view, position = memoryview(flood), 0
    while position < len(flood):
        position += channel.seal_into(record, view[position:])
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = trio.current_time()
        while not done.is_set():
            await trio.sleep(0)
            now = trio.current_time()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await stream.send_all(flood)
        await channel.send_record(packb([7, 1, "echo", None, "after the flood", 0]))
        with trio.fail_after(30):  # answered only once the whole flood ahead of it is processed
            assert unpackb(await channel.receive_record()) == [8, 1, "after the flood", 0]
        done.set()
    assert max(gaps) < 0.1, f"the event loop stalled for {max(gaps) * 1e3:.0f} ms"
