"""Socket options for peer connections.

BBR, the congestion control many distributions and clouds now default to, paces every flow with
high-resolution timers. Across the internet that is what makes it good; over loopback, where there
is no bottleneck to probe and no queue to keep short, it is pure cost: on the 2-core development
machine a loopback sender paid ~0.1 CPU-s per GB more under BBR than under CUBIC and moved data
~1.5x slower (measured with plain blocking sockets, no peerd code involved). Peers on the same host
(one per GPU, a local swarm, tests) therefore switch their loopback connections to a non-pacing
algorithm; every other connection keeps the system's choice.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import sys

__all__ = ["tune_connection", "is_loopback_peer", "set_pacing_rate"]

log = logging.getLogger("peerd.host")

_PACING = (b"bbr", b"bbr2", b"bbr3")
# CUBIC is the Linux default; Reno is the fallback every unprivileged process may choose.
_LOCAL_CHOICES = (b"cubic", b"reno")


def is_loopback_peer(sock) -> bool:
    try:
        host = sock.getpeername()[0]
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except (OSError, ValueError, IndexError, TypeError):
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def tune_connection(stream) -> str | None:
    """Apply our socket options to a freshly connected or accepted trio ``SocketStream``; returns
    the congestion control it switched to, if it did (anything else is left as it was)."""
    sock = getattr(stream, "socket", None)
    option = getattr(socket, "TCP_CONGESTION", None)
    if sock is not None and not is_loopback_peer(sock):
        _limit_unsent(sock)
    if sock is None or option is None or not is_loopback_peer(sock):
        return None
    try:
        current = sock.getsockopt(socket.IPPROTO_TCP, option, 16).rstrip(b"\0")
    except OSError:
        return None
    if current not in _PACING:
        return None
    for name in _LOCAL_CHOICES:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, name)
            return name.decode()
        except OSError:  # not built into this kernel, or not allowed for this user
            continue
    log.debug("could not switch a loopback connection away from %s", current.decode())
    return None


# Unsent bytes a connection may leave in the kernel's send buffer. The kernel grows a send buffer
# to megabytes (4 MiB by default), and on a slow uplink shared by several connections that is
# seconds of queue: an all-reduce reply written behind it reaches its sender seconds after it
# was made, and the averages stop flowing back while parts still go out. With this bound the
# queue stays in the connection's own message queue, where replies and parts of different streams
# take turns, while the kernel still keeps every byte its congestion window allows in flight
# (only bytes not yet sent count). 256 KiB is ~20 ms at 100 Mbit/s, and still 2 ms at 1 Gbit/s,
# more than the event loop needs to refill it. Loopback connections keep the default: there the
# extra wakeups would cost CPU and there is no slow link to share.
UNSENT_LIMIT = 256 * 1024


def _limit_unsent(sock) -> None:
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # (Linux's number; Python names it from 3.12 on)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_LIMIT)
    except OSError:  # not supported by this kernel
        log.debug("could not limit the unsent bytes of a connection")


# Linux's SO_MAX_PACING_RATE: a cap, in bytes per second, on how fast the kernel sends on a
# socket (TCP paces itself to it, no qdisc needed). ~0 lifts the cap.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
_NO_CAP = 2**64 - 1


def set_pacing_rate(sock, bytes_per_s: float | None) -> bool:
    """Cap the rate the kernel sends at on ``sock`` (None: no cap). False where the system has no
    such cap (not Linux) or refused it: the socket then sends as fast as TCP lets it, as before."""
    if not sys.platform.startswith("linux"):
        return False
    # (a rate past what the kernel can hold is no cap at all; NaN, no rate, is none either)
    fits = bytes_per_s is not None and bytes_per_s < _NO_CAP
    value = max(1, int(bytes_per_s)) if fits else _NO_CAP
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("Q", value))
    except OSError:
        return False
    return True
