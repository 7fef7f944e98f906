"""Who you are and what you speak: pinned identities, run IDs and protocol versions."""

from __future__ import annotations

import pytest
import trio

from peer import ConnectError, Identity, PeerAddress, Request, Router, UnknownMethodError, open_peer_host
from peer.secure_channel import PROTOCOL_VERSION


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
