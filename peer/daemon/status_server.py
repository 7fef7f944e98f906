"""``/status`` (JSON) and ``/metrics`` (Prometheus text format) on a local HTTP port.

A deliberately tiny HTTP/1.0 responder: one GET per connection, a bounded request, a deadline.
It binds 127.0.0.1 by default; exposing it wider is the user's explicit choice.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["serve_status", "prometheus_text", "fetch_status"]

log = logging.getLogger("peerd.status")

MAX_REQUEST = 8192  # a GET line and a few headers; anything bigger is not a status probe
REQUEST_TIMEOUT = 5.0


def prometheus_text(metrics: dict[str, tuple[str, str, float | None]]) -> str:
    """``name -> (type, help, value)`` as Prometheus exposition text (None values are skipped)."""
    lines = []
    for name, (kind, help_text, value) in metrics.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
    return "\n".join(lines) + "\n"


async def _respond(stream: trio.SocketStream, get_status, get_metrics) -> None:
    request = b""
    with trio.move_on_after(REQUEST_TIMEOUT):
        while b"\r\n\r\n" not in request and b"\n\n" not in request and len(request) < MAX_REQUEST:
            chunk = await stream.receive_some(MAX_REQUEST)
            if not chunk:
                break
            request += chunk
    parts = request.split(b"\r\n", 1)[0].split()
    method, path = (parts[0], parts[1].split(b"?")[0]) if len(parts) >= 2 else (b"", b"")
    if method != b"GET":
        status, content_type, body = "405 Method Not Allowed", "text/plain", "only GET\n"
    elif path == b"/status":
        status, content_type, body = "200 OK", "application/json", json.dumps(get_status(), default=str) + "\n"
    elif path == b"/metrics":
        status, content_type, body = "200 OK", "text/plain; version=0.0.4", get_metrics()
    else:
        status, content_type, body = "404 Not Found", "text/plain", "try /status or /metrics\n"
    data = body.encode()
    head = f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n\r\n"
    await stream.send_all(head.encode() + data)


async def serve_status(
    port: int,
    get_status: Callable[[], dict[str, Any]],
    get_metrics: Callable[[], str],
    *,
    host: str = "127.0.0.1",
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        try:
            await _respond(stream, get_status, get_metrics)
        except (trio.BrokenResourceError, OSError):
            pass
        except Exception:  # a bug in a status getter must not take the peer down
            log.exception("status request failed")
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


def fetch_status(port: int, host: str = "127.0.0.1", path: str = "/status", timeout: float = 5.0) -> str:
    """A blocking GET for the ``peerd status`` command and health checks."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.0 200"):
        raise OSError(
            f"status endpoint answered {head.splitlines()[0].decode(errors='replace') if head else 'nothing'}"
        )
    return body.decode()
