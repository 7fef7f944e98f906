"""``peerd swarm``: N local peers training one task, with a live table, until a target accuracy.

The first peer is the bootstrap; the others join through it. Each is a separate ``peerd join``
process (so a crash or a kill affects one peer only) with its own data shard and status port; this
command polls their ``/status`` once a second, prints a table, and stops them all when the best
peer's held-out accuracy reaches the target, when every peer passed ``--max-epochs``, or at
``--timeout``. The last line of output is a JSON summary; the exit status is 0 only if the target
was reached.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer import LOCAL_DIFFICULTY

from .status_server import fetch_status

__all__ = ["run_swarm", "SwarmPeer"]

STARTUP_TIMEOUT = 60.0  # importing torch and building the task can take a while on a busy machine


class SwarmPeer:
    """One ``peerd join`` child process and what it printed on start-up."""

    def __init__(self, index: int, args: list[str], log_path: Path):
        self.index = index
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peer.daemon.cli", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.address: str | None = None
        self.status_port: int | None = None
        self.last_status: dict[str, Any] = {}

    def wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        while self.address is None or self.status_port is None:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"peer {self.index} did not start; see {self.log_path}:\n{self.tail()}")
            line = self.process.stdout.readline().decode().strip()
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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(peers: list[SwarmPeer], statuses: list[dict | None], elapsed: float) -> str:
    rows = [f"t={elapsed:6.1f}s  peer  epoch  samples/s     loss  accuracy  peers"]
    for peer, status in zip(peers, statuses, strict=True):
        if status is None:
            rows.append(f"{'':9} {peer.index:>4}  {'(down)':>5}")
            continue
        rows.append(
            f"{'':9} {peer.index:>4}  {_fmt(status.get('epoch'), '>5')}  {_fmt(status.get('samples_per_s'), '>9.1f')}"
            f"  {_fmt(status.get('loss'), '>7.3f')}  {_fmt(status.get('accuracy'), '>8.3f')}"
            f"  {_fmt(status.get('peers_known'), '>5')}"
        )
    return "\n".join(rows)


def run_swarm(args: argparse.Namespace) -> int:
    if args.peers < 1:
        print("peerd: --peers must be at least 1", file=sys.stderr)
        return 1
    from .tasks import load_task  # torch loads only once a swarm is really started

    load_task(args.task)  # a bad task name fails here, before any process starts
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="peerd-swarm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"swarm-{os.getpid()}-{int(time.time())}"
    peers: list[SwarmPeer] = []
    start = time.monotonic()
    reached, best_accuracy, epochs = False, None, 0
    try:
        for index in range(args.peers):
            join = [
                "join",
                "--listen", "127.0.0.1:0",
                "--identity", str(log_dir / f"peer{index}.key"),
                "--run-id", run_id,
                "--task", args.task,
                "--mode", args.mode,
                "--data-shard", f"{index}/{args.peers}",
                "--status-port", "0",
                # Local peers on one machine: the price on node IDs buys nothing here, the start-up does.
                "--node-id-difficulty", str(LOCAL_DIFFICULTY),
            ]  # fmt: skip
            if peers:
                join += ["--initial-peer", str(peers[0].address)]
            peer = SwarmPeer(index, join, log_dir / f"peer{index}.log")
            peers.append(peer)
            peer.wait_started(STARTUP_TIMEOUT)
        print(f"swarm of {args.peers} peers running (logs in {log_dir})", flush=True)
        join_flags = f"--initial-peer {peers[0].address} --run-id {run_id} --node-id-difficulty {LOCAL_DIFFICULTY}"
        print(f"more peers join with: peerd join {join_flags} (peerd dht get/store take the same flags)", flush=True)
        while time.monotonic() - start < args.timeout:
            time.sleep(1.0)
            statuses = [peer.poll_status() for peer in peers]
            print(_table(peers, statuses, time.monotonic() - start), flush=True)
            alive = [s for s in statuses if s is not None]
            accuracies = [s["accuracy"] for s in alive if s.get("accuracy") is not None]
            best_accuracy = max(accuracies) if accuracies else best_accuracy
            epochs = max((s.get("epoch") or 0 for s in alive), default=epochs)
            if best_accuracy is not None and best_accuracy >= args.target_accuracy:
                reached = True
                break
            if not alive or all((s.get("epoch") or 0) >= args.max_epochs for s in alive):
                break
    finally:
        for peer in peers:
            peer.stop()
    alive_count = sum(1 for peer in peers if peer.last_status and peer.process.returncode in (0, -signal.SIGTERM))
    summary = {
        "task": args.task,
        "mode": args.mode,
        "peers": args.peers,
        "peers_alive": alive_count,
        "epochs": epochs,
        "accuracy": best_accuracy,
        "target_accuracy": args.target_accuracy,
        "reached": reached,
        "seconds": round(time.monotonic() - start, 1),
        "logs": str(log_dir),
    }
    print(json.dumps(summary), flush=True)
    return 0 if reached else 1
