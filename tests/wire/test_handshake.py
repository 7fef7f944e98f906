"""Who you are and what you speak: pinned identities, run IDs and protocol versions."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from peer import (
    ConnectError,
    Identity,
    NodeIDProof,
    PeerAddress,
    PeerHost,
    Request,
    Router,
    UnknownMethodError,
    open_peer_host,
)
from peer.node_id import NONCE_BYTES
from peer.secure_channel import PROTOCOL_VERSION, Hello, secure_handshake


async def test_pinned_peer_id_that_does_not_match_names_both():
    server_identity, impostor = Identity.generate(), Identity.generate()
    async with open_peer_host(server_identity) as server, open_peer_host(Identity.generate(), listen=None) as client:
        address = server.listen_address
        wrong = PeerAddress(address.host, address.port, impostor.peer_id)
        with pytest.raises(ConnectError) as caught:
            await client.connect(wrong)
        message = str(caught.value)
        assert f"expected {impostor.peer_id}" in message
        assert f"the peer is {server_identity.peer_id}" in message
        assert client.connected_peers == []
        right = await client.connect(address)  # the correct pin works
        assert right.remote_peer_id == server_identity.peer_id


async def test_unpinned_address_learns_the_identity():
    async with (
        open_peer_host(Identity.generate()) as server,
        open_peer_host(Identity.generate(), listen=None) as client,
    ):
        address = server.listen_address
        connection = await client.connect(PeerAddress(address.host, address.port))
        assert connection.remote_peer_id == server.peer_id
        assert connection.remote_listen_address == address


async def test_wrong_run_id_is_refused_saying_what_differs():
    async with open_peer_host(Identity.generate(), run_id="alpha") as server:
        async with open_peer_host(Identity.generate(), listen=None, run_id="beta") as client:
            with pytest.raises(ConnectError, match=r"run ID mismatch.*'beta'.*'alpha'"):
                await client.connect(server.listen_address)


async def test_wrong_protocol_version_is_refused_saying_what_differs():
    async with open_peer_host(Identity.generate()) as server:
        async with open_peer_host(Identity.generate(), listen=None, protocol_version=PROTOCOL_VERSION + 1) as client:
            with pytest.raises(
                ConnectError,
                match=rf"protocol version mismatch.*version {PROTOCOL_VERSION + 1}.*version {PROTOCOL_VERSION}",
            ):
                await client.connect(server.listen_address)


async def test_connecting_to_itself_is_refused():
    identity = Identity.generate()
    async with open_peer_host(identity) as host:
        with pytest.raises(ConnectError, match="itself"):
            await host.connect(host.listen_address)


async def test_client_mode_peer_serves_no_calls():
    async with open_peer_host(Identity.generate()) as server:
        accepted = trio.Event()
        server.on_connection.append(lambda connection, incoming: accepted.set())
        async with open_peer_host(Identity.generate(), client_mode=True) as client:
            assert client.listen_address is None
            connection = await client.connect(server.listen_address)
            assert connection.remote_listen_address == server.listen_address
            with trio.fail_after(2):
                await accepted.wait()
            back = server.connection_to(client.peer_id)
            assert back is not None and back.remote_listen_address is None
            with pytest.raises(UnknownMethodError, match="client mode"):
                await back.call("anything", timeout=2)


async def test_a_handler_learns_who_called_and_where_the_caller_listens():
    router = Router()

    @router.unary("whoami")
    async def whoami(request: Request) -> list:
        address = request.listen_address
        return [str(request.peer), str(address) if address is not None else None]

    async with open_peer_host(Identity.generate(), router=router) as server:
        async with (
            open_peer_host(Identity.generate()) as listening,
            open_peer_host(Identity.generate(), listen=None) as silent,
        ):
            for client, expected in ((listening, str(listening.listen_address)), (silent, None)):
                reply = await client.call(server.listen_address, "whoami", timeout=5)
                assert reply.body == [str(client.peer_id), expected]


async def test_a_different_node_id_difficulty_is_refused_naming_both():
    async with open_peer_host(Identity.generate(), node_id_difficulty=6) as server:
        async with open_peer_host(Identity.generate(), listen=None, node_id_difficulty=5) as client:
            with pytest.raises(ConnectError, match=r"node-ID difficulty mismatch.*requires difficulty 5.*requires 6"):
                await client.connect(server.listen_address)


async def test_a_hello_whose_node_id_proof_falls_short_is_refused():
    """A nonce that does not solve the puzzle for the authenticated key (unsolved, or another
    key's solution) is refused at the handshake: the honest dialer gets an error that says how much
    work the proof has and how much the run needs, and an honest server drops the connection."""
    difficulty = 12
    cheat = Identity.generate()
    borrowed = NodeIDProof.solve(Identity.generate().peer_id, difficulty).nonce  # another key's solution
    unsolved = next(  # the first nonce that falls short for this key
        n.to_bytes(NONCE_BYTES, "little")
        for n in range(1 << 16)
        if not NodeIDProof(cheat.peer_id, n.to_bytes(NONCE_BYTES, "little")).satisfies(difficulty)
    )
    for nonce in (borrowed, unsolved):
        if NodeIDProof(cheat.peer_id, nonce).satisfies(difficulty):
            continue  # a 2**-12 accident: the borrowed nonce happens to solve this key too
        hello = Hello(PROTOCOL_VERSION, "default", node_id_nonce=nonce, node_id_difficulty=difficulty)

        async def cheat_serves(stream: trio.SocketStream, hello: Hello = hello) -> None:
            with trio.move_on_after(5):
                await secure_handshake(stream, cheat, hello, initiator=False, timeout=5)

        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(partial(trio.serve_tcp, cheat_serves, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            async with open_peer_host(Identity.generate(), listen=None, node_id_difficulty=difficulty) as honest:
                with pytest.raises(ConnectError, match=r"node-ID proof with \d+ bits of work; this run requires 12"):
                    await honest.connect(PeerAddress("127.0.0.1", port))
                assert honest.connected_peers == []
            nursery.cancel_scope.cancel()

        async with open_peer_host(Identity.generate(), node_id_difficulty=difficulty) as server:
            address = server.listen_address
            stream = await trio.open_tcp_stream(address.host, address.port)
            # The server's hello arrives before it has read ours; then it hangs up on us.
            channel = await secure_handshake(stream, cheat, hello, initiator=True, timeout=5)
            with trio.fail_after(5), pytest.raises((trio.EndOfChannel, trio.BrokenResourceError)):
                await channel.receive_record()
            await channel.aclose()
            assert server.connected_peers == []
    # A solved nonce is let in, and the dialer knows the remote's verified node ID.
    async with (
        open_peer_host(Identity.generate(), node_id_difficulty=difficulty) as server,
        open_peer_host(Identity.generate(), listen=None, node_id_difficulty=difficulty) as client,
    ):
        connection = await client.connect(server.listen_address)
        assert client.remote_node_id(connection).node_id == server.node_id.node_id
        assert server.node_id.satisfies(difficulty)


def test_a_host_refuses_a_proof_that_is_not_its_own_or_too_weak():
    identity = Identity.generate()
    weak = NodeIDProof.solve(identity.peer_id, 2)
    with pytest.raises(ValueError, match="not a solution"):
        PeerHost(identity, None, node_id=weak, node_id_difficulty=weak.work_bits + 1)
    foreign = NodeIDProof.solve(Identity.generate().peer_id, 2)
    with pytest.raises(ValueError, match="not a solution"):
        PeerHost(identity, None, node_id=foreign, node_id_difficulty=2)
