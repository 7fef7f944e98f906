"""Attack 1, remote crash: a fake DHT peer, the target's initial peer, answers ``dht.find`` with
contacts that all share one host:port (a second listener of the attacker's)."""

from __future__ import annotations

import os

import trio

from peer import Identity, Message, PeerAddress, Router, open_peer_host

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
