"""The transport seam of a host (``peer/transport.py``): what every user gets is TCP, and nothing
a user runs reaches the simulated network."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import trio

from dht import DHTNode
from peer import SYSTEM_CLOCK, Identity, Message, Router, TcpTransport, open_peer_host


def echo_router() -> Router:
    router = Router()

    async def echo(request):
        return Message(request.body)

    router.add_unary("echo", echo)
    return router


async def test_a_default_host_dials_and_listens_over_tcp():
    async with open_peer_host(Identity.generate(), router=echo_router()) as server:
        async with open_peer_host(Identity.generate(), listen=None) as client:
            assert type(server.transport) is TcpTransport
            assert type(client.transport) is TcpTransport
            connection = await client.connect(server.listen_address)
            assert (await connection.call("echo", 7)).body == 7
            # the raw-socket paths of SecureChannel need a real socket stream under the channel
            assert isinstance(connection.channel.stream, trio.SocketStream)
            assert connection.channel.can_send_now


async def test_a_default_dht_node_runs_on_tcp_and_the_system_clock():
    async with DHTNode.open() as node:
        assert type(node.host.transport) is TcpTransport
        assert node.clock is SYSTEM_CLOCK
        assert abs(node.storage.clock() - time.time()) < 60  # records live by the time of day


def test_peerd_and_the_library_never_import_the_simulated_network():
    code = (
        "import sys, peer, dht, averaging, moe, peerd.cli, peerd.daemon\n"
        "loaded = [name for name in sys.modules if name.startswith('peer.simnet')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])
