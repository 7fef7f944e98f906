"""The ``peerd join`` children of ``peerd swarm``: started, watched, stopped, and never outliving
the launcher.

Each child runs in its own session, so a Ctrl-C in the terminal reaches only the launcher, which
then stops the children itself (SIGTERM, a deadline, SIGKILL) and prints its summary. For the
cases where the launcher cannot do that (SIGKILL, the OOM killer, a crash) each child asks the
Linux kernel to SIGKILL it when its parent dies (``peer/parent_death.py``, set between fork
and exec). That was chosen over a pipe each child watches because the kernel delivers it however
the parent dies and whatever the child is doing at the time (importing torch, solving its node-ID
puzzle, a long C call holding the GIL), without a watcher thread in every peer. The one race,
the parent dying between fork and ``prctl``, is closed by checking the parent's PID right after.
Elsewhere than Linux there is no such call, and a SIGKILLed launcher leaves its children running.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from peer.parent_death import available as parent_death_available
from peer.parent_death import die_with_parent

from .status_server import fetch_status

__all__ = ["SwarmPeer", "wait_started", "wait_claimed", "stop_all"]

STOP_TIMEOUT = 5.0  # a peer stops within 2 s of SIGTERM (README); then it is killed


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child SIGKILLed when ``parent_pid`` dies (Linux)."""
    return functools.partial(die_with_parent, parent_pid) if parent_death_available() else None


class SwarmPeer:
    """One ``peerd join`` child process and what it printed on start-up."""

    def __init__(self, index: int, args: list[str], log_path: Path):
        self.index = index
        self.log_path = log_path
        self.started_at = time.monotonic()
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peerd.cli", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        self._buffer = b""
        self.address: str | None = None
        self.status_port: int | None = None
        self.last_status: dict[str, Any] = {}

    @property
    def started(self) -> bool:
        return self.address is not None and self.status_port is not None

    def read_startup(self) -> None:
        """Read what the child printed so far (call when its stdout is readable)."""
        assert self.process.stdout is not None
        chunk = os.read(self.process.stdout.fileno(), 65536)
        if not chunk:
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line.startswith("peerd listening on "):
                self.address = line.removeprefix("peerd listening on ")
            elif line.startswith("peerd status on "):
                self.status_port = int(line.rsplit(":", 1)[1].split("/")[0])

    def poll_status(self) -> dict[str, Any] | None:
        if self.process.poll() is not None or self.status_port is None:
            return None
        try:
            self.last_status = json.loads(fetch_status(self.status_port, timeout=2.0))
        except (OSError, ValueError):
            return None
        return self.last_status

    def tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def wait_started(
    peers: list[SwarmPeer],
    timeout: float,
    on_started: Callable[[SwarmPeer], None],
    on_waiting: Callable[[list[SwarmPeer]], None] | None = None,
) -> None:
    """Wait until every peer printed its addresses, calling ``on_started`` for each as it does and
    ``on_waiting`` with the ones still starting about once a second; RuntimeError (with the log's
    tail) for one that exits or is not up within ``timeout``."""
    deadline = time.monotonic() + timeout
    pending = {peer.process.stdout.fileno(): peer for peer in peers if not peer.started}
    with selectors.DefaultSelector() as selector:
        for fd, peer in pending.items():
            selector.register(fd, selectors.EVENT_READ, peer)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                peer = next(iter(pending.values()))
                raise RuntimeError(f"peer {peer.index} did not start within {timeout:.0f} s:\n{peer.tail()}")
            for key, _ in selector.select(min(remaining, 1.0)):
                peer = key.data
                peer.read_startup()
                if peer.started:
                    selector.unregister(key.fd)
                    del pending[key.fd]
                    on_started(peer)
            for peer in list(pending.values()):
                if peer.process.poll() is not None:
                    raise RuntimeError(f"peer {peer.index} exited ({peer.process.returncode}):\n{peer.tail()}")
            if pending and on_waiting is not None:
                on_waiting(list(pending.values()))


def wait_claimed(peer: SwarmPeer, timeout: float, poll: float = 0.2) -> str | None:
    """Wait until ``peer`` trains, its status naming its data shard (which it does once its claim
    is stored in the DHT, ``data_shards.publish_claim``) and an epoch: peers that choose their
    shards while it still loads its data may not hear from it in time, its loop busy, and so not
    count its shard. The shard ("I/N"), or None when it does not train within ``timeout``.
    RuntimeError (with the log's tail) when it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        status = peer.poll_status()
        if status is not None and isinstance(status.get("data_shard"), str) and status.get("epoch") is not None:
            return status["data_shard"]
        if peer.process.poll() is not None:
            raise RuntimeError(f"peer {peer.index} exited ({peer.process.returncode}):\n{peer.tail()}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll)


def stop_all(peers: Iterable[SwarmPeer], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM every running peer at once, wait for all within one deadline, SIGKILL the rest."""
    peers = list(peers)
    for peer in peers:
        if peer.process.poll() is None:
            peer.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for peer in peers:
        try:
            peer.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            peer.process.kill()
            peer.process.wait()
        peer.close()
