"""A peer host in a process of its own, for tests that stop (SIGSTOP) and kill (SIGKILL) a peer the
way an operating system does: its sockets then stop being read, and are closed by the kernel, with
no goodbye from peerd's code. In-process peers cannot show this: cancelling one closes its
connections in an orderly way.

Run as ``python -m tests.support.remote_peer``: prints its address (``HOST:PORT/PEERID``) on one line and
serves until killed. Its methods: ``sink`` reads a stream to its end, ``echo`` answers a unary
call with its body.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from peer import Identity, PeerAddress, Router, open_peer_host

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 30.0  # importing torch and friends on a loaded 2-core machine


async def _serve() -> None:
    router = Router()

    @router.stream("sink")
    async def sink(stream) -> None:
        async for _ in stream:
            pass

    @router.unary("echo")
    async def echo(request):
        return request.body

    async with open_peer_host(Identity.generate(), router=router) as host:
        print(host.listen_address, flush=True)
        await trio.sleep_forever()


class RemotePeer:
    def __init__(self, process: trio.Process, address: PeerAddress):
        self.process = process
        self.address = address

    def stop(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)


@asynccontextmanager
async def remote_peer() -> AsyncIterator[RemotePeer]:
    """Start a remote peer; it is killed and reaped when the block ends, whatever happened."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.support.remote_peer"], cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(START_TIMEOUT):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some()
                if not chunk:
                    raise RuntimeError(f"the remote peer exited ({await process.wait()}) before starting")
                line += chunk
        yield RemotePeer(process, PeerAddress.parse(line.decode().strip()))
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()


if __name__ == "__main__":
    trio.run(_serve)
