"""Turning "address already in use" into one line that names the port and the flag to change.

A bind failure surfaces from inside trio nurseries as an exception group around an ``OSError``;
``naming_port`` wraps the block that binds and raises ``PortInUseError`` instead, which the runner
prints without a traceback and maps to ``EXIT_IN_USE``.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from .exception_groups import find_exception

__all__ = ["PortInUseError", "check_port_free", "naming_port"]


class PortInUseError(Exception):
    """Another process already listens on a port this command was told to bind."""

    def __init__(self, role: str, host: str, port: int, flag: str):
        self.role, self.host, self.port, self.flag = role, host, port, flag
        super().__init__(
            f"{role} port {host}:{port} is already in use (another peerd on this machine?); stop that"
            f" process or choose another port with {flag} (0 = any free port)"
        )


@contextmanager
def naming_port(role: str, host: str, port: int, flag: str) -> Iterator[None]:
    """Raise ``PortInUseError(role, host, port, flag)`` if the block fails with EADDRINUSE."""
    try:
        yield
    except BaseException as error:
        in_use = find_exception(error, OSError, lambda e: e.errno == errno.EADDRINUSE)
        if in_use is not None:
            raise PortInUseError(role, host, port, flag) from None
        raise


def check_port_free(role: str, host: str, port: int, flag: str) -> None:
    """Raise ``PortInUseError`` now if ``host:port`` is held by a listener, so that a command
    that binds it only after slow work (the node-ID puzzle: seconds to minutes) fails before that
    work. A probe, bound and closed at once: the real bind still names the port if the port is
    taken in between. Port 0 (any free port) is always free."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # the real bind reports a host that does not resolve
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise PortInUseError(role, host, port, flag) from None
