"""The benchmark's frame: the run's sizes (``Settings``), one case's result (``Outcome``), and
``Bench``, which starts the shared targets and watches each attack's memory and aftermath."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from averaging.progress import PeerProgress
from dht.records import pack
from peer import Identity, PeerAddress, open_peer_host

from .attacker import dht_read_as_peers_do, progress_records
from .target import MIB, RSS_LIMIT_MB, RUN_ID, MemoryWatch, Target, fetch_status, legit_ping, read_memory_kb

# The expert the expert target hosts, of the width the attack used (4096 x 256 inputs).
EXPERT_UID = "ffn.0.0"
EXPERT_WIDTH = 256
# A target is attacked once its memory has settled: it grew by less than this over SETTLE_S.
SETTLE_MIB = 2.0
SETTLE_S = 1.0
SETTLE_DEADLINE_S = 30.0


@dataclass
class MemorySizes:
    """What each attack on the target's memory sends."""

    stalled_calls: int = 4
    stalled_payload: int = 256 * MIB
    half_records: int = 100
    overshoot_streams: int = 4
    overshoot_payload: int = 64 * MIB
    unread_calls: int = 40  # the issue's: 40 finds of a 15 MiB dictionary
    unread_value: int = 15 * MIB
    oversized_streams: int = 4  # the issue's: four messages of 250 MiB (the full run's)
    oversized_payload: int = 128 * MIB
    graph_forwards: int = 32  # the issue's: 32 forwards of 4096 x 256
    graph_batch: int = 4096


@dataclass
class Settings:
    quick: bool
    memory: MemorySizes = field(default_factory=MemorySizes)
    idle_connections: int = 1000
    burst_connections: int = 2000
    status_connections: int = 1500  # the issue's: 1,500 held idle connections kept `peerd status` out
    store_requests: int = 100
    reflection_runs: int = 1  # `peerd dht store` and `get` pairs
    leader_rounds: int = 4
    pair_dim: int = 1 << 16
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
            memory=MemorySizes(half_records=250, overshoot_payload=128 * MIB, oversized_payload=250 * MIB),
            reflection_runs=3,
            leader_rounds=8,
            pair_dim=1 << 20,
            hold_s=6.0,
            flood_join_deadline_s=30.0,
            sybil_swarm_n=100_000,
            sybil_time_cap_s=60.0,
            case_timeout_s=120.0,
        )


@dataclass
class Outcome:
    case: str
    crashed: bool = False
    degraded: bool = False
    forgeries: int = 0
    rss_growth_mb: float = 0.0
    info_only: bool = False
    # Bounds the case checks beyond health (dials to a foreign endpoint, failed rounds, how far a
    # liar moved an honest peer), each as text saying which and by how much: any one fails the case.
    exceeded: list[str] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    rss_note: str = ""  # the target's RSS once the attack is over (is the memory given back?)

    @property
    def result(self) -> str:
        if self.error is not None:
            return "ERROR"
        if self.crashed or self.degraded or self.forgeries or self.exceeded or self.rss_growth_mb > RSS_LIMIT_MB:
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
        return what + [f"bound exceeded: {text}" for text in self.exceeded]


class Bench:
    def __init__(self, settings: Settings, workdir: Path):
        self.settings = settings
        self.workdir = workdir
        self.targets: list[Target] = []
        self._bootstrap: Target | None = None
        self._training: Target | None = None
        self._experts: Target | None = None
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
            await settle(target, training=True)
        return target

    async def experts(self) -> Target:
        """A target that also hosts one expert, ``ffn.0.0`` (an FFN of width ``graph_width``)."""
        target = self._experts
        if target is None or not target.running or target.address is None:
            if target is not None:
                target.stop()
            extra = ["--serve-experts", EXPERT_UID, "--hidden-dim", str(EXPERT_WIDTH), "--device", "cpu"]
            target = self._experts = await self.start_target("experts", extra)
            if target.address is None:
                raise RuntimeError(f"the expert target did not start: {target.exit_note()}")
            await settle(target)
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

    def drop_bootstrap(self) -> None:
        """Stop the shared bootstrap target; the next case that needs one starts a fresh one."""
        if self._bootstrap is not None:
            self._bootstrap.stop()
            self._bootstrap = None

    async def wait_for_progress(self, target: Target, out: Outcome, timeout: float = 90.0) -> PeerProgress | None:
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


async def settle(target: Target, *, training: bool = False) -> bool:
    """Wait until ``target`` has finished starting (a training target: it has trained on samples)
    and its memory has stopped growing, so that a case's baseline is not taken in the middle of
    its own start: a training peer publishes its progress before it loads its task, and it then
    grew by ~160 MiB (imports, data set, model, first steps) in the first seconds of the case that
    attacked it. False if it did not settle within ``SETTLE_DEADLINE_S``."""
    with trio.move_on_after(SETTLE_DEADLINE_S):
        while training and target.running:
            status = await fetch_status(target.status_port, timeout=2.0)
            if status is not None and (status.get("samples") or 0) > 0:
                break
            await trio.sleep(0.2)
        last = read_memory_kb(target.pid)
        while last is not None:
            await trio.sleep(SETTLE_S)
            now = read_memory_kb(target.pid)
            if now is None or now[0] - last[0] < SETTLE_MIB * 1024:
                return now is not None
            last = now
    return False
