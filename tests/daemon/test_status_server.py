"""The status port's HTTP layer: pages by path, keep-alive and HTTP/1.0 clients, and the bounds a
hostile local client meets (head size, bodies, slow requests, the connection cap); and
``--status-host`` binding what it is given."""

from __future__ import annotations

import json
import socket

import pytest
import trio

from peerd.status_seats import MAX_CONNECTIONS
from peerd.status_server import HttpLimits, Page, fetch_status, serve_http
from tests.support.processes import PeerdProcess

ROUTES = {
    "/status": lambda: Page.text("application/json", json.dumps({"epoch": 3})),
    "/broken": lambda: 1 / 0,
}


async def exchange(port: int, request: bytes, *, until_closed: bool = True) -> bytes:
    """Send ``request`` and read until the server closes (or the first full response)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                data += chunk
                if not until_closed and b"\r\n\r\n" in data:
                    break
        return data


async def start(nursery: trio.Nursery, limits: HttpLimits | None = None) -> int:
    limits = limits or HttpLimits()
    return await nursery.start(lambda task_status: serve_http(0, ROUTES, limits=limits, task_status=task_status))


async def test_pages_for_http10_and_keepalive_http11_clients():
    async with trio.open_nursery() as nursery:
        port = await start(nursery)
        old = await exchange(port, b"GET /status HTTP/1.0\r\n\r\n")  # netlab and the benchmarks ask so
        assert old.startswith(b"HTTP/1.1 200 ") and old.endswith(b'{"epoch": 3}')
        assert b"content-type: application/json" in old.lower()

        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:  # two requests on one connection, as a polling browser does
            for _ in range(2):
                await stream.send_all(b"GET /status?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                data = b""
                with trio.fail_after(5):
                    while not data.endswith(b'{"epoch": 3}'):
                        data += await stream.receive_some(65536)
                assert data.startswith(b"HTTP/1.1 200 ")

        assert (await exchange(port, b"GET /nope HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 404 ")
        assert (await exchange(port, b"DELETE /status HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 405 ")
        head = await exchange(port, b"HEAD /status HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        # a page that raises is a 500, and the server goes on serving
        assert (await exchange(port, b"GET /broken HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 500 ")
        assert json.loads(await trio.to_thread.run_sync(fetch_status, port)) == {"epoch": 3}
        nursery.cancel_scope.cancel()


async def test_oversized_heads_bodies_and_garbage_are_refused_and_closed():
    async with trio.open_nursery() as nursery:
        port = await start(nursery, HttpLimits(max_request_head=1024))
        huge = b"GET /status HTTP/1.1\r\nHost: a\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n"
        assert (await exchange(port, huge)).startswith(b"HTTP/1.1 431 ")
        body = b"POST /status HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\n"
        assert (await exchange(port, body)).startswith(b"HTTP/1.1 413 ")
        chunked = b"GET /status HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        assert (await exchange(port, chunked)).startswith(b"HTTP/1.1 413 ")
        assert (await exchange(port, b"\x16\x03\x01 not http\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        nursery.cancel_scope.cancel()


async def test_a_slow_client_is_cut_off_and_a_newcomer_displaces_the_oldest_waiter():
    limits = HttpLimits(request_timeout=0.5, max_connections=3, local_reserved=1)
    async with trio.open_nursery() as nursery:
        port = await start(nursery, limits)
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        await idle[0].send_all(b"GET /status HTTP/1.1\r\n")  # a head that never ends
        with trio.fail_after(5):
            # All places wait for a request: the newcomer takes the one that has waited longest.
            assert (await exchange(port, b"GET /status HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        with trio.fail_after(5):  # the server closes all three: one displaced, two after request_timeout
            for stream in idle:
                assert await _closed_by_server(stream)
                await stream.aclose()
        assert (await exchange(port, b"GET /status HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        nursery.cancel_scope.cancel()


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(100) == b""
    except trio.BrokenResourceError:  # (a reset says the same)
        return True


async def _get_on(stream: trio.SocketStream) -> bytes:
    """One keep-alive request on an open connection, and its whole answer."""
    await stream.send_all(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while not data.endswith(b'{"epoch": 3}'):
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return data


async def test_idle_connections_from_this_machine_cannot_keep_peerd_status_out():
    """Twice the cap in idle connections from 127.0.0.1 (the address every local client shares),
    held open: the oldest waiters make room, and `peerd status` gets its 200."""
    async with trio.open_nursery() as nursery:
        port = await start(nursery)
        with trio.fail_after(10):
            silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(MAX_CONNECTIONS // 2)]
            await silent[0].send_all(b"GET /status HTTP/1.1\r\n")  # a head that never ends
            idle = []  # keep-alive connections, each answered once (so seated in this order), then idle
            for _ in range(2 * MAX_CONNECTIONS):
                idle.append(await trio.open_tcp_stream("127.0.0.1", port))
                assert (await _get_on(idle[-1])).startswith(b"HTTP/1.1 200 ")
            assert json.loads(await trio.to_thread.run_sync(fetch_status, port)) == {"epoch": 3}
            # The cap held throughout: everything older than the newest MAX_CONNECTIONS - 1 was
            # displaced (the last of them by `peerd status` itself), and those still answer.
            kept = MAX_CONNECTIONS - 1
            for stream in silent + idle[:-kept]:
                assert await _closed_by_server(stream)
            for stream in idle[-kept:]:
                assert (await _get_on(stream)).startswith(b"HTTP/1.1 200 ")
        for stream in silent + idle:
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_loopback_port_answers_only_requests_addressed_to_loopback():
    """A page on evil.example whose name now resolves to 127.0.0.1 (DNS rebinding) gets nothing."""
    async with trio.open_nursery() as nursery:
        port = await start(nursery)
        for host in (b"127.0.0.1", b"localhost", b"127.0.0.1:%d" % port, b"[::1]:80", b"LOCALHOST:1"):
            answer = await exchange(port, b"GET /status HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 "), host
        rebound = b"GET /status HTTP/1.1\r\nHost: evil.example:%d\r\nConnection: close\r\n\r\n" % port
        assert (await exchange(port, rebound)).startswith(b"HTTP/1.1 403 ")
        nursery.cancel_scope.cancel()


async def test_a_port_bound_to_all_addresses_answers_ip_literals_and_short_names_but_no_domain():
    """Docker and ``--status-host 0.0.0.0``: a rebound domain name still gets nothing."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: serve_http(0, ROUTES, host="0.0.0.0", task_status=task_status))
        for host in (b"127.0.0.1", b"localhost:1", b"10.1.2.3:%d" % port, b"[fe80::1]", b"peer", b"bootstrap:8080"):
            answer = await exchange(port, b"GET /status HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 "), host
        for host in (b"evil.example", b"evil.example:8080", b"a.b.c.d.example."):
            answer = await exchange(port, b"GET /status HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 403 "), host
        nursery.cancel_scope.cancel()


async def test_a_page_h11_cannot_send_costs_its_connection_not_the_server():
    """A route whose page cannot go out as HTTP (a header value with a line break, a wrong type) is
    a bug behind one page: that connection closes, the server (in the peer's nursery) goes on."""
    routes = {
        **ROUTES,
        "/bad-header": lambda: Page("text/plain\r\nX-Injected: 1", b"x"),
        "/not-a-page": lambda: "a string",
    }
    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: serve_http(0, routes, task_status=task_status))
        for path in (b"/bad-header", b"/not-a-page"):
            answer = await exchange(port, b"GET " + path + b" HTTP/1.0\r\n\r\n")
            assert b"X-Injected" not in answer
            assert json.loads(await trio.to_thread.run_sync(fetch_status, port)) == {"epoch": 3}
        nursery.cancel_scope.cancel()


def test_fetch_status_says_what_answered():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.close()
        with pytest.raises(OSError):
            fetch_status(port, timeout=2)


def _answers(host: str, port: int) -> bool:
    try:
        json.loads(fetch_status(port, host=host, timeout=5))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("status_host", ["0.0.0.0", None])
def test_status_host_binds_what_it_is_given(tmp_path, status_host):
    """All of 127/8 is loopback: a socket bound to 0.0.0.0 answers at 127.0.0.2, one bound to
    127.0.0.1 (the default) does not."""
    args = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--status-port", "0"]
    if status_host is not None:
        args += ["--status-host", status_host]
    peer = PeerdProcess(args, tmp_path / "peer.log")
    try:
        peer.read_line(timeout=60)  # listening
        line = peer.read_line(timeout=60)
        assert line.startswith(f"peerd status on http://{status_host or '127.0.0.1'}:")
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        assert peer.read_line(timeout=10) == f"peerd dashboard on http://127.0.0.1:{port}/"
        assert _answers("127.0.0.1", port)
        assert _answers("127.0.0.2", port) is (status_host == "0.0.0.0")
    finally:
        peer.stop()
