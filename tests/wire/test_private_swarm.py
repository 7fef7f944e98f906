"""Private swarms: an allowlist of peer IDs and a shared swarm key, both enforced at the handshake.

Without them anyone who can reach a peer joins its swarm. A refused peer is told why on its side;
the key never crosses the wire. ``peerd join --allow-peers/--swarm-key`` read their files through
``peerd/private_swarm.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import subprocess
import sys
from functools import partial

import pytest
import trio

from peer import ConnectError, Identity, PeerAddress, SwarmAccess, open_peer_host
from peer.secure_channel import PROLOGUE

KEY = b"k" * 8 + bytes(range(24))


async def test_a_peer_off_the_allowlist_is_refused_and_told_why() -> None:
    server_id, friend, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    access = SwarmAccess.of([friend.peer_id])
    async with open_peer_host(server_id, access=access) as server:
        async with open_peer_host(stranger, listen=None) as outsider:
            with pytest.raises(ConnectError, match=f"refused.*{stranger.peer_id} is not on this private swarm's"):
                await outsider.connect(server.listen_address)
        async with open_peer_host(friend, listen=None, access=SwarmAccess.of([server_id.peer_id])) as member:
            connection = await member.connect(server.listen_address)
            assert connection.remote_peer_id == server_id.peer_id
        # The allowlist applies to whom we dial, too.
        async with open_peer_host(stranger) as other, open_peer_host(friend, listen=None, access=access) as member:
            with pytest.raises(ConnectError, match=f"refused peer {stranger.peer_id}"):
                await member.connect(other.listen_address)


async def test_only_peers_holding_the_swarm_key_connect() -> None:
    async with open_peer_host(Identity.generate(), access=SwarmAccess(swarm_key=KEY)) as server:
        async with open_peer_host(Identity.generate(), listen=None, access=SwarmAccess(swarm_key=KEY)) as member:
            assert (await member.connect(server.listen_address)).remote_peer_id == server.peer_id
        async with open_peer_host(Identity.generate(), listen=None) as outsider:
            with pytest.raises(ConnectError, match="private swarm that needs a swarm key"):
                await outsider.connect(server.listen_address)
        wrong = SwarmAccess(swarm_key=b"w" * 32)
        async with open_peer_host(Identity.generate(), listen=None, access=wrong) as outsider:
            with pytest.raises(ConnectError, match="may not hold this swarm's key"):
                await outsider.connect(server.listen_address)


async def test_the_swarm_key_never_crosses_the_wire() -> None:
    recorded = bytearray()
    async with open_peer_host(Identity.generate(), access=SwarmAccess(swarm_key=KEY)) as server:
        target = server.listen_address

        async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
            try:
                while data := await source.receive_some(65536):
                    recorded.extend(data)
                    await sink.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async def relay(client: trio.SocketStream) -> None:
            upstream = await trio.open_tcp_stream(target.host, target.port)
            async with trio.open_nursery() as both:
                both.start_soon(pump, client, upstream)
                both.start_soon(pump, upstream, client)

        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(partial(trio.serve_tcp, relay, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            async with open_peer_host(Identity.generate(), listen=None, access=SwarmAccess(swarm_key=KEY)) as member:
                connection = await member.connect(PeerAddress("127.0.0.1", port))
                assert connection.remote_peer_id == server.peer_id
            nursery.cancel_scope.cancel()
    assert len(recorded) > 200  # the whole handshake and hellos went through the relay
    for secret in (KEY, KEY[:16], hmac.new(KEY, PROLOGUE, hashlib.sha256).digest()):
        assert secret not in recorded


def test_join_refuses_a_bad_allowlist_or_short_key_with_one_line(tmp_path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text(f"{Identity.generate().peer_id}\nnot-a-peer-id\n")
    short = tmp_path / "swarm.key"
    short.write_bytes(b"short")
    for flags, expected in (
        (["--allow-peers", str(allow)], "allow.txt:2: not a peer ID"),
        (["--swarm-key", str(short)], "at least 16 bytes"),
        (["--swarm-key", str(tmp_path / "missing.key")], "cannot read"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "peerd", "join", "--identity", str(tmp_path / "id.key"), *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
