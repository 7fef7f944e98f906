"""The target: a ``peerd join`` process under attack, its memory, and how a legitimate peer sees it.

Every process started here is killed and reaped at exit (by its own id, never by name).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from peer import LOCAL_DIFFICULTY, Identity, PeerAddress, open_peer_host
from peer.transport import TcpTransport

ROOT = Path(__file__).resolve().parent.parent.parent
RUN_ID = "hostile-bench"
# The targets' run checks node IDs at the local difficulty, as tests do: the attacks here are about
# what a peer does once in, and the price of getting in is measured on its own (sybil_placement).
DIFFICULTY = LOCAL_DIFFICULTY
ATTACKER_HOST = "127.0.0.66"  # a second loopback address: the attacker's "one address"
RSS_LIMIT_MB = 100  # the target for max_rss_growth_mb
SAFETY_RSS_MB = 2048  # stop feeding an attack once the target grew this much (a shared machine)
MIB = 1 << 20

_CHILDREN: list[subprocess.Popen] = []


def reap_all() -> None:
    """Kill and reap every process this benchmark started (by its own id, never by name)."""
    for process in _CHILDREN:
        if process.poll() is None:
            try:
                process.kill()
            except OSError:
                pass
        try:
            process.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            pass


atexit.register(reap_all)


class Target:
    """A ``peerd join`` subprocess: stdout parsed for its addresses, stderr to a log file."""

    def __init__(self, name: str, workdir: Path, extra: list[str]):
        self.name = name
        self.identity = Identity.generate()
        key_path = workdir / f"{name}.key"
        self.identity.save(key_path)
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PEERD_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        command = [sys.executable, "-m", "peerd.cli", "join", "--listen", "127.0.0.1:0", "--status-port", "0"]
        command += ["--identity", str(key_path), "--run-id", RUN_ID, "--node-id-difficulty", str(DIFFICULTY), *extra]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the benchmark only; it stops its children itself
        )
        _CHILDREN.append(self.process)
        self.pid = self.process.pid
        self.address: PeerAddress | None = None
        self.status_port: int | None = None
        self._buffer = b""

    def _read_addresses(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while self.address is None or self.status_port is None:
                while b"\n" in self._buffer:
                    line, _, self._buffer = self._buffer.partition(b"\n")
                    text = line.decode(errors="replace").strip()
                    if text.startswith("peerd listening on "):
                        self.address = PeerAddress.parse(text.removeprefix("peerd listening on "))
                    elif text.startswith("peerd status on "):
                        self.status_port = int(text.rsplit(":", 1)[1].split("/")[0])
                if self.address is not None and self.status_port is not None:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return
                chunk = os.read(self.process.stdout.fileno(), 65536)
                if not chunk:
                    return
                self._buffer += chunk

    async def start(self, timeout: float = 60.0) -> bool:
        await trio.to_thread.run_sync(self._read_addresses, timeout)
        return self.address is not None and self.status_port is not None

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def exit_note(self) -> str:
        code = self.process.poll()
        if code is None:
            return "still running"
        lines = [line for line in self.log().splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        last = (errors or lines or ["(empty log)"])[-1].strip()
        return f"exited with {code}: {last[:160]}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def read_memory_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in kB, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as file:
            text = file.read()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":", 1)
            values[name] = int(value.split()[0])
    if "VmRSS" not in values:
        return None
    return values["VmRSS"], values.get("VmHWM", values["VmRSS"])


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so each case gets its own peak."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


class MemoryWatch:
    """Peak RSS growth of one process since the watch began."""

    def __init__(self, pid: int):
        self.pid = pid
        memory = read_memory_kb(pid)
        self.peak_reset = reset_peak(pid)
        memory = read_memory_kb(pid) or memory
        self.baseline_kb = memory[0] if memory else 0
        self.peak_kb = self.baseline_kb
        self.last_kb = self.baseline_kb

    def sample(self) -> None:
        memory = read_memory_kb(self.pid)
        if memory is None:
            return
        rss, hwm = memory
        self.last_kb = rss
        self.peak_kb = max(self.peak_kb, rss, hwm if self.peak_reset else 0)

    @property
    def growth_mb(self) -> float:
        return max(0.0, (self.peak_kb - self.baseline_kb) / 1024)

    @property
    def over_safety_limit(self) -> bool:
        return self.growth_mb > SAFETY_RSS_MB


async def fetch_status(port: int, timeout: float = 5.0) -> dict | None:
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET /status HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
                return json.loads(body)
        except (OSError, trio.BrokenResourceError, ValueError):
            pass
    return None


async def legit_ping(address: PeerAddress, timeout: float = 5.0) -> float | None:
    """A legitimate peer (fresh identity, from 127.0.0.1) connects and completes ``peer.ping``:
    the seconds that took, or None if it could not within ``timeout``."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        try:
            transport = TcpTransport(connect_timeout=timeout)
            async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID, transport=transport) as host:
                connection = await host.connect(PeerAddress(address.host, address.port))
                await connection.call("peer.ping", timeout=timeout)
                return trio.current_time() - start
        except Exception:  # refused, reset, timed out, garbled: all mean "no service"
            return None
    return None


async def legit_join(address: PeerAddress, deadline_s: float) -> tuple[float | None, int]:
    """Retry like a joining peer does (backoff 0.2 s doubling to 2 s) until a ping succeeds:
    (seconds from the first attempt, attempts), seconds None if not within ``deadline_s``."""
    start = trio.current_time()
    delay, attempts = 0.2, 0
    while (remaining := deadline_s - (trio.current_time() - start)) > 0:
        attempts += 1
        if await legit_ping(address, timeout=min(5.0, remaining)) is not None:
            return trio.current_time() - start, attempts
        await trio.sleep(min(delay, max(0.0, deadline_s - (trio.current_time() - start))))
        delay = min(2 * delay, 2.0)
    return None, attempts
