"""How a host reaches other peers and is reached: the transport it dials and listens through.

``TcpTransport`` is the one every user gets: ``open_peer_host`` (and so ``peerd join``, the DHT and
the daemon) use it unless a caller passes another. It dials with ``trio.open_tcp_stream`` and
listens with ``peer/reuse_port.py``'s listeners, whose port punched dials share, and hands the
host plain ``trio.SocketStream``s, so that ``SecureChannel``'s raw-socket paths (``os.readv``
into the decoder, ``TCP_INFO``, pacing) and ``peer/tcp_options.py`` apply as they always do.

The other transport is ``peer/simnet``'s, for tests and benchmarks that run many real peers in
one process on a modelled internet. Nothing in the library picks it by itself.

A transport names the far end of a stream it produced (``remote_address``: where the peer is seen
from, which a dial-back answers with; ``remote_host``, for the fair limits per address group;
``remote_endpoint``, for logs), can look at an incoming stream's first byte without consuming it
(``peek_first_byte``: a relayed circuit's end starts with a marker byte), and dials from a port it
listens on (``connect_from``: hole punching's simultaneous open).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol

import trio

from .address import PeerAddress
from .connection_pool import ConnectError
from .reuse_port import connect_from, open_listeners

__all__ = ["Transport", "TcpTransport", "CONNECT_TIMEOUT"]

# Dialing: a peer that does not accept within 5 s on a LAN or across the internet is as good as dead.
CONNECT_TIMEOUT = 5.0


class Transport(Protocol):
    """What a host needs of the network it runs on."""

    async def listen(self, host: str, port: int) -> tuple[tuple[str, int], Sequence[trio.abc.Listener]]:
        """Listeners on ``host:port`` (port 0: any free one) and the endpoint they are bound to."""
        ...

    async def connect(self, address: PeerAddress) -> trio.abc.Stream:
        """A stream to ``address``'s endpoint; ``ConnectError`` (for this address alone) on failure,
        including no answer within the transport's connect deadline."""
        ...

    async def connect_from(self, local: tuple[str, int], remote: tuple[str, int], timeout: float) -> trio.abc.Stream:
        """A stream from ``local`` (a port we listen on) to ``remote``, for hole punching: raises
        ``ConnectionRefusedError`` when refused, ``OSError`` with ``EADDRINUSE`` or
        ``EADDRNOTAVAIL`` when a connection between the two endpoints exists already, other
        ``OSError``s, or ``trio.TooSlowError`` when nothing answers within ``timeout``."""
        ...

    def remote_address(self, stream: trio.abc.Stream) -> tuple[str, int] | None:
        """``(host, port)`` of the far end of ``stream`` as this machine sees it (None when it
        cannot tell)."""
        ...

    def remote_host(self, stream: trio.abc.Stream) -> str:
        """The host at the far end of ``stream`` ("?" when it cannot tell)."""
        ...

    def remote_endpoint(self, stream: trio.abc.Stream) -> str:
        """``HOST:PORT`` of the far end of ``stream`` ("?" when it cannot tell)."""
        ...

    async def peek_first_byte(self, stream: trio.abc.Stream) -> bytes:
        """The first byte ``stream`` will deliver, left in place (b"" when it ends first)."""
        ...


class TcpTransport:
    """Plain TCP: what ``open_peer_host`` uses by default, and the only transport of ``peerd``."""

    def __init__(self, *, connect_timeout: float = CONNECT_TIMEOUT):
        self.connect_timeout = connect_timeout

    async def listen(self, host: str, port: int) -> tuple[tuple[str, int], list[trio.SocketListener]]:
        listeners = await open_listeners(host, port)  # punched dials share their port
        sockname = listeners[0].socket.getsockname()
        return (sockname[0], sockname[1]), listeners

    async def connect(self, address: PeerAddress) -> trio.SocketStream:
        try:
            with trio.fail_after(self.connect_timeout):
                return await trio.open_tcp_stream(address.host, address.port)
        except trio.TooSlowError:
            raise ConnectError(f"{address}: no answer within {self.connect_timeout} s") from None
        except OSError as error:
            raise ConnectError(f"{address}: {_os_reason(error)}", refused=_refused(error)) from None
        except ValueError as error:  # a host name that cannot even be encoded (IDNA), from a contact
            raise ConnectError(f"{address}: not a usable host name ({error})") from None

    async def connect_from(self, local: tuple[str, int], remote: tuple[str, int], timeout: float) -> trio.SocketStream:
        return await connect_from(local, remote, timeout)

    def remote_address(self, stream: trio.SocketStream) -> tuple[str, int] | None:
        try:  # (a stream that wraps a socket shows none: a relayed circuit's end under a test's tap)
            host, port = stream.socket.getpeername()[:2]
            return str(host), int(port)
        except (AttributeError, OSError, TypeError, ValueError):  # (an address of another family)
            return None

    def remote_host(self, stream: trio.SocketStream) -> str:
        address = self.remote_address(stream)
        return "?" if address is None else address[0]

    def remote_endpoint(self, stream: trio.SocketStream) -> str:
        address = self.remote_address(stream)
        return "?" if address is None else f"{address[0]}:{address[1]}"

    async def peek_first_byte(self, stream: trio.SocketStream) -> bytes:
        return await stream.socket.recv(1, socket.MSG_PEEK)


def _os_reason(error: OSError) -> str:
    """The underlying reason ("Connection refused") rather than trio's "all attempts failed"."""
    cause = error.__cause__
    inner = getattr(cause, "exceptions", None) or ([cause] if cause is not None else [])
    for exception in inner:
        if isinstance(exception, OSError) and exception.strerror:
            return exception.strerror.lower()
    return (error.strerror or str(error)).lower()


def _refused(error: OSError) -> bool:
    """Whether every attempt behind ``error`` (trio tries each address of a name) was refused."""
    cause = error.__cause__
    inner = getattr(cause, "exceptions", None) or ([cause] if cause is not None else [error])
    return all(isinstance(exception, ConnectionRefusedError) for exception in inner)
