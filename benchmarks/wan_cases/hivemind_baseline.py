"""Hivemind's averager as ``benchmarks/wan.py``'s baseline for the all-reduce: four
``hivemind_averager.py`` processes on the same lab hosts as peerd's members, stepped in turn with
them, so that both are measured over the same links in the same run.

Each process runs under ``python`` (an interpreter with Hivemind installed, not the project's)
and starts its own session, so that stopping it also stops the DHT and averager processes and the
``p2pd`` daemon Hivemind forks (the lab kills only the process it started).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.lab.test_lab_group_faults import read_line

SCRIPT = "benchmarks/wan_cases/hivemind_averager.py"
STOP_GRACE = 20.0  # a clean shutdown stops p2pd and the averager's processes


class HivemindPeers:
    """One Hivemind averager per host, all in one group of ``len(hosts)``."""

    def __init__(self, lab, hosts, workdir: Path, python: str, values: int, start_timeout: float):
        self.processes: list[subprocess.Popen] = []
        self.logs = [workdir / f"hivemind{index}.log" for index in range(len(hosts))]
        common = ["--group-size", str(len(hosts)), "--values", str(values)]
        try:
            self._spawn(lab, hosts[0], 0, python, common)
            maddrs = json.loads(self._line(0, start_timeout))["maddrs"]
            self._expect_ready(0, start_timeout)
            joins = [flag for maddr in maddrs for flag in ("--initial-peer", maddr)]
            for index, host in enumerate(hosts[1:], start=1):
                self._spawn(lab, host, index, python, [*common, *joins])
            for index in range(1, len(hosts)):
                self._expect_ready(index, start_timeout)
        except BaseException:
            self.stop()  # the lab would kill only the interpreters, not what they forked
            raise

    def _spawn(self, lab, host, index: int, python: str, flags: list[str]) -> subprocess.Popen:
        argv = [SCRIPT, "--index", str(index), "--address", host.address, *flags]
        process = lab.spawn(host, argv, self.logs[index], python=python)
        self.processes.append(process)
        return process

    def _line(self, index: int, timeout: float) -> str:
        try:
            line = read_line(self.processes[index], timeout)
        except TimeoutError:
            line = ""
        if not line:
            tail = self.logs[index].read_text(errors="replace")[-800:]
            raise RuntimeError(f"hivemind peer {index} did not answer within {timeout:.0f} s:\n{tail}")
        return line

    def _expect_ready(self, index: int, timeout: float) -> None:
        if (line := self._line(index, timeout)) != "ready":
            raise RuntimeError(f"hivemind peer {index} did not start ({line!r})")

    def step(self, limit: float) -> list[dict[str, Any]]:
        """One step on every peer at once; each peer's outcome, within ``limit`` seconds."""
        for process in self.processes:
            process.stdin.write(b"step\n")
            process.stdin.flush()
        deadline = time.monotonic() + limit
        return [json.loads(self._line(i, max(0.1, deadline - time.monotonic()))) for i in range(len(self.processes))]

    def stop(self) -> None:
        """Close every peer's stdin (a clean shutdown), then kill what is left of its session."""
        for process in self.processes:
            with contextlib.suppress(OSError):
                process.stdin.close()
        deadline = time.monotonic() + STOP_GRACE
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # the script made its pid its session's group


class Baseline:
    """Hivemind's steps within ``wan.py``'s all-reduce part. Hivemind failing to start or to finish
    a step ends the baseline with its error in the figures; peerd's figures never depend on it."""

    def __init__(self, lab, hosts, workdir: Path, python: str, values: int, start_timeout: float):
        self.size = len(hosts)
        self.steps: list[dict[str, float | None]] = []
        self.failures: list = []
        self.error: str | None = None
        self.peers: HivemindPeers | None = None
        try:
            self.peers = HivemindPeers(lab, hosts, workdir, python, values, start_timeout)
        except (RuntimeError, OSError, ValueError, KeyError) as error:
            self.error = f"{type(error).__name__}: {error}"[:400]

    def step(self, number: int, limit: float) -> None:
        """Step ``number`` (0 warms up and is not counted) on every peer, within ``limit`` seconds."""
        if self.peers is None:
            return
        try:
            outcome = self.peers.step(limit)
        except (RuntimeError, OSError, ValueError) as error:  # a peer died or hung: its output is out of step
            self.error = f"step {number}: {type(error).__name__}: {error}"[:400]
            self.stop()
            return
        if not full_group(outcome, self.size):
            self.failures.append([r.get("error") or r.get("size") for r in outcome])
        elif number > 0:
            self.steps.append(step_times(outcome))

    def stop(self) -> None:
        if self.peers is not None:
            self.peers.stop()
            self.peers = None

    def figures(self, bound: float) -> dict[str, Any]:
        return {**figures(self.steps, self.failures, bound), "error": self.error}


def full_group(outcome: list[dict[str, Any]], size: int) -> bool:
    """Every peer averaged in one group of ``size`` and holds the exact mean."""
    return all(r["ok"] and r.get("size") == size and r.get("exact") for r in outcome)


def step_times(outcome: list[dict[str, Any]]) -> dict[str, float | None]:
    """The slowest peer's step and all-reduce (None where a peer did not see its all-reduce stage)."""
    allreduce = [r.get("allreduce_s") for r in outcome]
    return {
        "step_s": max(r["seconds"] for r in outcome),
        "allreduce_s": None if None in allreduce else max(allreduce),
    }


def figures(steps: list[dict[str, float]], failures: list, bound: float) -> dict[str, Any]:
    """Medians of the full-group steps against the line-rate bound ``bound``."""
    if not steps:
        return {"failed_steps": len(failures), "failures": failures[:3]}
    step_s = statistics.median(s["step_s"] for s in steps)
    timed = [s["allreduce_s"] for s in steps if s["allreduce_s"] is not None]
    allreduce_s = statistics.median(timed) if timed else None
    return {
        "step_s": step_s,
        "allreduce_s": allreduce_s,
        "step_line_rate_fraction": bound / step_s,
        "allreduce_line_rate_fraction": bound / allreduce_s if allreduce_s else None,
        "steps": steps,
        "failed_steps": len(failures),
        "failures": failures[:3],
    }
