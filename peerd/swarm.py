"""``peerd swarm``: N local peers training one task, with a live table, until a target accuracy.

The first peer is the bootstrap; once it trains (its data shard claimed), the others start
together and join through it.
Each is a separate ``peerd join`` process (so a crash or a kill affects one peer only; see
``swarm_processes.py`` for how they never outlive the launcher) with its own data shard (the
bootstrap ``0/N``, the others ``auto``) and status port; this command polls their ``/status``
once a second, shows a table (``swarm_table.py``), and stops them all when the best peer's held-out accuracy reaches the
target, when every peer passed ``--max-epochs``, at ``--timeout``, or on Ctrl-C / SIGTERM. The
last line of output is always a JSON summary. Exit status: 0 target reached, 4 stopped before it,
130 Ctrl-C, 143 SIGTERM. The peers' keys (and logs, without ``--log-dir``) live in a temporary
folder removed at exit unless ``--keep-files``; one that a killed launcher (SIGKILL) had to leave is
removed by the next ``peerd swarm`` (its name carries the launcher's process ID). ``--plot FILE.png``
writes the peers' curves at exit (``curves_png.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer import LOCAL_DIFFICULTY

from .curves_png import write_curves_png
from .exit_codes import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_TARGET_MISSED, EXIT_TERMINATED
from .join_arguments import AGGREGATION, MODE
from .stop_signals import STOP_SIGNALS, Stopped, stop_signals_raise
from .swarm_processes import SwarmPeer, stop_all, wait_claimed, wait_started
from .swarm_table import TableDisplay

__all__ = ["run_swarm", "add_swarm_arguments"]

# textlm's default goal: a bit per byte below what byte frequencies alone give on this corpus (a
# unigram model scores 4.47; the best model of byte pairs 3.36). Three peers on 2 CPU cores reach
# it within 5 minutes; going below the byte-pair figure takes a few times longer.
TEXTLM_TARGET_BPB = 3.5
STARTUP_TIMEOUT = 60.0  # importing torch and building the task can take a while on a busy machine
POLL_PERIOD = 1.0


def add_swarm_arguments(swarm: argparse.ArgumentParser) -> None:
    swarm.add_argument("--peers", type=int, default=3, help="peers to start; the first is the bootstrap")
    swarm.add_argument("--task", default="digits", help="what they train: a built-in name or package.module:factory")
    swarm.add_argument(
        "--mode",
        choices=MODE.choices,
        default=MODE.default,
        help="gradient averaging every swarm-wide batch, or DiLoCo-style local steps and outer rounds",
    )
    swarm.add_argument(
        "--target-accuracy", type=float, default=0.9, help="stop when the best peer's held-out accuracy reaches it"
    )
    swarm.add_argument(
        "--target-bpb",
        type=float,
        default=None,
        help=f"text tasks: stop when the best peer's held-out bits per byte falls to it "
        f"(textlm: {TEXTLM_TARGET_BPB}, a bit below byte frequencies' 4.47); replaces --target-accuracy",
    )
    swarm.add_argument("--model-size", default=None, help="model shape for sized tasks (textlm: see peerd join)")
    swarm.add_argument(
        "--aggregation",
        choices=AGGREGATION.choices,
        default=AGGREGATION.default,
        help="how reducers aggregate (see peerd join); auto: the public swarm's robust rules",
    )
    swarm.add_argument("--max-epochs", type=int, default=200, help="stop when every peer has passed this epoch")
    swarm.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="stop after this long")
    swarm.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep each peer's log here (default: in the temporary folder)",
    )
    swarm.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="at exit, write each peer's loss and held-out accuracy (text tasks: bits per byte) over time",
    )
    swarm.add_argument(
        "--keep-files",
        action="store_true",
        help="keep the temporary folder with the peers' keys (and logs) instead of removing it at exit",
    )


def _join_args(index: int, count: int, args: argparse.Namespace, key_dir: Path, run_id: str, bootstrap: str | None):
    join = [
        "join",
        "--listen", "127.0.0.1:0",
        "--identity", str(key_dir / f"peer{index}.key"),
        "--run-id", run_id,
        "--task", args.task,
        "--mode", args.mode,
        # The bootstrap claims the first of N shards; the others choose among the rest as they
        # come up (``data_shards.py``), as peers joining a real swarm do.
        "--data-shard", f"0/{count}" if index == 0 else "auto",
        *(["--model-size", args.model_size] if args.model_size else []),
        "--aggregation", args.aggregation,
        "--status-port", "0",
        # Local peers on one machine: the price on node IDs buys nothing here, the start-up does.
        "--node-id-difficulty", str(LOCAL_DIFFICULTY),
    ]  # fmt: skip
    return join + (["--initial-peer", bootstrap] if bootstrap else [])


WORK_DIR_PREFIX = "peerd-swarm-"
# A folder kept on purpose (--keep-files) is named so that no later swarm takes it for a killed
# launcher's leftovers: where the PID would be, this word.
KEPT_DIR_PREFIX = f"{WORK_DIR_PREFIX}kept-"


def _remove_stale_work_dirs() -> None:
    """Remove the temporary folders (with private keys) of launchers that were killed before they
    could: ours carry the launcher's process ID, and a folder whose launcher is gone is stale
    (a ``--keep-files`` folder carries ``kept`` there, and stays)."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORK_DIR_PREFIX}*-*"):
        pid = path.name.removeprefix(WORK_DIR_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, OverflowError):  # not ours to judge (another user's process, a bad name)
            continue


class _Curves:
    """Each peer's loss and held-out metric over the run, for ``--plot``."""

    def __init__(self) -> None:
        self.loss: dict[int, list[tuple[float, float]]] = {}
        self.held_out: dict[int, list[tuple[float, float]]] = {}

    def add(self, statuses: list[dict[str, Any] | None], seconds: float, held_out_key: str) -> None:
        for index, status in enumerate(statuses):
            if status is None:
                continue
            for series, key in ((self.loss, "loss"), (self.held_out, held_out_key)):
                value = status.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(index, []).append((seconds, float(value)))


def _write_plot(path: Path, curves: _Curves, text_task: bool, seconds: float) -> str | None:
    """Write ``--plot``'s PNG; its path, or None (and why on stderr) when it cannot be written."""
    try:
        write_curves_png(path, curves.loss, curves.held_out, "bits/byte" if text_task else "held-out accuracy", seconds)
    except OSError as error:
        print(f"peerd: cannot write the plot {path}: {error.strerror or error}", file=sys.stderr)
        return None
    return str(path)


@dataclass(frozen=True)
class _Progress:
    """The best the swarm's peers have shown so far."""

    accuracy: float | None = None
    bits_per_byte: float | None = None
    epochs: int = 0

    def after(self, alive: list[dict[str, Any]]) -> _Progress:
        """This progress with the live peers' latest statuses taken in."""
        accuracies = [s["accuracy"] for s in alive if isinstance(s.get("accuracy"), (int, float))]
        bpbs = [s["bits_per_byte"] for s in alive if isinstance(s.get("bits_per_byte"), (int, float))]
        return _Progress(
            accuracy=max(accuracies) if accuracies else self.accuracy,
            bits_per_byte=min(bpbs) if bpbs else self.bits_per_byte,
            epochs=max((s.get("epoch") or 0 for s in alive), default=self.epochs),
        )

    def reached(self, target_accuracy: float, target_bpb: float | None) -> bool:
        if target_bpb is not None:
            return self.bits_per_byte is not None and self.bits_per_byte <= target_bpb
        return self.accuracy is not None and self.accuracy >= target_accuracy


def run_swarm(args: argparse.Namespace) -> int:
    if args.peers < 1:
        print("peerd: --peers must be at least 1", file=sys.stderr)
        return 1
    display = TableDisplay(sys.stdout)
    _remove_stale_work_dirs()
    # keys (0600, in a 0700 folder)
    work_dir = Path(tempfile.mkdtemp(prefix=f"{KEPT_DIR_PREFIX if args.keep_files else WORK_DIR_PREFIX}{os.getpid()}-"))
    curves = _Curves()
    log_dir = args.log_dir or work_dir
    peers: list[SwarmPeer] = []
    start = time.monotonic()
    progress, stopped_by, error = _Progress(), None, None
    target_bpb = args.target_bpb
    if target_bpb is None and args.task == "textlm":
        target_bpb = TEXTLM_TARGET_BPB
    # From here on Ctrl-C and SIGTERM raise Stopped: whenever they come, the peers are stopped
    # and the summary printed.
    with stop_signals_raise():
        try:
            try:
                display.message(
                    f"peerd swarm: {args.peers} peers training {args.task} ({args.mode}); loading the task..."
                )
                from .tasks import check_task  # torch loads only once a swarm is really started

                check_task(args.task, args.model_size)  # a bad task fails here (TaskError: exit 1), before any start
                log_dir.mkdir(parents=True, exist_ok=True)
                _start_peers(args, display, peers, work_dir, log_dir)
                statuses: list[dict[str, Any] | None] = []
                for progress, statuses in _polls(args, display, peers, curves, target_bpb, start):
                    if _finished(args, progress, statuses, target_bpb):
                        break
                if statuses:
                    display.show(statuses, time.monotonic() - start, force=True)  # how it ended
            except Stopped as stop:
                stopped_by = stop.signum
            except KeyboardInterrupt:  # SIGINT before our handler was installed in this frame's view
                stopped_by = signal.SIGINT
            except RuntimeError as failure:  # a peer that did not start
                error = str(failure)
        finally:
            # A second Ctrl-C must not cut the clean-up short: the peers would be left running.
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
            stop_all(peers)
            if not args.keep_files:
                shutil.rmtree(work_dir, ignore_errors=True)
            display.close()
    seconds = time.monotonic() - start
    plot = _write_plot(args.plot, curves, target_bpb is not None, seconds) if args.plot else None
    if stopped_by is not None:
        display.message(f"stopped by {signal.Signals(stopped_by).name}")
    if error is not None:
        print(f"peerd: {error}", file=sys.stderr)
    reached = progress.reached(args.target_accuracy, target_bpb)
    summary = _summary(args, peers, progress, target_bpb, seconds, stopped_by, log_dir, plot)
    print(json.dumps(summary), flush=True)
    if reached:
        return EXIT_OK
    if stopped_by is not None:
        return EXIT_INTERRUPTED if stopped_by == signal.SIGINT else EXIT_TERMINATED
    return EXIT_BAD_INPUT if error is not None else EXIT_TARGET_MISSED  # a peer that did not start


def _start_peers(
    args: argparse.Namespace, display: TableDisplay, peers: list[SwarmPeer], work_dir: Path, log_dir: Path
) -> None:
    """Start the bootstrap, then the others through it, into ``peers`` (so that whatever started
    is stopped however this ends); RuntimeError for a peer that does not start."""
    run_id = f"swarm-{os.getpid()}-{int(time.time())}"

    def started(peer: SwarmPeer) -> None:
        took = time.monotonic() - peer.started_at
        display.message(f"peer {peer.index} up at {peer.address} ({took:.1f} s)")

    def waiting(pending: list[SwarmPeer]) -> None:
        names = ", ".join(str(peer.index) for peer in pending)
        took = time.monotonic() - min(peer.started_at for peer in pending)
        display.progress(f"starting peer{'s' if len(pending) > 1 else ''} {names}... ({took:.0f} s)")

    display.message("starting peer 0 (the bootstrap)...")
    peers.append(SwarmPeer(0, _join_args(0, args.peers, args, work_dir, run_id, None), log_dir / "peer0.log"))
    wait_started(peers, STARTUP_TIMEOUT, started, waiting)
    if args.peers > 1:
        # The others start once the bootstrap trains, its claim in the DHT: started before, they
        # could choose their shards without counting it, and one would train the bootstrap's data.
        display.progress("peer 0 is loading its data...")
        if (claimed := wait_claimed(peers[0], STARTUP_TIMEOUT)) is not None:
            display.message(f"peer 0 trains data shard {claimed}")
        else:  # (a slow machine: the others may then choose without counting its shard)
            display.message(f"peer 0 does not train yet after {STARTUP_TIMEOUT:.0f} s; starting the others anyway")
        others = "peer 1" if args.peers == 2 else f"peers 1-{args.peers - 1}"
        display.message(f"starting {others}...")
        for index in range(1, args.peers):
            join = _join_args(index, args.peers, args, work_dir, run_id, peers[0].address)
            peers.append(SwarmPeer(index, join, log_dir / f"peer{index}.log"))
        wait_started(peers, STARTUP_TIMEOUT, started, waiting)
    display.message(f"swarm of {args.peers} peers running (logs in {log_dir})")
    display.message(f"dashboard of peer 0: http://127.0.0.1:{peers[0].status_port}/")
    join_flags = f"--initial-peer {peers[0].address} --run-id {run_id} --node-id-difficulty {LOCAL_DIFFICULTY}"
    display.message(f"more peers join with: peerd join {join_flags} (peerd dht get/store take the same flags)")


def _polls(
    args: argparse.Namespace,
    display: TableDisplay,
    peers: list[SwarmPeer],
    curves: _Curves,
    target_bpb: float | None,
    start: float,
) -> Iterator[tuple[_Progress, list[dict[str, Any] | None]]]:
    """Poll the peers once a second until ``--timeout``, showing the table and recording the
    curves; yields the progress so far with each poll's statuses (None: a peer that is gone)."""
    progress = _Progress()
    while time.monotonic() - start < args.timeout:
        time.sleep(POLL_PERIOD)
        statuses = [peer.poll_status() for peer in peers]
        display.show(statuses, time.monotonic() - start)
        curves.add(statuses, time.monotonic() - start, "accuracy" if target_bpb is None else "bits_per_byte")
        progress = progress.after([s for s in statuses if s is not None])
        yield progress, statuses


def _finished(
    args: argparse.Namespace, progress: _Progress, statuses: list[dict[str, Any] | None], target_bpb: float | None
) -> bool:
    """The target is reached, no peer is alive, or every peer passed ``--max-epochs``."""
    alive = [s for s in statuses if s is not None]
    if progress.reached(args.target_accuracy, target_bpb) or not alive:
        return True
    return all((s.get("epoch") or 0) >= args.max_epochs for s in alive)


def _summary(
    args: argparse.Namespace,
    peers: list[SwarmPeer],
    progress: _Progress,
    target_bpb: float | None,
    seconds: float,
    stopped_by: int | None,
    log_dir: Path,
    plot: str | None,
) -> dict[str, Any]:
    """The JSON line the run ends with."""
    alive_count = sum(1 for peer in peers if peer.last_status and peer.process.returncode in (0, -signal.SIGTERM))
    return {
        "task": args.task,
        "mode": args.mode,
        "peers": args.peers,
        "peers_alive": alive_count,
        "epochs": progress.epochs,
        "accuracy": progress.accuracy,
        "target_accuracy": None if target_bpb is not None else args.target_accuracy,
        "bits_per_byte": progress.bits_per_byte,
        "target_bpb": target_bpb,
        "reached": progress.reached(args.target_accuracy, target_bpb),
        "seconds": round(seconds, 1),
        "stopped_by": signal.Signals(stopped_by).name if stopped_by is not None else None,
        "logs": str(log_dir) if args.log_dir or args.keep_files else None,
        "plot": plot,
    }
