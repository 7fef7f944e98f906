"""The status port: ``/status`` (JSON), ``/metrics`` (Prometheus) and the dashboard, over HTTP/1.1.

h11 owns the protocol (parsing, keep-alive, framing, HTTP/1.0 clients); this module owns the
sockets and the limits. The port binds 127.0.0.1 unless the user asks otherwise, but any local
process can connect to it, so whatever a client can make the peer hold is bounded: the request
head (``MAX_REQUEST_HEAD``), request bodies (refused: every page is a GET), the time a request may
take to arrive and a response to be taken (``REQUEST_TIMEOUT``, ``SEND_TIMEOUT``), and the number
of open connections (``status_seats.py``: a newcomer displaces the connection that has waited
longest for a request, remote hosts are capped per address and never take the places kept for
loopback clients, and only when every place it could take is being answered is it told 503). A slow
or hostile client can at most keep the port busy, never keep a local `peerd status` out, grow the
peer's memory or stall training.

A web page the user visits could point its own domain at the peer's address ("DNS rebinding") and
read the peer's pages from the user's browser; so the port refuses (403) requests whose ``Host``
could be such a domain. Bound to a loopback address it answers only loopback names; bound to
another or the wildcard address (Docker, ``--status-host 0.0.0.0``), it also answers IP literals
and single-label names (a compose service name, a host's short name), never a dotted domain name.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus

import h11
import trio

from .status_seats import LOCAL_RESERVED, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS, Seat, StatusSeats

__all__ = ["HttpLimits", "Page", "serve_http", "fetch_status"]

log = logging.getLogger("peerd.status")

# A browser's GET with its cookies and accept headers is 1-2 KiB; 8 KiB is Apache's default limit
# per request line and header (h11's own default is 16 KiB, node.js's too).
MAX_REQUEST_HEAD = 8 * 1024
# The whole request head must arrive within this of the connection opening or of the previous
# response (a keep-alive connection idles at most this long). The dashboard polls every 2 s, so
# its connection stays open; a client trickling a byte a second is cut off.
REQUEST_TIMEOUT = 10.0
SEND_TIMEOUT = 10.0  # a client that does not read its response is not waited for
RECEIVE_SIZE = 4096
# After an error answer, what a client still sends is read and dropped before closing (see _linger).
LINGER_TIMEOUT = 1.0
LINGER_BYTES = 64 * 1024
# A connection refused for want of room gets its 503 and much less time: a flood of them must not
# pile up.
BUSY_LINGER_TIMEOUT = 0.2
# `peerd status` and `peerd swarm` read pages of peers they were pointed at; a status page is a
# few KiB, a dashboard's history a few hundred.
MAX_RESPONSE = 8 * 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """The bounds above, as one value (tests shrink them)."""

    max_request_head: int = MAX_REQUEST_HEAD
    request_timeout: float = REQUEST_TIMEOUT
    send_timeout: float = SEND_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    local_reserved: int = LOCAL_RESERVED
    max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS


@dataclass(frozen=True)
class Page:
    """One response body and its type."""

    content_type: str
    body: bytes
    cache: bool = False  # static assets may be cached; live data never

    @classmethod
    def text(cls, content_type: str, text: str, cache: bool = False) -> Page:
        return cls(content_type, text.encode(), cache)


Route = Callable[[], Page]


async def serve_http(
    port: int,
    routes: Mapping[str, Route],
    *,
    host: str = "127.0.0.1",
    limits: HttpLimits = HttpLimits(),
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``routes`` (path -> a function that makes the page) on ``host:port`` until cancelled;
    ``task_status.started`` gets the bound port. A failing route is a 500, never a dead server."""
    seats = StatusSeats(limits.max_connections, limits.local_reserved, limits.max_connections_per_address)
    host_allowed = _is_loopback if _is_loopback(host) else _is_not_a_domain

    async def handler(stream: trio.SocketStream) -> None:
        try:
            scope = trio.CancelScope()  # cancelled if a newcomer displaces this connection
            seat = seats.admit(stream.socket.getpeername()[0], scope)
            if seat is None:
                await _refuse_busy(stream)
                return
            try:
                with scope:
                    await _serve_connection(stream, routes, limits, host_allowed, seats, seat)
            finally:
                seats.release(seat)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
            pass
        except Exception:  # a bug (e.g. a page h11 refuses to send) costs this connection, not the server
            log.exception("status connection failed")
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


async def _refuse_busy(stream: trio.SocketStream) -> None:
    """A fixed 503, written without reading the request (h11 answers only requests it has read)."""
    body = b"too many open connections to this status port\n"
    head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    with trio.move_on_after(BUSY_LINGER_TIMEOUT):
        await stream.send_all(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await _linger(stream)


async def _serve_connection(
    stream: trio.SocketStream,
    routes: Mapping[str, Route],
    limits: HttpLimits,
    host_allowed: Callable[[str], bool],
    seats: StatusSeats,
    seat: Seat,
) -> None:
    """Answer requests until the client is done; ``seats`` hears when the connection waits for a
    request (and may be displaced) and when it is being answered (and may not)."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_request_head)
    while True:
        try:
            with trio.move_on_after(limits.request_timeout):
                request = await _next_event(stream, connection)
                if isinstance(request, h11.Request) and _has_body(request):
                    await _send(stream, connection, limits, request, _error(413, "requests carry no body"), close=True)
                    return
                if isinstance(request, h11.Request):
                    while not isinstance(await _next_event(stream, connection), h11.EndOfMessage):
                        pass  # (no body: only the end of the message is left)
            if connection.their_state not in (h11.DONE, h11.MUST_CLOSE):
                return  # timed out, or the client closed its side
            seats.answering(seat)
        except h11.RemoteProtocolError as error:
            seats.answering(seat)
            if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                page = _error(error.error_status_hint, f"bad request: {error}")
                await _send(stream, connection, limits, None, page, close=True)
            return
        assert isinstance(request, h11.Request)
        if not _addressed_to(request, host_allowed):
            answer = _error(403, "this status port answers requests for its IP address or localhost only")
        else:
            answer = _route(request, routes)
        await _send(stream, connection, limits, request, answer)
        if connection.our_state is not h11.DONE:
            return  # MUST_CLOSE: an HTTP/1.0 client, or one that asked to close
        connection.start_next_cycle()
        seats.waiting(seat)


async def _next_event(stream: trio.SocketStream, connection: h11.Connection):
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(await stream.receive_some(RECEIVE_SIZE))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_not_a_domain(host: str) -> bool:
    """An IP literal or a single-label name: nothing a web page's own domain can rebind."""
    if "." not in host:
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _addressed_to(request: h11.Request, host_allowed: Callable[[str], bool]) -> bool:
    """The request's ``Host`` is one ``host_allowed`` accepts (or is absent: an HTTP/1.0 client;
    browsers always send one)."""
    for name, value in request.headers:
        if name == b"host":
            text = value.decode("ascii", errors="replace")
            if text.startswith("["):
                hostname = text[1:].split("]", 1)[0]
            else:
                hostname = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
            return host_allowed(hostname.lower())
    return True


def _has_body(request: h11.Request) -> bool:
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _route(request: h11.Request, routes: Mapping[str, Route]) -> tuple[int, Page]:
    if request.method not in (b"GET", b"HEAD"):
        return _error(405, "only GET and HEAD")
    path = request.target.split(b"?", 1)[0].decode("ascii", errors="replace")
    route = routes.get(path)
    if route is None:
        return _error(404, f"no page {path}; try / (the dashboard), /status or /metrics")
    try:
        page = route()
        if not isinstance(page, Page):
            raise TypeError(f"the route made {type(page).__name__}, not a Page")
        return 200, page
    except Exception:  # a bug behind one page must not take the server (or the peer) down
        log.exception("status page %s failed", path)
        return _error(500, "this page failed; the peer's log says why")


def _error(status: int, message: str) -> tuple[int, Page]:
    return status, Page.text("text/plain; charset=utf-8", message + "\n")


async def _send(
    stream: trio.SocketStream,
    connection: h11.Connection,
    limits: HttpLimits,
    request: h11.Request | None,
    answer: tuple[int, Page],
    *,
    close: bool = False,
) -> None:
    status, page = answer
    headers = [
        ("Content-Type", page.content_type),
        ("Content-Length", str(len(page.body))),
        ("Cache-Control", "max-age=60" if page.cache else "no-store"),
        ("X-Content-Type-Options", "nosniff"),
    ]
    if close:
        headers.append(("Connection", "close"))
    data = connection.send(h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase))
    if request is None or request.method != b"HEAD":
        data += connection.send(h11.Data(data=page.body))
    data += connection.send(h11.EndOfMessage())
    with trio.fail_after(limits.send_timeout):
        await stream.send_all(data)
    if close:
        await _linger(stream)


async def _linger(stream: trio.SocketStream) -> None:
    """Close after an error answer without losing it: closing a socket with unread input sends a
    reset, which can reach the client before it reads the answer. So stop sending, and read and
    drop what the client still sends, for a bounded time and amount."""
    await stream.send_eof()
    dropped = 0
    with trio.move_on_after(LINGER_TIMEOUT):
        while dropped < LINGER_BYTES and (chunk := await stream.receive_some(RECEIVE_SIZE)):
            dropped += len(chunk)


def fetch_status(port: int, host: str = "127.0.0.1", path: str = "/status", timeout: float = 5.0) -> str:
    """A blocking GET for the ``peerd status`` command and health checks: the body of a 200 answer,
    else OSError (also for a refused connection, a timeout or an answer that is not HTTP)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read(MAX_RESPONSE + 1)
    except http.client.HTTPException as error:
        raise OSError(f"status endpoint answered something else than HTTP ({error!r})") from None
    finally:
        connection.close()
    if response.status != 200:
        raise OSError(f"status endpoint answered {response.status} {response.reason}")
    if len(body) > MAX_RESPONSE:
        raise OSError(f"status endpoint answered more than {MAX_RESPONSE} bytes")
    return body.decode()
