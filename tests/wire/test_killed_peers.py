"""Peers killed by the operating system, not shut down: a process stopped (SIGSTOP) and then
killed (SIGKILL) reads nothing more and says no goodbye; the kernel closes its sockets. Whoever
was sending to it must learn so at once, not at some deadline of their own."""

from __future__ import annotations

import trio

from peer import ConnectionLost, Identity, open_peer_host
from peer.rpc_protocol import STREAM_WINDOW
from tests.support.remote_peer import remote_peer

# The target for noticing a dead peer once its process has died.
NOTICE_DEAD_PEER = 0.5


async def test_a_send_blocked_on_a_stopped_peer_fails_at_once_when_it_is_killed():
    chunk = bytes(1 << 20)
    sent = 0
    failed = trio.Event()
    failed_at = 0.0

    async def send_until_it_fails(stream) -> None:
        nonlocal sent, failed_at
        try:
            while True:
                await stream.send(None, chunk)
                sent += 1
        except ConnectionLost:
            failed_at = trio.current_time()
            failed.set()

    async with remote_peer() as remote, open_peer_host(Identity.generate(), listen=None) as host:
        connection = await host.connect(remote.address)
        async with connection.stream("sink", timeout=60) as stream, trio.open_nursery() as nursery:
            await stream.send(None, chunk)  # the handler is running: credit is not what stops us
            remote.stop()
            nursery.start_soon(send_until_it_fails, stream)
            while True:  # until the socket is full: a send that makes no progress for a while
                before = sent
                await trio.sleep(0.5)
                if sent == before:
                    break
            # Stuck in the writer (socket buffers full), well before the credit window runs out.
            assert sent < STREAM_WINDOW // len(chunk) - 1
            remote.kill()
            killed_at = trio.current_time()
            with trio.fail_after(5):
                await failed.wait()
            assert failed_at - killed_at < NOTICE_DEAD_PEER


async def test_a_payload_cut_off_mid_write_fails_its_send_rather_than_returning():
    """The writer is inside one large payload when the peer dies: that send must raise, not return
    as if the payload had gone out (its sender was woken before the connection's error was set)."""
    payload = bytes(12 << 20)  # within the credit window, far beyond the socket buffers
    outcome: list[str] = []

    async with remote_peer() as remote, open_peer_host(Identity.generate(), listen=None) as host:
        connection = await host.connect(remote.address)
        async with connection.stream("sink", timeout=60) as stream, trio.open_nursery() as nursery:
            await stream.send(None, bytes(1024))  # the handler is running
            remote.stop()

            async def send_once() -> None:
                try:
                    await stream.send(None, payload)
                    outcome.append("returned")
                except ConnectionLost:
                    outcome.append("raised")

            nursery.start_soon(send_once)
            await trio.sleep(1.0)  # the writer fills the socket and blocks inside the payload
            assert outcome == []
            remote.kill()
            with trio.fail_after(5):
                while not outcome:
                    await trio.sleep(0.01)
    assert outcome == ["raised"]
