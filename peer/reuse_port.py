"""Sockets that share the listen port: a listener, and outgoing connections bound to its port.

Hole punching (``peer/holepunch.py``) dials from the port we listen on, so that a port-preserving
NAT maps the dial to the same public port the other peer was told about, and so that both peers'
dials meet as one TCP connection (simultaneous open). Linux lets a connecting socket bind a port
a listener holds only if both set ``SO_REUSEPORT``. A listener with ``SO_REUSEPORT`` would let a
second process of the same user bind the same port unnoticed, so ``open_listeners`` first binds
a plain probe socket: a port in use still fails with EADDRINUSE, as it did without the option.
"""

from __future__ import annotations

import errno
import socket as stdlib_socket

import trio

__all__ = ["open_listeners", "connect_from", "REUSE_PORT"]

REUSE_PORT = hasattr(stdlib_socket, "SO_REUSEPORT")
BACKLOG = 1024


def _reusable(family: int) -> trio.socket.SocketType:
    sock = trio.socket.socket(family, stdlib_socket.SOCK_STREAM)
    sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
    if REUSE_PORT:
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEPORT, 1)
    return sock


async def open_listeners(host: str, port: int) -> list[trio.SocketListener]:
    """Listeners on ``host:port`` (every address it resolves to) whose port outgoing sockets may
    share. Raises OSError (EADDRINUSE when the port is taken) like ``trio.open_tcp_listeners``."""
    infos = await trio.socket.getaddrinfo(host, port, type=stdlib_socket.SOCK_STREAM, flags=stdlib_socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    seen = set()
    try:
        for family, _, _, _, sockaddr in infos:
            if (family, sockaddr) in seen:
                continue
            seen.add((family, sockaddr))
            if port == 0 and listeners:  # the first bind picked the port; the others share it
                sockaddr = (sockaddr[0], listeners[0].socket.getsockname()[1], *sockaddr[2:])
            if sockaddr[1] != 0:
                probe = trio.socket.socket(family, stdlib_socket.SOCK_STREAM)
                with probe:
                    probe.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
                    if family == stdlib_socket.AF_INET6:
                        probe.setsockopt(stdlib_socket.IPPROTO_IPV6, stdlib_socket.IPV6_V6ONLY, 1)
                    await probe.bind(sockaddr)  # EADDRINUSE if another listener has the port
            sock = _reusable(family)
            if family == stdlib_socket.AF_INET6:
                sock.setsockopt(stdlib_socket.IPPROTO_IPV6, stdlib_socket.IPV6_V6ONLY, 1)
            try:
                await sock.bind(sockaddr)
                sock.listen(BACKLOG)
            except OSError:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except OSError:
        for listener in listeners:
            listener.socket.close()
        raise
    if not listeners:
        raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host}:{port}")
    return listeners


async def connect_from(local: tuple[str, int], remote: tuple[str, int], timeout: float) -> trio.SocketStream:
    """A TCP connection from ``local`` (our listen address) to ``remote``; OSError or
    trio.TooSlowError when it does not connect within ``timeout``."""
    family = stdlib_socket.AF_INET6 if ":" in remote[0] else stdlib_socket.AF_INET
    sock = _reusable(family)
    try:
        await sock.bind(local)
        with trio.fail_after(timeout):
            await sock.connect(remote)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)
