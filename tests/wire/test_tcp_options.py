"""Loopback connections leave pacing congestion control (BBR); other connections keep theirs."""

from __future__ import annotations

import socket

import pytest
import trio

from peer.tcp_options import is_loopback_peer, tune_connection

TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


class FakeSocket:
    def __init__(self, peer: str, congestion: bytes, allowed: tuple[bytes, ...] = (b"cubic", b"reno")):
        self.peer, self.congestion, self.allowed = peer, congestion, allowed

    def getpeername(self):
        return (self.peer, 4242)

    def getsockopt(self, level, option, size):
        assert (level, option) == (socket.IPPROTO_TCP, TCP_CONGESTION)
        return self.congestion + b"\0" * (size - len(self.congestion))

    def setsockopt(self, level, option, value):
        if value not in self.allowed:
            raise PermissionError("not allowed")
        self.congestion = value


class FakeStream:
    def __init__(self, sock):
        self.socket = sock


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"])
def test_loopback_bbr_connections_switch_to_a_non_pacing_algorithm(peer):
    sock = FakeSocket(peer, b"bbr")
    assert tune_connection(FakeStream(sock)) == "cubic" and sock.congestion == b"cubic"
    restricted = FakeSocket(peer, b"bbr", allowed=(b"reno",))  # an unprivileged user without cubic
    assert tune_connection(FakeStream(restricted)) == "reno" and restricted.congestion == b"reno"


@pytest.mark.parametrize(
    ("peer", "congestion"), [("10.1.2.3", b"bbr"), ("2001:db8::1", b"bbr"), ("127.0.0.1", b"cubic")]
)
def test_other_connections_keep_the_systems_choice(peer, congestion):
    sock = FakeSocket(peer, congestion)
    assert tune_connection(FakeStream(sock)) is None and sock.congestion == congestion


def test_nothing_breaks_when_no_algorithm_may_be_chosen():
    sock = FakeSocket("127.0.0.1", b"bbr", allowed=())
    assert tune_connection(FakeStream(sock)) is None and sock.congestion == b"bbr"
    assert tune_connection(object()) is None  # not a socket stream (e.g. an in-memory test stream)


async def test_a_real_loopback_connection_ends_up_without_bbr():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with listeners[0], await trio.open_tcp_stream("127.0.0.1", port) as stream:
        assert is_loopback_peer(stream.socket)
        try:  # start from BBR where this kernel has it, so that there is something to change
            stream.socket.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, b"bbr")
        except OSError:
            pass
        tune_connection(stream)
        assert stream.socket.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).rstrip(b"\0") != b"bbr"
