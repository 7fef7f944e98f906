"""Peers that are training scripts (a ``transformers.Trainer``, a Lightning ``Trainer``) run as
processes from the repository's root: the first JSON line they print (their address) and the last
(what they reached); always reaped."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ScriptPeer:
    """``python -m MODULE ARGS...`` with ``env`` added to this process's environment."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()):
        """``launcher``: what runs the module instead of this interpreter (torchrun and its flags)."""
        environ = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        self.process = subprocess.Popen(
            [*(launcher or (sys.executable,)), "-m", module, *args],
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def first_json(self, timeout: float) -> dict:
        """The first line of stdout that is a JSON object."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if selector.select(deadline - time.monotonic()):
                    line = self.process.stdout.readline()
                    assert line, f"exited ({self.process.poll()}):\n{self.process.stderr.read()}"
                    if line.startswith("{"):
                        return json.loads(line)
        raise AssertionError(f"no JSON line within {timeout} s")

    def last_json(self, timeout: float) -> dict:
        """The last JSON line, once the script exited 0."""
        return self.json_lines(timeout)[-1]

    def json_lines(self, timeout: float) -> list[dict]:
        """Every JSON line printed after the first one read, once the script exited 0."""
        out, err = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, err
        return [json.loads(line) for line in out.splitlines() if line.startswith('{"')]

    def __enter__(self) -> ScriptPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()
