"""Error codes on the wire: each arrives as its own exception type, a remote deadline included.

The two ends are tested apart, each against a hand-driven peer over a real secure channel: a
handler's budget is the caller's own timeout, so between two real peers the caller's clock runs
out first and a remote ``DeadlineExceeded`` cannot be provoked reliably."""

from __future__ import annotations

import math
from functools import partial

import pytest
import trio

from peer import (
    LOCAL_DIFFICULTY,
    BadRequest,
    BadRequestError,
    BusyError,
    DeadlineExceededError,
    Identity,
    NodeIDProof,
    PeerAddress,
    RemoteError,
    Router,
    UnknownMethodError,
    open_peer_host,
)
from peer.packing import packb, unpackb
from peer.rpc_errors import BAD_REQUEST, BUSY, DEADLINE_EXCEEDED, UNKNOWN_METHOD, error_code, remote_error
from peer.secure_channel import PROTOCOL_VERSION, Hello, secure_handshake

UNARY, ERROR = 7, 4


def _hello(identity: Identity) -> Hello:
    """A hand-driven peer's hello, with the node-ID proof every peer of a run must show."""
    nonce = NodeIDProof.solve(identity.peer_id, LOCAL_DIFFICULTY).nonce
    return Hello(PROTOCOL_VERSION, "default", node_id_nonce=nonce)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (UNKNOWN_METHOD, UnknownMethodError),
        (BAD_REQUEST, BadRequestError),
        (BUSY, BusyError),
        (DEADLINE_EXCEEDED, DeadlineExceededError),
        ("KeyError", RemoteError),  # any other exception of the handler's
    ],
)
def test_every_error_code_maps_to_its_own_type(code, expected):
    error = remote_error("m", Identity.generate().peer_id, code, "why")
    assert type(error) is expected and error.type_name == code and error.remote_message == "why"


def test_a_handlers_bad_request_travels_under_its_code():
    class WrongShape(BadRequest):
        pass

    assert error_code(BadRequest("x")) == error_code(WrongShape("x")) == BAD_REQUEST
    assert error_code(KeyError("x")) == "KeyError"


async def test_a_handler_out_of_time_answers_deadline_exceeded():
    router = Router()

    @router.unary("slow")
    async def slow(request):
        await trio.sleep(math.inf)

    async with open_peer_host(Identity.generate(), router=router) as server:
        address = server.listen_address
        stream = await trio.open_tcp_stream(address.host, address.port)
        identity = Identity.generate()
        channel = await secure_handshake(stream, identity, _hello(identity), initiator=True, timeout=5)
        with trio.fail_after(5):
            await channel.send_record(packb([UNARY, 1, "slow", 0.05, None, 0]))
            reply = unpackb(await channel.receive_record())
        assert reply[:3] == [ERROR, 1, DEADLINE_EXCEEDED]
        await channel.aclose()


async def test_a_remote_deadline_arrives_as_deadline_exceeded_error():
    async def answer_out_of_time(stream: trio.SocketStream) -> None:
        identity = Identity.generate()
        channel = await secure_handshake(stream, identity, _hello(identity), initiator=False, timeout=5)
        request = unpackb(await channel.receive_record())
        await channel.send_record(packb([ERROR, request[1], DEADLINE_EXCEEDED, "the handler ran out of time"]))
        await trio.sleep(math.inf)

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(partial(trio.serve_tcp, answer_out_of_time, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        async with open_peer_host(Identity.generate(), listen=None) as client:
            connection = await client.connect(PeerAddress("127.0.0.1", port))
            with pytest.raises(DeadlineExceededError, match="ran out of time") as caught:
                await connection.call("slow", timeout=5)
        assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, RemoteError)
        nursery.cancel_scope.cancel()
