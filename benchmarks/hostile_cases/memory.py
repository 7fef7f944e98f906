"""Attacks on the target's memory: payloads announced and never finished, transport records left
half sent, and stream data past the granted credit window."""

from __future__ import annotations

import trio

from peer.framing import HEADER, MAX_RECORD_SIZE
from peer.rpc_protocol import STREAM_WINDOW, packb

from .attacker import RawPeer, close_all
from .bench import Bench, Outcome
from .target import MIB, legit_ping


async def stalled_payloads(bench: Bench, out: Outcome) -> None:
    s = bench.settings
    target = await bench.bootstrap()
    peers: list[RawPeer] = []
    async with bench.watch(target, out) as memory:
        try:
            for _ in range(s.memory.stalled_calls):
                if memory.over_safety_limit:
                    break
                peer = await RawPeer.connect(target.address)
                peers.append(peer)
                await peer.send([7, 1, "peer.ping", None, None, s.memory.stalled_payload])  # UNARY, huge payload
                await peer.send_payload(MIB)  # the first MiB, then silence
            await trio.sleep(s.hold_s)
            during = await legit_ping(target.address)
            if during is None:
                out.degraded = True
                out.notes.append("legit ping failed during the stall")
            out.notes.append(f"{len(peers)} x {s.memory.stalled_payload // MIB} MiB announced, 1 MiB sent each")
            memory.sample()
            out.notes.append(f"rss held +{(memory.last_kb - memory.baseline_kb) / 1024:.0f} MiB")
        finally:
            await close_all(peers)
    await trio.sleep(0.2)


async def half_sent_records(bench: Bench, out: Outcome) -> None:
    s = bench.settings
    target = await bench.bootstrap()
    peers: list[RawPeer] = []
    half = bytes(MAX_RECORD_SIZE // 2)
    async with bench.watch(target, out) as memory:
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
                for _ in range(s.memory.half_records):
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


async def credit_overshoot(bench: Bench, out: Outcome) -> None:
    s = bench.settings
    target = await bench.training()
    await bench.wait_for_progress(target, out)
    peers: list[RawPeer] = []
    async with bench.watch(target, out) as memory:
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
                    await peer.send([1, 1, "avg.reduce", None, STREAM_WINDOW])  # OPEN: the largest we accept back
                    first = packb([2, 1, {"group_id": b"\x01" * 16, "weight": 1.0, "total": 1}, 0])
                    await peer.channel.send_record(first)
                    used = len(first)
                    filler = packb([2, 1, {"part": 0}, 0])
                    size = STREAM_WINDOW - used - len(filler) - 64  # leaves the window ~64 bytes open
                    header = packb([2, 1, {"part": 0}, size])
                    await peer.channel.send_record(header)
                    await peer.send_payload(size, memory)
                    # Credit is still positive: one more message is allowed, of any size.
                    await peer.send([2, 1, {"part": 1}, s.memory.overshoot_payload])
                    await peer.send_payload(s.memory.overshoot_payload, memory)

                async with trio.open_nursery() as nursery:
                    for _ in range(s.memory.overshoot_streams):
                        nursery.start_soon(overshoot)
                await trio.sleep(min(s.hold_s, 1.5))  # within the handler's 5 s session wait
                if await legit_ping(target.address) is None:
                    out.degraded = True
                    out.notes.append("legit ping failed during the overshoot")
                readers.cancel_scope.cancel()
            errors = [r for peer in peers for r in peer.received if isinstance(r, list) and r[:1] == [4]]
            total = s.memory.overshoot_streams * (STREAM_WINDOW + s.memory.overshoot_payload) // MIB
            extra = s.memory.overshoot_payload // MIB
            out.notes.append(f"{len(peers)} streams x (16 MiB window + {extra} MiB) = {total} MiB")
            if errors:
                out.notes.append(f"target answered {errors[0][2]}: {str(errors[0][3])[:60]}")
            if closed[0]:
                out.notes.append(f"{closed[0]} of {s.memory.overshoot_streams} connections closed by the target")
        finally:
            await close_all(peers)
