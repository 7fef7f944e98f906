"""What dropped a peer or its connections: a fake DHT peer, the target's initial peer, answering
``dht.find`` with contacts that all share one host:port (a second listener of the attacker's), and
calls whose payload is empty (``b""``), which the receiver took for an undecodable header."""

from __future__ import annotations

import os

import trio

from peer import Identity, Message, PeerAddress, Router, open_peer_host
from peer.rpc_protocol import unpackb

from .attacker import RawPeer, close_all
from .bench import Bench, Outcome
from .target import RUN_ID


async def remote_crash(bench: Bench, out: Outcome) -> None:
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
        target = await bench.start_target("crash", ["--initial-peer", endpoint, "--bootstrap-timeout", "5"])
        try:
            if target.address is None:  # it may die before printing its status line
                out.notes.append("target printed no listen address")
            async with bench.watch(target, out, check_after=False):
                with trio.move_on_after(10.0 if bench.settings.quick else 20.0):
                    while target.running:
                        await trio.sleep(0.1)
            out.notes.append(f"{answered['find']} find replies with {duplicates} contacts at {listed}")
            if target.running and target.address is not None:
                await bench.check_alive(target, out, "after")
            else:
                out.crashed = True
                out.notes.append(f"target {target.exit_note()}")
        finally:
            target.stop()


async def empty_payloads(bench: Bench, out: Outcome) -> None:
    """Calls with an empty payload over one connection, as an honest peer's library sends them
    (``b""``, ``bytearray()``, ``memoryview(b"")``: a lone small call takes the send queue's fast
    path, which sealed an empty record after the header, and the receiver dropped the whole
    connection), each followed by a call with a payload; then the call written by hand (a header
    announcing 0 bytes and nothing after it) on a connection of its own."""
    target = await bench.bootstrap()
    address = PeerAddress(target.address.host, target.address.port)
    rounds, answered, failures, raw_answered = 5, 0, [], 0
    async with bench.watch(target, out):
        async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as caller:
            connection = await caller.connect(address)
            for _ in range(rounds):
                for payload in (b"", bytearray(), memoryview(b""), b"x"):
                    try:
                        reply = await connection.call("peer.ping", payload=payload, timeout=5)
                        answered += isinstance(reply.body, dict) and "peer_id" in reply.body
                    except Exception as error:  # a dropped connection fails every call after it
                        failures.append(type(error).__name__)
                    await trio.sleep(0.01)  # the writer idles again: the next call takes the fast path
            kept = not connection.is_closed
        raw = await RawPeer.connect(target.address)
        try:
            with trio.move_on_after(5):
                for call_id in (1, 3, 5):
                    await raw.send([7, call_id, "peer.ping", None, None, 0])
                    header = unpackb(await raw.channel.receive_record())
                    raw_answered += isinstance(header, list) and header[:2] == [8, call_id]
        finally:
            await close_all([raw])
    out.notes.append(
        f"{4 * rounds} pings over one connection, {3 * rounds} with an empty payload: {answered} answered, "
        f"connection {'kept' if kept else 'DROPPED'}; by hand, 0-byte payloads: {raw_answered} of 3 answered"
    )
    if failures or not kept or raw_answered < 3:
        out.degraded = True
        out.notes.append(f"failed calls: {', '.join(sorted(set(failures))) or 'none'}")
