"""Hostile peers, part 1: a catalogue of attacks against a real ``peerd join`` process.

Every attack is made the way an attacker would make it: over TCP to a real peer started as
``peerd join --listen 127.0.0.1:0 --status-port 0 --identity ...`` (a bootstrap peer, or a training
peer with ``--task digits`` where the attack needs one). Where an honest implementation would refuse
to misbehave, the bytes are driven by hand over a real Noise handshake (``secure_handshake``).
Attack traffic comes from 127.0.0.66, legitimate peers from 127.0.0.1, so per-address admission
limits are measured as they would act on the internet (both are loopback on Linux).

Catalogue (the rows of the table):
  remote_crash          a fake DHT peer answers ``dht.find`` with contacts that share one host:port
  stalled_payloads      4 calls announce 256 MiB payloads; 1 MiB of each arrives, then nothing
  half_sent_records     many connections leave a 1 MiB transport record half sent
  idle_flood            1,000 idle TCP connections (held open, refilled) that never handshake
  connection_burst      2,000 quick connections that send a first Noise message and hang up
  forge_matchmaking     rewrite another peer's matchmaking declaration with a 24 h expiration, under
                        its owner-signed subkey and under its plain peer ID (the old layout)
  store_flood           100 ``dht.store`` requests of 24 h records, then an honest short-lived store
  credit_overshoot      stream DATA past the granted credit window (training peer, ``avg.reduce``)
  forge_progress        rewrite the training peer's own progress record the same two ways
  sybil_placement       node IDs that pass the puzzle per second on one core, and the time to place
                        20 of them near a key (measured at the run's difficulty, estimated at the
                        public default; key grinding, what an ID cost before the puzzle, as baseline)

Scoring, per case: *crash* = the target exited, or neither its status endpoint nor ``peer.ping``
answered; *degraded* = the target is alive but a legitimate peer could not get service (a
connect + ``peer.ping`` during or after the attack, a join under a flood, an honest store);
*forgery* = a forged record that a reader accepts (read back and parsed the way peers parse it) or
that blocks its owner's re-store;
*rss growth* = peak VmRSS (and VmHWM, reset through /proc/PID/clear_refs) minus the case's
baseline. Failures are results, reported as numbers; the benchmark itself never fails because an
attack succeeded. Every process it starts is killed and reaped, every socket closed, also on
Ctrl-C, SIGTERM or an error.

    python benchmarks/hostile.py --quick     # ~2 minutes on 2 cores
    python benchmarks/hostile.py             # longer holds, more connections, larger Sybil swarm

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from averaging.matchmaking import Declaration  # noqa: E402
from averaging.progress import PeerProgress  # noqa: E402
from dht import wire  # noqa: E402
from dht.local import LocalRecords  # noqa: E402
from dht.peer_dictionary import peer_entries, peer_subkey  # noqa: E402
from dht.records import MAX_TTL, DHTRecord, DHTValue, key_id, pack  # noqa: E402
from dht.validation import SignatureValidator  # noqa: E402
from peer import (  # noqa: E402
    DEFAULT_DIFFICULTY,
    LOCAL_DIFFICULTY,
    Identity,
    Message,
    NodeIDProof,
    PeerAddress,
    Router,
    open_peer_host,
)
from peer.framing import HEADER, MAX_RECORD_SIZE  # noqa: E402
from peer.rpc_protocol import STREAM_WINDOW, packb, unpackb  # noqa: E402
from peer.secure_channel import PROTOCOL_VERSION, Hello, secure_handshake  # noqa: E402

RUN_ID = "hostile-bench"
# The targets' run checks node IDs at the local difficulty, as tests do: the attacks here are about
# what a peer does once in, and the price of getting in is measured on its own (sybil_placement).
DIFFICULTY = LOCAL_DIFFICULTY
ATTACKER_HOST = "127.0.0.66"  # a second loopback address: the attacker's "one address"
RSS_LIMIT_MB = 100  # the target for max_rss_growth_mb
SAFETY_RSS_MB = 2048  # stop feeding an attack once the target grew this much (a shared machine)
MIB = 1 << 20

_CHILDREN: list[subprocess.Popen] = []


def _reap_all() -> None:
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


atexit.register(_reap_all)


@dataclass
class Settings:
    quick: bool
    stalled_calls: int = 4
    stalled_payload: int = 256 * MIB
    half_records: int = 100
    idle_connections: int = 1000
    burst_connections: int = 2000
    store_requests: int = 100
    overshoot_streams: int = 4
    overshoot_payload: int = 64 * MIB
    hold_s: float = 2.0
    flood_join_deadline_s: float = 15.0
    refill_delay_s: float = 1.0
    sybil_swarm_n: int = 10_000
    sybil_time_cap_s: float = 20.0
    case_timeout_s: float = 60.0

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if quick:
            return cls(quick=True)
        return cls(
            quick=False,
            half_records=250,
            overshoot_payload=128 * MIB,
            hold_s=6.0,
            flood_join_deadline_s=30.0,
            sybil_swarm_n=100_000,
            sybil_time_cap_s=60.0,
            case_timeout_s=120.0,
        )


# ---------------------------------------------------------------------- target processes
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
        command = [sys.executable, "-m", "peer.daemon.cli", "join", "--listen", "127.0.0.1:0", "--status-port", "0"]
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


# ---------------------------------------------------------------------- outcome bookkeeping
@dataclass
class Outcome:
    case: str
    crashed: bool = False
    degraded: bool = False
    forgeries: int = 0
    rss_growth_mb: float = 0.0
    info_only: bool = False
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    rss_note: str = ""  # the target's RSS once the attack is over (is the memory given back?)

    @property
    def result(self) -> str:
        if self.error is not None:
            return "ERROR"
        if self.crashed or self.degraded or self.forgeries or self.rss_growth_mb > RSS_LIMIT_MB:
            return "FAIL"
        return "info" if self.info_only else "ok"

    def failures(self) -> list[str]:
        what = []
        if self.crashed:
            what.append("crash")
        if self.degraded:
            what.append("degraded")
        if self.forgeries:
            what.append(f"{self.forgeries} forgery")
        if self.rss_growth_mb > RSS_LIMIT_MB:
            what.append(f"rss +{self.rss_growth_mb:.0f} MiB")
        return what


def _describe(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"[:200]


# ---------------------------------------------------------------------- network helpers
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
            if head.startswith(b"HTTP/1.0 200"):
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
            async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID, connect_timeout=timeout) as host:
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


class RawPeer:
    """An authenticated connection whose records the attacker writes by hand."""

    def __init__(self, stream: trio.SocketStream, channel: Any):
        self.stream, self.channel = stream, channel
        self.received: list[Any] = []

    @classmethod
    async def connect(cls, address: PeerAddress, timeout: float = 10.0) -> RawPeer:
        stream = await trio.open_tcp_stream(address.host, address.port, local_address=ATTACKER_HOST)
        identity = Identity.generate()
        hello = Hello(PROTOCOL_VERSION, RUN_ID, node_id_nonce=NodeIDProof.solve(identity.peer_id, DIFFICULTY).nonce)
        try:
            channel = await secure_handshake(stream, identity, hello, initiator=True, timeout=timeout)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return cls(stream, channel)

    async def send(self, header: list) -> None:
        await self.channel.send_record(packb(header))

    async def send_payload(self, nbytes: int, stop: MemoryWatch | None = None) -> int:
        """``nbytes`` of payload in records of at most 1 MiB; stops early past the safety limit."""
        chunk = bytes(min(nbytes, MIB))
        sent = 0
        while sent < nbytes:
            if stop is not None:
                stop.sample()
                if stop.over_safety_limit:
                    break
            size = min(MIB, nbytes - sent)
            await self.channel.send_record(chunk[:size])
            sent += size
        return sent

    async def read_replies(self) -> None:
        """Collect whatever the target answers (decoded headers) until it closes the connection."""
        try:
            while True:
                record = await self.channel.receive_record()
                try:
                    self.received.append(unpackb(record))
                except Exception:
                    self.received.append(None)
        except Exception:
            pass

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


async def close_all(peers: list) -> None:
    with trio.CancelScope(shield=True):
        for peer in peers:
            if isinstance(peer, RawPeer):
                await peer.aclose()
            else:
                await trio.aclose_forcefully(peer)


async def dht_store(connection, key: bytes, subkey: bytes | None, value: bytes, expiration: float) -> bool:
    reply = await connection.call("dht.store", [[key, subkey, value, expiration]], timeout=10)
    return isinstance(reply.body, list) and reply.body[:1] == [True]


async def dht_read_as_peers_do(connection, key: bytes) -> DHTValue | None:
    """The whole dictionary under ``key`` as the target answers it, checked and decoded the way a
    reading peer's own DHT node does (signatures verified, envelopes removed)."""
    reply = await connection.call("dht.find", [key_id(key).to_bytes(20, "big"), key], timeout=10)
    local = LocalRecords(SignatureValidator())
    found = local.validated(wire.parse_found(key, reply.payload, time.time()))
    return None if found is None else local.decode(key, found)


def signed_value(signer: Identity, key: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """``value`` as ``signer``'s DHT node would put it on the wire under its own marked subkey."""
    return SignatureValidator(signer).sign(DHTRecord(key, subkey, value, expiration))


async def owner_store(connection, owner: Identity, key: bytes, value: bytes, ttl: float) -> bool:
    """``owner``'s own record under its marked subkey, signed, as its DHT node stores it."""
    subkey, expiration = pack(peer_subkey(owner.public_key)), time.time() + ttl
    return await dht_store(connection, key, subkey, signed_value(owner, key, subkey, value, expiration), expiration)


async def forge_both_layouts(
    connection, key: bytes, owner: Identity, attacker: Identity, forged: bytes, cap_s: float
) -> tuple[bool, bool]:
    """The attacker's stores of ``forged`` as ``owner``'s record: (accepted under the owner's marked
    subkey, accepted under its plain peer ID). Under the marked subkey: a day-long and a capped
    expiration, signed by the attacker (a signature of its own marked subkey, moved over) and
    unsigned. Under the plain peer ID (what readers read before they took owners from signed
    subkeys): a day-long and a capped expiration."""
    owned, plain = pack(peer_subkey(owner.public_key)), pack(owner.peer_id.to_bytes())
    own = pack(peer_subkey(attacker.public_key))
    marked = plain_taken = False
    for expiration in (time.time() + MAX_TTL, time.time() + cap_s):
        for value in (signed_value(attacker, key, own, forged, expiration), forged):
            marked |= await dht_store(connection, key, owned, value, expiration)
        plain_taken |= await dht_store(connection, key, plain, forged, expiration)
    return marked, plain_taken


# ---------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, settings: Settings, workdir: Path):
        self.settings = settings
        self.workdir = workdir
        self.targets: list[Target] = []
        self._bootstrap: Target | None = None
        self._training: Target | None = None
        self.figures: dict[str, Any] = {}

    async def start_target(self, name: str, extra: list[str], timeout: float = 60.0) -> Target:
        target = Target(f"{name}-{len(self.targets)}", self.workdir, extra)
        self.targets.append(target)
        await target.start(timeout)
        return target

    async def bootstrap(self) -> Target:
        """The shared bootstrap target; started again if an earlier case took it down."""
        target = self._bootstrap
        if target is None or not target.running or target.address is None:
            if target is not None:
                target.stop()
            target = self._bootstrap = await self.start_target("bootstrap", [])
            if target.address is None:
                raise RuntimeError(f"the bootstrap target did not start: {target.exit_note()}")
        return target

    async def training(self) -> Target:
        target = self._training
        if target is None or not target.running or target.address is None:
            if target is not None:
                target.stop()
            target = self._training = await self.start_target("training", ["--task", "digits", "--device", "cpu"])
            if target.address is None:
                raise RuntimeError(f"the training target did not start: {target.exit_note()}")
        return target

    def stop_all(self) -> None:
        for target in self.targets:
            target.stop()

    @asynccontextmanager
    async def watch(self, target: Target, out: Outcome, *, check_after: bool = True) -> AsyncIterator[MemoryWatch]:
        """Sample the target's memory for the duration of the block, then check it is still alive
        and still serves a legitimate peer."""
        memory = MemoryWatch(target.pid)

        async def sampler() -> None:
            while True:
                memory.sample()
                await trio.sleep(0.02)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler)
                try:
                    yield memory
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            memory.sample()
            out.rss_growth_mb = max(out.rss_growth_mb, memory.growth_mb)
        if check_after:
            await self.check_alive(target, out, "after")
            memory.sample()
            out.rss_note = f"rss after {memory.last_kb / 1024:.0f} MiB (base {memory.baseline_kb / 1024:.0f})"

    async def check_alive(self, target: Target, out: Outcome, when: str) -> None:
        if not target.running:
            out.crashed = True
            out.notes.append(f"target {target.exit_note()}")
            return
        status = await fetch_status(target.status_port) if target.status_port else None
        ping = await legit_ping(target.address)
        if not target.running:
            out.crashed = True
            out.notes.append(f"target {target.exit_note()}")
        elif status is None and ping is None:
            out.crashed = True
            out.notes.append(f"target stopped answering status and pings ({when})")
        elif ping is None:
            out.degraded = True
            out.notes.append(f"legit ping failed {when}")
        elif status is None:
            out.notes.append(f"status endpoint silent {when}")

    # ------------------------------------------------------------------ 1. remote crash
    async def case_remote_crash(self, out: Outcome) -> None:
        duplicates = 4
        answered = {"find": 0}
        router = Router()
        own: dict[str, PeerAddress] = {}

        @router.unary("dht.ping")
        async def ping(request) -> None:
            return None

        @router.unary("dht.find")
        async def find(request) -> Message:
            answered["find"] += 1
            decoy = own["decoy"]
            # Several "peers" at one endpoint: fresh IDs, all at one host:port the target has not
            # met yet (a second listener of the attacker's, whose identity matches none of them).
            return Message([[os.urandom(20), decoy.host, decoy.port] for _ in range(duplicates)])

        @router.unary("dht.store")
        async def store(request) -> list:
            return [True] * (len(request.body) if isinstance(request.body, list) else 1)

        async with (
            open_peer_host(Identity.generate(), router=router, run_id=RUN_ID) as fake,
            open_peer_host(Identity.generate(), router=Router(), run_id=RUN_ID) as decoy,
        ):
            own["decoy"] = decoy.listen_address
            endpoint = f"{fake.listen_address.host}:{fake.listen_address.port}"
            listed = f"{decoy.listen_address.host}:{decoy.listen_address.port}"
            target = await self.start_target("crash", ["--initial-peer", endpoint, "--bootstrap-timeout", "5"])
            try:
                if target.address is None:  # it may die before printing its status line
                    out.notes.append("target printed no listen address")
                async with self.watch(target, out, check_after=False):
                    with trio.move_on_after(10.0 if self.settings.quick else 20.0):
                        while target.running:
                            await trio.sleep(0.1)
                out.notes.append(f"{answered['find']} find replies with {duplicates} contacts at {listed}")
                if target.running and target.address is not None:
                    await self.check_alive(target, out, "after")
                else:
                    out.crashed = True
                    out.notes.append(f"target {target.exit_note()}")
            finally:
                target.stop()

    # ------------------------------------------------------------------ 2. memory
    async def case_stalled_payloads(self, out: Outcome) -> None:
        s = self.settings
        target = await self.bootstrap()
        peers: list[RawPeer] = []
        async with self.watch(target, out) as memory:
            try:
                for _ in range(s.stalled_calls):
                    if memory.over_safety_limit:
                        break
                    peer = await RawPeer.connect(target.address)
                    peers.append(peer)
                    await peer.send([7, 1, "peer.ping", None, None, s.stalled_payload])  # UNARY, huge payload
                    await peer.send_payload(MIB)  # the first MiB, then silence
                await trio.sleep(s.hold_s)
                during = await legit_ping(target.address)
                if during is None:
                    out.degraded = True
                    out.notes.append("legit ping failed during the stall")
                out.notes.append(f"{len(peers)} x {s.stalled_payload // MIB} MiB announced, 1 MiB sent each")
                memory.sample()
                out.notes.append(f"rss held +{(memory.last_kb - memory.baseline_kb) / 1024:.0f} MiB")
            finally:
                await close_all(peers)
        await trio.sleep(0.2)

    async def case_half_sent_records(self, out: Outcome) -> None:
        s = self.settings
        target = await self.bootstrap()
        peers: list[RawPeer] = []
        half = bytes(MAX_RECORD_SIZE // 2)
        async with self.watch(target, out) as memory:
            try:
                limiter = trio.CapacityLimiter(16)
                refused = [0]

                async def one() -> None:
                    async with limiter:
                        if memory.over_safety_limit:
                            return
                        try:
                            peer = await RawPeer.connect(target.address)
                            peers.append(peer)
                            # A transport record of the maximal size announced; half of it sent.
                            await peer.channel.send_all(memoryview(HEADER.pack(MAX_RECORD_SIZE) + half))
                        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                            refused[0] += 1  # the target closed this connection (admission limits): its choice

                async with trio.open_nursery() as nursery:
                    for _ in range(s.half_records):
                        nursery.start_soon(one)
                await trio.sleep(s.hold_s)
                if await legit_ping(target.address) is None:
                    out.degraded = True
                    out.notes.append("legit ping failed while records were held")
                memory.sample()
                growth = (memory.last_kb - memory.baseline_kb) / 1024
                out.notes.append(f"{len(peers)} conns; held +{growth:.0f} MiB = {growth / max(1, len(peers)):.1f}/conn")
                if refused[0]:
                    out.notes.append(f"{refused[0]} connections closed by the target")
            finally:
                await close_all(peers)
        await trio.sleep(0.2)

    async def case_credit_overshoot(self, out: Outcome) -> None:
        s = self.settings
        target = await self.training()
        await self._wait_for_progress(target, out)
        peers: list[RawPeer] = []
        async with self.watch(target, out) as memory:
            try:
                closed = [0]
                async with trio.open_nursery() as readers:

                    async def overshoot() -> None:
                        try:
                            await overshoot_once()
                        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                            closed[0] += 1  # the target refused the overshoot by closing the connection

                    async def overshoot_once() -> None:
                        peer = await RawPeer.connect(target.address)
                        peers.append(peer)
                        readers.start_soon(peer.read_replies)
                        # A reducer's handler reads the header, then waits (5 s) for a session
                        # that never comes: everything after the header sits in its queue.
                        await peer.send([1, 1, "avg.reduce", None])
                        first = packb([2, 1, {"group_id": b"\x01" * 16, "weight": 1.0, "total": 1}, 0])
                        await peer.channel.send_record(first)
                        used = len(first)
                        filler = packb([2, 1, {"part": 0}, 0])
                        size = STREAM_WINDOW - used - len(filler) - 64  # leaves the window ~64 bytes open
                        header = packb([2, 1, {"part": 0}, size])
                        await peer.channel.send_record(header)
                        await peer.send_payload(size, memory)
                        # Credit is still positive: one more message is allowed, of any size.
                        await peer.send([2, 1, {"part": 1}, s.overshoot_payload])
                        await peer.send_payload(s.overshoot_payload, memory)

                    async with trio.open_nursery() as nursery:
                        for _ in range(s.overshoot_streams):
                            nursery.start_soon(overshoot)
                    await trio.sleep(min(s.hold_s, 1.5))  # within the handler's 5 s session wait
                    if await legit_ping(target.address) is None:
                        out.degraded = True
                        out.notes.append("legit ping failed during the overshoot")
                    readers.cancel_scope.cancel()
                errors = [r for peer in peers for r in peer.received if isinstance(r, list) and r[:1] == [4]]
                total = s.overshoot_streams * (STREAM_WINDOW + s.overshoot_payload) // MIB
                out.notes.append(
                    f"{len(peers)} streams x (16 MiB window + {s.overshoot_payload // MIB} MiB) = {total} MiB"
                )
                if errors:
                    out.notes.append(f"target answered {errors[0][2]}: {str(errors[0][3])[:60]}")
                if closed[0]:
                    out.notes.append(f"{closed[0]} of {s.overshoot_streams} connections closed by the target")
            finally:
                await close_all(peers)

    # ------------------------------------------------------------------ 3. admission
    async def case_idle_flood(self, out: Outcome) -> None:
        s = self.settings
        target = await self.bootstrap()
        counts = {"opened": 0, "dropped": 0, "refused": 0, "held": 0}
        held: set[trio.SocketStream] = set()

        async def holder() -> None:
            while True:
                try:
                    stream = await trio.open_tcp_stream(
                        target.address.host, target.address.port, local_address=ATTACKER_HOST
                    )
                except OSError:
                    counts["refused"] += 1
                    await trio.sleep(s.refill_delay_s)
                    continue
                counts["opened"] += 1
                held.add(stream)
                try:
                    while await stream.receive_some(4096):  # never a byte sent: just hold the slot
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                finally:
                    held.discard(stream)
                    await trio.aclose_forcefully(stream)
                counts["dropped"] += 1
                await trio.sleep(s.refill_delay_s)  # refill

        async with self.watch(target, out):
            try:
                async with trio.open_nursery() as nursery:
                    for _ in range(s.idle_connections):
                        nursery.start_soon(holder)
                    with trio.move_on_after(5.0):
                        while counts["opened"] < s.idle_connections:
                            await trio.sleep(0.05)
                    opened_first = counts["opened"]
                    seconds, attempts = await legit_join(target.address, s.flood_join_deadline_s)
                    counts["held"] = len(held)
                    if await fetch_status(target.status_port) is None and target.running:
                        out.notes.append("status endpoint silent during the flood")
                    nursery.cancel_scope.cancel()
            finally:
                await close_all(list(held))
        joined = seconds is not None
        self.figures["legit_join_s_under_flood"] = round(seconds if joined else s.flood_join_deadline_s, 2)
        self.figures["legit_joined_under_flood"] = joined
        if not joined:
            out.degraded = True
            out.notes.append(f"legit peer not in after {s.flood_join_deadline_s:.0f} s ({attempts} tries)")
        else:
            out.notes.append(f"legit peer in after {seconds:.2f} s ({attempts} tries)")
        out.notes.append(
            f"{opened_first} idle conns up in 5 s; {counts['dropped']} dropped by target and refilled; "
            f"{counts['held']} held at the end"
        )

    async def case_connection_burst(self, out: Outcome) -> None:
        s = self.settings
        target = await self.bootstrap()
        counts = {"ok": 0, "failed": 0}
        limiter = trio.CapacityLimiter(200)

        async def quick() -> None:
            async with limiter:
                try:
                    stream = await trio.open_tcp_stream(
                        target.address.host, target.address.port, local_address=ATTACKER_HOST
                    )
                except OSError:
                    counts["failed"] += 1
                    return
                try:
                    # A plausible first Noise message: the target does key agreement and signs.
                    await stream.send_all(HEADER.pack(32) + os.urandom(32))
                    counts["ok"] += 1
                except (trio.BrokenResourceError, OSError):
                    counts["failed"] += 1
                finally:
                    await trio.aclose_forcefully(stream)

        result: dict[str, Any] = {}

        async def join_during() -> None:
            await trio.sleep(0.05)
            result["join"] = await legit_join(target.address, s.flood_join_deadline_s)

        async with self.watch(target, out):
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(join_during)
                async with trio.open_nursery() as burst:
                    for _ in range(s.burst_connections):
                        burst.start_soon(quick)
                result["burst_s"] = trio.current_time() - start
        seconds, attempts = result.get("join", (None, 0))
        out.notes.append(f"{counts['ok']} quick conns in {result['burst_s']:.1f} s ({counts['failed']} failed)")
        if seconds is None:
            out.degraded = True
            out.notes.append(f"legit peer not in during the burst ({attempts} tries)")
        else:
            out.notes.append(f"legit join during burst {seconds:.2f} s")
        self.figures["legit_join_s_under_burst"] = round(seconds, 2) if seconds is not None else None

    # ------------------------------------------------------------------ 4. records
    async def case_forge_matchmaking(self, out: Outcome) -> None:
        target = await self.bootstrap()
        key = pack(f"{RUN_ID}.digits.grads.matchmaking")
        owner, attacker = Identity.generate(), Identity.generate()

        def declaration(bandwidth: float, address: str | None, mode: str) -> bytes:
            return pack({"address": address, "bandwidth": bandwidth, "mode": mode, "schema": "s", "round": 1})

        honest = declaration(0.0, None, "client")
        forged = declaration(1e9, f"{ATTACKER_HOST}:9/{attacker.peer_id}", "node")
        async with self.watch(target, out):
            address = PeerAddress(target.address.host, target.address.port)
            async with open_peer_host(owner, listen=None, run_id=RUN_ID) as owner_host:
                async with open_peer_host(attacker, listen=None, run_id=RUN_ID) as attacker_host:
                    owner_conn = await owner_host.connect(address)
                    attacker_conn = await attacker_host.connect(address)
                    first = await owner_store(owner_conn, owner, key, honest, 10)
                    # 300 s: the matchmaking cap (dht/lifetimes.py), a little less for the clock
                    took, plain = await forge_both_layouts(attacker_conn, key, owner, attacker, forged, 290)
                    again = await owner_store(owner_conn, owner, key, honest, 10)
                    found = await dht_read_as_peers_do(owner_conn, key)
        read = dict(peer_entries(found, Declaration.from_wire))
        mine = read.get(owner.peer_id)
        returned = any(declaration.bandwidth == 1e9 for declaration in read.values())
        if took or returned or not again:
            out.forgeries += 1
        out.notes.append(
            f"owner store {'ok' if first else 'refused'}; forged stores under the owner's signed subkey "
            f"{'ACCEPTED' if took else 'refused'}, under its plain peer ID {'accepted' if plain else 'refused'} "
            f"(no reader looks there); owner re-store {'ok' if again else 'REFUSED'}; "
            f"readers see {'the FORGED' if returned else 'the owner' if mine else 'no'} declaration"
        )

    async def case_store_flood(self, out: Outcome) -> None:
        """All but the last two requests carry 12 records of 64 KiB that live 24 h (more than the
        node's byte cap); the last two top up the remaining bytes with records of halving sizes
        that expire a little sooner (so they never evict the big ones, and fit or are refused).
        Then an honest peer stores a 15 s progress record, as a training peer does every second."""
        s = self.settings
        target = await self.bootstrap()
        big = pack(bytes(65_000))  # just under the 64 KiB value limit
        fillers = [pack(bytes(1 << j)) for j in range(15, -1, -1)]
        accepted = total = 0
        accepted_bytes = 0
        address = PeerAddress(target.address.host, target.address.port)
        async with self.watch(target, out) as memory:
            async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as attacker:
                connection = await attacker.connect(address)
                top_up = [fillers[: len(fillers) // 2], fillers[len(fillers) // 2 :]]
                # One expiration for every filler: a filler never evicts another (ties are refused).
                filler_expiration = time.time() + MAX_TTL - 600
                for request in range(s.store_requests):
                    memory.sample()
                    if memory.over_safety_limit:
                        break
                    now = time.time()
                    if request < s.store_requests - len(top_up):
                        values, expiration = [big] * wire.MAX_RECORDS_PER_STORE, now + MAX_TTL
                    else:
                        values, expiration = top_up[request - s.store_requests], filler_expiration
                    body = [[pack(f"junk.{request}.{i}"), None, v, expiration] for i, v in enumerate(values)]
                    reply = await connection.call("dht.store", body, timeout=30)
                    total += len(body)
                    if isinstance(reply.body, list):
                        for record, ok in zip(body, reply.body, strict=False):
                            if ok is True:
                                accepted += 1
                                accepted_bytes += len(record[0]) + len(record[2])
            honest_identity = Identity.generate()
            async with open_peer_host(honest_identity, listen=None, run_id=RUN_ID) as honest:
                connection = await honest.connect(address)
                small = pack({"epoch": 0, "samples": 32, "sps": 10.0})
                # signed under its own marked subkey, as a training peer's progress is
                stored = await owner_store(connection, honest_identity, pack(f"{RUN_ID}.digits.progress"), small, 15)
        out.notes.append(
            f"{accepted}/{total} 24 h junk records accepted ({accepted_bytes / MIB:.0f} MiB sent into a 64 MiB store)"
        )
        if not stored:
            out.degraded = True
            out.notes.append("honest 15 s progress store REFUSED afterwards")
        else:
            out.notes.append("honest 15 s progress store accepted afterwards")

    async def _wait_for_progress(self, target: Target, out: Outcome, timeout: float = 90.0) -> PeerProgress | None:
        """Wait until the training target has published its progress record; what readers see of it."""
        key = pack(f"{RUN_ID}.digits.progress")
        address = PeerAddress(target.address.host, target.address.port)
        with trio.move_on_after(timeout):
            async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as reader:
                while target.running:
                    try:
                        connection = await reader.connect(address)
                        found = progress_records(await dht_read_as_peers_do(connection, key))
                        if target.identity.peer_id in found:
                            return found[target.identity.peer_id]
                    except Exception:
                        pass
                    await trio.sleep(0.5)
        out.notes.append("training target published no progress record")
        return None

    async def case_forge_progress(self, out: Outcome) -> None:
        target = await self.training()
        before = await self._wait_for_progress(target, out)
        key = pack(f"{RUN_ID}.digits.progress")
        forged = pack({"epoch": 1_000_000, "samples": 0, "sps": 0.0})
        address = PeerAddress(target.address.host, target.address.port)
        async with self.watch(target, out):
            attacker = Identity.generate()
            async with open_peer_host(attacker, listen=None, run_id=RUN_ID) as attacker_host:
                connection = await attacker_host.connect(address)
                # 60 s: the progress cap (dht/lifetimes.py), a little less for the clock
                took, plain = await forge_both_layouts(connection, key, target.identity, attacker, forged, 55)
            await trio.sleep(3.0)  # the owner republishes its progress about every second meanwhile
            async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as reader:
                connection = await reader.connect(address)
                read = progress_records(await dht_read_as_peers_do(connection, key))
        mine = read.get(target.identity.peer_id)
        returned = any(progress.epoch == 1_000_000 for progress in read.values())
        if took or returned:
            out.forgeries += 1
        seen = "FORGED" if returned else "the owner's" if mine else "no"
        out.notes.append(
            f"owner record {'seen' if before else 'missing'}; forged stores under the owner's signed subkey "
            f"{'ACCEPTED' if took else 'refused'}, under its plain peer ID {'accepted' if plain else 'refused'} "
            f"(no reader looks there); 3 s later readers see {seen} progress for the owner"
        )

    # ------------------------------------------------------------------ 5. Sybil placement
    async def case_sybil_placement(self, out: Outcome) -> None:
        out.info_only = True
        s = self.settings
        result = await trio.to_thread.run_sync(sybil_measurement, s.sybil_swarm_n, s.sybil_time_cap_s, DIFFICULTY)
        free = await trio.to_thread.run_sync(free_id_rate, 1.0)
        n = s.sybil_swarm_n
        public_rate = result["hash_rate"] / 2**DEFAULT_DIFFICULTY  # IDs/s that pass a public run's puzzle
        public_s = (n + 1) / public_rate  # n + 1 candidates for 20 hits (see sybil_measurement)
        self.figures.update(
            sybil_ids_per_s=round(result["rate"], 1),
            sybil_20_ids_s=round(result["seconds"], 3),
            sybil_difficulty=DIFFICULTY,
            sybil_public_difficulty=DEFAULT_DIFFICULTY,
            sybil_public_ids_per_s=round(public_rate, 4),
            sybil_public_20_ids_s=round(public_s),
            sybil_free_ids_per_s=round(free),
            sybil_swarm_n=n,
        )
        how = "measured" if result["measured"] else "estimated (cap hit)"
        out.notes.append(f"baseline: {free:.0f} free IDs/s (key pairs) on one core")
        out.notes.append(
            f"difficulty {DIFFICULTY}: {result['rate']:.0f} IDs/s pass the puzzle ({result['candidates']} solved, "
            f"{result['hash_rate'] / 1e6:.2f} M hashes/s); 20 IDs nearer than the 20 nearest of {n}: "
            f"{result['seconds']:.2f} s ({how})"
        )
        estimates = ", ".join(f"N={m:.0e}: {(m + 1) / public_rate / 3600:.1f} h" for m in (1e3, 1e4, 1e6))
        out.notes.append(
            f"difficulty {DEFAULT_DIFFICULTY} (public): {public_rate:.3f} IDs/s; 20 IDs near a key among N "
            f"(estimate (N+1)/rate): {estimates}"
        )


def progress_records(found: DHTValue | None) -> dict:
    """Progress per peer, parsed as every training peer parses it."""
    return dict(peer_entries(found, lambda peer, body: PeerProgress.from_wire(body)))


def sybil_measurement(n: int, cap_s: float, difficulty: int) -> dict[str, Any]:
    """Grind node IDs the cheapest way the puzzle allows (one key, successive solutions at
    ``difficulty``, each a uniformly placed node ID) until 20 lie nearer to a random key than the
    20th nearest of ``n`` honest IDs; the hash rate gives the cost at any other difficulty."""
    rng = random.Random(1)
    target = rng.getrandbits(160)
    honest = sorted(rng.getrandbits(160) ^ target for _ in range(n))
    bound = honest[19]
    peer_id = Identity.generate().peer_id
    start = time.perf_counter()
    placed = solutions = nonce = 0
    while placed < 20 and time.perf_counter() - start < cap_s:
        proof = NodeIDProof.solve(peer_id, difficulty, start=nonce)
        nonce = int.from_bytes(proof.nonce, "little") + 1
        solutions += 1
        if int.from_bytes(proof.node_id, "big") ^ target < bound:
            placed += 1
    elapsed = time.perf_counter() - start
    rate, hash_rate = solutions / elapsed, nonce / elapsed
    if placed >= 20:
        return {"rate": rate, "hash_rate": hash_rate, "seconds": elapsed, "measured": True, "candidates": solutions}
    # Expected candidates for 20 hits when each hits with probability 20/(n+1): n + 1.
    seconds = (n + 1) / rate
    return {"rate": rate, "hash_rate": hash_rate, "seconds": seconds, "measured": False, "candidates": solutions}


def free_id_rate(seconds: float) -> float:
    """Peer IDs (key pairs and their hash) per second on one core: what a DHT position cost when
    the DHT placed peers by peer ID."""
    start = time.perf_counter()
    count = 0
    while time.perf_counter() - start < seconds:
        Identity.generate().peer_id.to_int()
        count += 1
    return count / (time.perf_counter() - start)


# ---------------------------------------------------------------------- driver
CASES = [
    ("remote_crash", "case_remote_crash"),
    ("stalled_payloads", "case_stalled_payloads"),
    ("half_sent_records", "case_half_sent_records"),
    ("idle_flood", "case_idle_flood"),
    ("connection_burst", "case_connection_burst"),
    ("forge_matchmaking", "case_forge_matchmaking"),
    ("store_flood", "case_store_flood"),
    ("credit_overshoot", "case_credit_overshoot"),
    ("forge_progress", "case_forge_progress"),
    ("sybil_placement", "case_sybil_placement"),
]


async def run_cases(bench: Bench, names: list[str], outcomes: list[Outcome]) -> None:
    for name, method in CASES:
        if names and name not in names:
            continue
        out = Outcome(name)
        outcomes.append(out)
        started = time.monotonic()
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            with trio.move_on_after(bench.settings.case_timeout_s) as scope:
                await getattr(bench, method)(out)
            if scope.cancelled_caught:
                out.error = f"case ran past {bench.settings.case_timeout_s:.0f} s"
        except Exception as error:  # a failure of the benchmark's own, reported, never raised
            out.error = _describe(error)
        except BaseException:  # Ctrl-C or SIGTERM: the case is cut short; cleanup runs on the way out
            out.error = "interrupted"
            raise
        print(f"[{name}] {out.result} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        if name == "store_flood" and bench._bootstrap is not None:
            bench._bootstrap.stop()  # its store is full of junk now; nothing later needs it
            bench._bootstrap = None


async def main_async(settings: Settings, names: list[str], outcomes: list[Outcome], bench: Bench) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    print(f"hostile: received {signal.Signals(signum).name}; cleaning up", file=sys.stderr)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_signal)
            await run_cases(bench, names, outcomes)
            nursery.cancel_scope.cancel()


def print_report(outcomes: list[Outcome], figures: dict[str, Any], settings: Settings, wall: float) -> None:
    rows = [("case", "result", "rss MiB", "notes")]
    for out in outcomes:
        error = [f"benchmark error: {out.error}"] if out.error else []
        notes = "; ".join(error + out.notes + ([out.rss_note] if out.rss_note else []))
        rows.append((out.case, out.result, f"{out.rss_growth_mb:.0f}", notes))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
    failed = [out.case for out in outcomes if out.result in ("FAIL", "ERROR")]
    print(f"\nfailing cases: {', '.join(failed) if failed else 'none'}")
    summary = {
        "benchmark": "hostile",
        "quick": settings.quick,
        "cases": len(outcomes),
        "crashes": sum(out.crashed for out in outcomes),
        "degraded": sum(out.degraded for out in outcomes),
        "accepted_forgeries": sum(out.forgeries for out in outcomes),
        "max_rss_growth_mb": round(max((out.rss_growth_mb for out in outcomes), default=0.0), 1),
        "legit_join_s_under_flood": figures.get("legit_join_s_under_flood"),
        "legit_joined_under_flood": figures.get("legit_joined_under_flood"),
        "legit_join_s_under_burst": figures.get("legit_join_s_under_burst"),
        "sybil_20_ids_s": figures.get("sybil_20_ids_s"),
        "sybil_swarm_n": figures.get("sybil_swarm_n"),
        "sybil_ids_per_s": figures.get("sybil_ids_per_s"),
        "sybil_difficulty": figures.get("sybil_difficulty"),
        "sybil_public_difficulty": figures.get("sybil_public_difficulty"),
        "sybil_public_ids_per_s": figures.get("sybil_public_ids_per_s"),
        "sybil_public_20_ids_s": figures.get("sybil_public_20_ids_s"),
        "sybil_free_ids_per_s": figures.get("sybil_free_ids_per_s"),
        "errors": sum(out.error is not None for out in outcomes),
        "failed_cases": failed,
        "wall_s": round(wall, 1),
    }
    print(json.dumps(summary), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the issue's sizes, short holds (within 180 s)")
    parser.add_argument("--case", action="append", default=[], choices=[name for name, _ in CASES])
    args = parser.parse_args(argv)
    settings = Settings.make(args.quick)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peerd-hostile-") as workdir:
        bench = Bench(settings, Path(workdir))
        try:
            trio.run(main_async, settings, args.case, outcomes, bench)
        except BaseException as error:
            # trio may deliver Ctrl-C wrapped in an exception group; anything else is re-raised
            interrupted = isinstance(error, KeyboardInterrupt) or (
                isinstance(error, BaseExceptionGroup) and error.split(KeyboardInterrupt)[1] is None
            )
            if not interrupted:
                raise
            print("hostile: interrupted; cleaning up", file=sys.stderr)
        finally:
            bench.stop_all()
            _reap_all()
    print_report(outcomes, bench.figures, settings, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
