"""Running real ``peerd`` processes in tests: started on 127.0.0.1, always reaped."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from peerd.status_server import fetch_status

PEERD = [sys.executable, "-m", "peerd.cli"]


def status_of(port: int) -> dict | None:
    """A peer's /status on 127.0.0.1:port, or None while it does not answer."""
    try:
        return json.loads(fetch_status(port, timeout=2))
    except OSError:
        return None


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat ("T": stopped, "Z": a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` (a real process's state) until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def wait_until_accurate(ports, timeout: float, accuracy: float = 0.9) -> None:
    """Until every peer on ``ports`` reports ``accuracy`` on its held-out data."""
    what = f"peers on {list(ports)} at {accuracy} held-out accuracy"
    wait_until(lambda: min((status_of(p) or {}).get("accuracy") or 0 for p in ports) >= accuracy, timeout, what)


def wait_until_averaged_in(port: int, group: int, timeout: float, what: str) -> None:
    """Until the peer on ``port`` last averaged in a group of ``group`` (``what`` that round is)."""
    wait_until(lambda: ((status_of(port) or {}).get("last_averaging") or {}).get("group") == group, timeout, what)


def _as_from_a_terminal() -> None:
    """In the child, before ``peerd`` starts: Ctrl-C and SIGTERM as a terminal's foreground job gets
    them. A test runner started in the background by a non-interactive shell (``./.ci/run &``)
    ignores SIGINT, and an ignored signal stays ignored across exec: ``peerd`` would then not
    hear the Ctrl-C the interrupt tests send (as a real background job rightly does not)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class PeerdProcess:
    """A ``peerd`` subprocess whose stdout is read line by line and stderr goes to a file
    (``launcher``: the command before ``args``, ``torchrun ... -m peerd`` say)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, launcher: list[str] = PEERD):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            launcher + args,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_as_from_a_terminal,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        self._buffer = b""

    def read_line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise TimeoutError(f"no line from peerd within {timeout} s; log:\n{self.log()}")
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise EOFError(f"peerd exited ({self.process.poll()}) without a line; log:\n{self.log()}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def wait_for_log(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not logged within {timeout} s; log:\n{self.log()}")
            if self.process.poll() is not None and text not in self.log():
                raise AssertionError(f"peerd exited with {self.process.returncode}; log:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        if not self._log.closed:  # (after stop() the file is complete)
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._selector.close()
        self.process.stdout.close()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> PeerdProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(signal.SIGKILL)
