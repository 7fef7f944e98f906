"""Attacks on admission, all from one address: idle connections that never handshake (held open and
refilled), a burst of quick connections that each cost the target a first Noise step, and idle
connections that hold the status port."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import trio

from peer.framing import HEADER

from .attacker import close_all
from .bench import Bench, Outcome
from .target import ATTACKER_HOST, ROOT, fetch_status, legit_join

STATUS_QUERIES = 3  # `peerd status` runs, each with a GET /status beside it, while the flood is held


async def idle_flood(bench: Bench, out: Outcome) -> None:
    s = bench.settings
    target = await bench.bootstrap()
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

    async with bench.watch(target, out):
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
    bench.figures["legit_join_s_under_flood"] = round(seconds if joined else s.flood_join_deadline_s, 2)
    bench.figures["legit_joined_under_flood"] = joined
    if not joined:
        out.degraded = True
        out.notes.append(f"legit peer not in after {s.flood_join_deadline_s:.0f} s ({attempts} tries)")
    else:
        out.notes.append(f"legit peer in after {seconds:.2f} s ({attempts} tries)")
    out.notes.append(
        f"{opened_first} idle conns up in 5 s; {counts['dropped']} dropped by target and refilled; "
        f"{counts['held']} held at the end"
    )


async def connection_burst(bench: Bench, out: Outcome) -> None:
    s = bench.settings
    target = await bench.bootstrap()
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

    async with bench.watch(target, out):
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
    bench.figures["legit_join_s_under_burst"] = round(seconds, 2) if seconds is not None else None


async def status_flood(bench: Bench, out: Outcome) -> None:
    """Idle connections to the status port (the issue's 1,500, held open and refilled), while the
    operator runs ``peerd status`` and a monitor GETs /status from loopback: every place held by
    the flood used to tell them 503 for as long as it was held."""
    s = bench.settings
    target = await bench.bootstrap()
    counts = {"opened": 0, "closed": 0, "told": 0, "refused": 0, "held": 0}
    held: set[trio.SocketStream] = set()

    async def holder() -> None:
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", target.status_port, local_address=ATTACKER_HOST)
            except OSError:
                counts["refused"] += 1
                await trio.sleep(s.refill_delay_s)
                continue
            counts["opened"] += 1
            held.add(stream)
            try:
                if await stream.receive_some(4096):  # never a request: an answer is a refusal (503)
                    counts["told"] += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                held.discard(stream)
                await trio.aclose_forcefully(stream)
            counts["closed"] += 1
            await trio.sleep(s.refill_delay_s)

    answers: list[bool] = []
    async with bench.watch(target, out):
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(s.status_connections):
                    nursery.start_soon(holder)
                with trio.move_on_after(10.0):
                    while counts["opened"] < s.status_connections:
                        await trio.sleep(0.05)
                opened_first = counts["opened"]
                for _ in range(STATUS_QUERIES):
                    answers.append(await _peerd_status(target.status_port))
                    answers.append(await fetch_status(target.status_port) is not None)
                counts["held"] = len(held)
                nursery.cancel_scope.cancel()
        finally:
            await close_all(list(held))
    ok = sum(answers)
    out.notes.append(
        f"{opened_first} idle conns to the status port up; {counts['closed']} closed by the target "
        f"({counts['told']} told 503), {counts['held']} held at the end; `peerd status` and GET /status "
        f"answered {ok} of {len(answers)}"
    )
    if ok < len(answers):
        out.degraded = True


async def _peerd_status(port: int) -> bool:
    """``peerd status --json`` as the operator runs it: whether it printed the peer's status."""
    command = [sys.executable, "-m", "peerd.cli", "status", "--status-port", str(port), "--json"]
    with trio.move_on_after(30):
        done = await trio.run_process(command, cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False)
        try:
            return done.returncode == 0 and "peer_id" in json.loads(done.stdout)
        except ValueError:
            return False
    return False
