"""Contact reflection: a DHT peer whose every ``dht.find`` answer names contacts at endpoints of the
attacker's choosing (valid node-ID proofs, fresh identities, each endpoint several times), so that
honest lookups dial someone else's service for it. The victim is the operator's own ``peerd dht
store`` and ``get`` with the liar among their initial peers (the issue's: one store and one get
dialled 5 named endpoints 15 times, and every lookup dialled them again)."""

from __future__ import annotations

import json
import sys
import time
from itertools import count

import trio

from dht.routing import Contact
from dht.wire import encode_contacts
from peer import Identity, NodeIDProof, PeerAddress, Router, open_peer_host

from .bench import Bench, Outcome
from .target import ATTACKER_HOST, DIFFICULTY, ROOT, RUN_ID

ENDPOINTS = 5  # foreign endpoints every reply names (the five)
NAMED_PER_ENDPOINT = 4  # identities a reply names at each endpoint
# Dials a foreign endpoint may cost one short-lived command: the first contact named there, after
# which the endpoint is known not to answer with the hello of the peer named at it (for 10 s).
DIALS_PER_COMMAND = 1


class CountingEndpoint:
    """Someone else's TCP service: counts the connections it accepts and closes each at once."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async def handler(stream: trio.SocketStream) -> None:
            self.accepted += 1
            await stream.aclose()

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(handler, listeners)


def _liar_router(endpoints: list[CountingEndpoint], answered: list[int]) -> Router:
    router = Router()
    minted = (NodeIDProof.solve(Identity.generate().peer_id, DIFFICULTY) for _ in count())

    @router.unary("dht.find")
    async def find(request) -> list:
        answered[0] += 1
        return encode_contacts(
            [
                Contact(proof, PeerAddress("127.0.0.1", endpoint.port, proof.peer_id))
                for endpoint in endpoints
                for proof in (next(minted) for _ in range(NAMED_PER_ENDPOINT))
            ]
        )

    @router.unary("dht.ping")
    async def ping(request) -> None:
        return None

    @router.unary("dht.store")
    async def store(request) -> list:
        return [True] * (len(request.body) if isinstance(request.body, list) else 1)

    return router


async def _peerd_dht(bench: Bench, liar: PeerAddress, *args: str) -> dict | None:
    """``peerd dht ARGS`` through the liar and the bootstrap target: its JSON, or None."""
    boot = await bench.bootstrap()
    command = [sys.executable, "-m", "peerd.cli", "dht", *args, "--initial-peer", f"{liar.host}:{liar.port}"]
    command += ["--initial-peer", f"{boot.address.host}:{boot.address.port}", "--run-id", RUN_ID]
    command += ["--node-id-difficulty", str(DIFFICULTY), "--identity", str(bench.workdir / "dht-client.key")]
    with trio.move_on_after(60):
        done = await trio.run_process(command, cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False)
        try:
            return json.loads(done.stdout) if done.returncode == 0 else None
        except ValueError:
            return None
    return None


async def contact_reflection(bench: Bench, out: Outcome) -> None:
    s = bench.settings
    target = await bench.bootstrap()
    endpoints = [CountingEndpoint() for _ in range(ENDPOINTS)]
    answered, worst, failed = [0], 0, []
    async with trio.open_nursery() as nursery:
        for endpoint in endpoints:
            await nursery.start(endpoint.serve)
        router = _liar_router(endpoints, answered)
        async with open_peer_host(Identity.generate(), router=router, listen=(ATTACKER_HOST, 0), run_id=RUN_ID) as liar:
            async with bench.watch(target, out):
                for run in range(s.reflection_runs):
                    key, value = f"reflection.{run}.{time.time()}", f"value {run}"
                    for args in (("store", key, json.dumps(value), "--ttl", "60"), ("get", key)):
                        before = [endpoint.accepted for endpoint in endpoints]
                        result = await _peerd_dht(bench, liar.listen_address, *args)
                        dials = [endpoint.accepted - b for endpoint, b in zip(endpoints, before, strict=True)]
                        worst = max(worst, *dials)
                        ok = result is not None and (result.get("stored") or result.get("value") == value)
                        if not ok:
                            failed.append(f"{args[0]} {result}")
        nursery.cancel_scope.cancel()
    commands = 2 * s.reflection_runs
    named = ENDPOINTS * NAMED_PER_ENDPOINT
    total = sum(endpoint.accepted for endpoint in endpoints)
    out.notes.append(
        f"{answered[0]} find replies each naming {named} contacts at {ENDPOINTS} endpoints; "
        f"{commands} `peerd dht` commands dialled them {total} times, at most {worst} per endpoint per command"
    )
    if answered[0] == 0:
        out.notes.append("the liar was never asked: the attack did not reach a lookup")
    if worst > DIALS_PER_COMMAND:
        out.exceeded.append(f"{worst} dials of one named endpoint by one command (bound {DIALS_PER_COMMAND})")
    if failed:
        out.degraded = True
        out.notes.append(f"failed: {'; '.join(failed)[:160]}")
