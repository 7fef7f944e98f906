"""Contacts from other peers are claims: a contact list naming one endpoint many times, with
identities that endpoint does not have, costs the lookup those contacts and nothing else."""

from __future__ import annotations

import socket
import time

import trio

from dht import DHTConfig, DHTNode
from peer import ConnectError, Identity, PeerAddress, Router, open_peer_host


async def test_concurrent_dials_of_one_endpoint_with_different_identities_fail_alone() -> None:
    """Each pinned identity that the endpoint does not have gets its own ConnectError; an unpinned
    dial of the same endpoint in the same moment succeeds."""
    async with (
        open_peer_host(Identity.generate(), run_id="r") as server,
        open_peer_host(Identity.generate(), listen=None, run_id="r") as client,
    ):
        endpoint = server.listen_address
        outcomes: list[str] = []

        async def dial(peer_id) -> None:
            try:
                connection = await client.connect(PeerAddress(endpoint.host, endpoint.port, peer_id))
                outcomes.append(str(connection.remote_peer_id))
            except ConnectError as error:
                outcomes.append("mismatch" if "mismatch" in str(error) else f"other: {error}")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(dial, Identity.generate().peer_id)
                for _ in range(4):
                    nursery.start_soon(dial, None)
        assert sorted(outcomes) == sorted(["mismatch"] * 4 + [str(server.peer_id)] * 4)


def serve_lying_finds(router: Router, endpoint: tuple[str, int], fake_contacts: int) -> None:
    """Make ``router`` a DHT peer whose every find reply lists ``fake_contacts`` made-up
    identities, all at ``endpoint``."""
    fakes = [[Identity.generate().peer_id.to_bytes(), endpoint[0], endpoint[1]] for _ in range(fake_contacts)]

    @router.unary("dht.find")
    async def find(request):
        return fakes

    @router.unary("dht.ping")
    async def ping(request):
        return None


async def test_a_find_reply_listing_one_endpoint_many_times_does_not_crash_the_lookup() -> None:
    """The attack that killed training peers: the reply's contacts all point at one endpoint where
    nobody answers, under made-up identities, so the lookup's parallel dials race to it."""
    async with trio.open_nursery() as nursery:
        liar_address = await nursery.start(_run_liar)
        config = DHTConfig(bootstrap_timeout=5)
        with trio.fail_after(30):
            async with DHTNode.open(initial_peers=[liar_address], config=config) as victim:
                assert await victim.get("some key") is None
                await victim.store("some key", "value", time.time() + 60)  # returns, whatever it says
        nursery.cancel_scope.cancel()


def closed_port() -> int:
    """A port on 127.0.0.1 that refuses connections (bound once, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _run_liar(task_status=trio.TASK_STATUS_IGNORED) -> None:
    router = Router()
    async with open_peer_host(Identity.generate(), router=router) as liar:
        address = liar.listen_address
        serve_lying_finds(router, ("127.0.0.1", closed_port()), 6)
        task_status.started(address)
        await trio.sleep_forever()
