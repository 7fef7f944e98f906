"""Contacts from other peers are claims: a contact list naming one endpoint many times, with
identities that endpoint does not have, costs the lookup those contacts and nothing else."""

from __future__ import annotations

import contextlib
import socket
import time
from functools import partial

import pytest
import trio

from dht import DHTConfig, DHTNode
from dht.background import Background
from dht.contacts import Contacts
from dht.liveness import EVICT_AFTER_FAILURES
from dht.records import pack
from dht.routing import Contact, RoutingTable
from dht.testing import placed_contact
from dht.wire import encode_contacts
from peer import (
    LOCAL_DIFFICULTY,
    ConnectError,
    Identity,
    Message,
    NodeIDProof,
    PeerAddress,
    Router,
    TcpTransport,
    open_peer_host,
)


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


async def _run_liar(endpoint: tuple[str, int] | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A DHT peer whose find replies list contacts at ``endpoint`` (default: a closed port)."""
    router = Router()
    async with open_peer_host(Identity.generate(), router=router) as liar:
        address = liar.listen_address
        serve_lying_finds(router, endpoint or ("127.0.0.1", closed_port()), 6)
        task_status.started(address)
        await trio.sleep_forever()


@pytest.mark.parametrize("host", ["x..y", "a" * 64, "."])
async def test_a_contact_whose_host_cannot_be_encoded_is_a_failed_contact(host) -> None:
    """Host names that IDNA refuses made the dial raise UnicodeError (a ValueError, not an
    OSError) out of every lookup, and the poisoned contact was never evicted."""
    async with trio.open_nursery() as nursery:
        liar_address = await nursery.start(_run_liar, (host, 1234))
        with trio.fail_after(30):
            async with DHTNode.open(initial_peers=[liar_address], config=DHTConfig(bootstrap_timeout=5)) as victim:
                assert await victim.get("some key") is None
                assert await victim.get("some key") is None  # and again: nothing is left poisoned
        nursery.cancel_scope.cancel()


async def test_a_listen_address_that_cannot_be_dialed_does_not_poison_the_routing_table() -> None:
    """A caller's hello announces an unusable listen address, so the victim files it as a contact."""
    async with DHTNode.open() as victim:
        async with open_peer_host(Identity.generate(), listen=("127.0.0.1", 0)) as liar:
            liar.listen_address = PeerAddress("x..y", 1, liar.peer_id)  # what its hello announces
            connection = await liar.connect(victim.address)
            await connection.call("dht.ping", None, timeout=5)
        with trio.fail_after(30):
            assert await victim.get("some key") is None


@pytest.mark.parametrize("entry", ["value", "subkey"])
async def test_a_found_record_that_is_not_msgpack_is_dropped_not_raised(entry) -> None:
    """A liar answers a get with a record whose value (or dictionary subkey) is not msgpack:
    decoding it raised RecordError out of ``get`` and killed the trainer reading progress."""
    async with trio.open_nursery() as nursery:
        liar_address = await nursery.start(_run_record_liar, entry)
        with trio.fail_after(30):
            async with DHTNode.open(initial_peers=[liar_address], config=DHTConfig(bootstrap_timeout=5)) as victim:
                assert await victim.get("run.progress", latest=True) is None
        nursery.cancel_scope.cancel()


async def _run_record_liar(entry: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    router = Router()

    @router.unary("dht.find")
    async def find(request):
        if request.body[1] is None:
            return []
        if entry == "value":
            found = [0, b"\xc1", time.time() + 30]
        else:
            found = [1, [[b"\xc1", pack({"epoch": 1}), time.time() + 30]]]
        return Message([], pack(found))

    @router.unary("dht.ping")
    async def ping(request):
        return None

    async with open_peer_host(Identity.generate(), router=router) as liar:
        task_status.started(liar.listen_address)
        await trio.sleep_forever()


def test_a_peer_id_text_of_60_kb_is_refused_at_once() -> None:
    """Base58 decoding is quadratic: such a text in a record froze the event loop for seconds."""
    started = time.perf_counter()
    with pytest.raises(ValueError, match="longer than any"):
        PeerAddress.parse("h:1/" + "2" * 60_000)
    assert time.perf_counter() - started < 0.01  # the old decoder needed ~1.4 s here


async def test_claims_naming_an_honest_peer_at_a_dead_address_cost_only_that_claim() -> None:
    """A liar names an honest peer (its ID, its real proof) at a closed port, again and again: the
    failed dials count against that claim, and the honest peer keeps its place and its standing."""
    async with open_peer_host(Identity.generate()) as host, trio.open_nursery() as nursery:
        table = RoutingTable(placed_contact(0), 20)
        contacts = Contacts(host, table, Background(nursery), rpc_timeout=2.0)
        honest = placed_contact(1 << 100, port=4000)
        table.add_contact(honest)
        dead_port = closed_port()
        lie = Contact(honest.proof, PeerAddress("127.0.0.1", dead_port, honest.peer_id))
        for _ in range(EVICT_AFTER_FAILURES + 1):
            assert await contacts.call(lie, "dht.ping", None) is None  # the dial to the lie fails
        assert table.get(honest.peer_id) is honest
        excluded = contacts.excluded()
        assert excluded is not None and excluded(lie) and not excluded(honest)
        assert contacts.routable([honest, lie]) == [honest]
        nursery.cancel_scope.cancel()


async def test_a_dial_cancelled_by_its_callers_deadline_does_not_fail_the_callers_waiting_on_it() -> None:
    """The first caller's own deadline ends the shared dial; a caller without a deadline that was
    waiting on it dials again and connects, rather than inheriting the first caller's give-up."""
    async with open_peer_host(Identity.generate()) as server, trio.open_nursery() as nursery:
        real = server.listen_address

        async def slow_handshake_proxy(client: trio.SocketStream) -> None:
            await trio.sleep(1.0)  # a far peer: the handshake starts only after a second
            upstream = await trio.open_tcp_stream(real.host, real.port)

            async def pump(source, sink) -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await source.receive_some(65536):
                        await sink.send_all(data)

            async with trio.open_nursery() as pumps:
                pumps.start_soon(pump, client, upstream)
                pumps.start_soon(pump, upstream, client)

        listeners = await nursery.start(partial(trio.serve_tcp, slow_handshake_proxy, 0, host="127.0.0.1"))
        address = PeerAddress("127.0.0.1", listeners[0].socket.getsockname()[1])
        async with open_peer_host(Identity.generate(), listen=None) as client:
            outcome = {}

            async def impatient() -> None:
                with trio.move_on_after(0.3):
                    await client.connect(address)

            async def patient() -> None:
                await trio.sleep(0.05)  # joins the impatient caller's dial
                outcome["peer"] = (await client.connect(address)).remote_peer_id

            with trio.fail_after(10):
                async with trio.open_nursery() as callers:
                    callers.start_soon(impatient)
                    callers.start_soon(patient)
            assert outcome["peer"] == server.peer_id
        nursery.cancel_scope.cancel()


class CountingListener:
    """A TCP endpoint that is no peer at all (another service): it counts the connections it
    accepts and closes each at once (or, ``silent``, holds each open and says nothing)."""

    def __init__(self, silent: bool = False) -> None:
        self.accepted = 0
        self.silent = silent

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async def handler(stream: trio.SocketStream) -> None:
            self.accepted += 1
            if self.silent:
                await trio.sleep_forever()
            await stream.aclose()

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(handler, listeners)


async def _run_reflector(port: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A DHT peer whose every find reply names 10 contacts with valid node-ID proofs, under
    identities it has never named before, all at ``127.0.0.1:port``."""
    router = Router()
    minted = (
        Contact(proof, PeerAddress("127.0.0.1", port, proof.peer_id))
        for proof in iter(lambda: NodeIDProof.solve(Identity.generate().peer_id, LOCAL_DIFFICULTY), None)
    )

    @router.unary("dht.find")
    async def find(request):
        return encode_contacts([next(minted) for _ in range(10)])

    @router.unary("dht.ping")
    async def ping(request):
        return None

    async with open_peer_host(Identity.generate(), router=router) as liar:
        task_status.started(liar.listen_address)
        await trio.sleep_forever()


async def test_contact_lists_naming_a_foreign_endpoint_cost_it_a_bounded_number_of_dials() -> None:
    """Contact reflection: a liar's find replies send every lookup of ours to an endpoint of its
    choosing, under ever new identities. Each reply's endpoint costs at most one dial, an endpoint
    that did not answer with the peer's own hello is not dialled again soon, and the honest part of
    the swarm keeps working."""
    async with trio.open_nursery() as nursery:
        target = CountingListener()
        port = await nursery.start(target.serve)
        liar_address = await nursery.start(_run_reflector, port)
        with trio.fail_after(30):
            async with (
                DHTNode.open() as honest,
                DHTNode.open(initial_peers=[liar_address, honest.address]) as victim,
            ):
                for round in range(5):
                    assert await victim.store(f"key {round}", round, time.time() + 60)
                    found = await victim.get(f"key {round}")
                    assert found is not None and found.value == round
        assert target.accepted == 1  # the first reply's dial; then it is known not to answer
        nursery.cancel_scope.cancel()


class CountingTcp(TcpTransport):
    """TCP that counts the dials it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.dials = 0

    async def connect(self, address: PeerAddress) -> trio.SocketStream:
        self.dials += 1
        return await super().connect(address)


async def test_identities_named_at_an_honest_peers_endpoint_cost_one_dial_and_not_that_peer() -> None:
    """A liar names made-up identities at an honest peer's endpoint: the first dial learns who is
    there, the other made-up identities are not dialled, and the honest peer still is."""
    transport = CountingTcp()
    router = Router()

    @router.unary("dht.ping")
    async def ping(request):
        return "pong"

    async with (
        open_peer_host(Identity.generate(), transport=transport) as host,
        open_peer_host(Identity.generate(), router=router) as honest,
        trio.open_nursery() as nursery,
    ):
        contacts = Contacts(host, RoutingTable(placed_contact(0), 20), Background(nursery), rpc_timeout=2.0)
        endpoint = honest.listen_address
        with trio.fail_after(10):
            for _ in range(5):
                proof = NodeIDProof.solve(Identity.generate().peer_id, LOCAL_DIFFICULTY)
                lie = Contact(proof, PeerAddress(endpoint.host, endpoint.port, proof.peer_id))
                assert await contacts.call(lie, "dht.ping", None) is None
            assert transport.dials == 1
            truth = Contact(honest.node_id, PeerAddress(endpoint.host, endpoint.port, honest.peer_id))
            reply = await contacts.call(truth, "dht.ping", None)
            assert reply is not None and reply.body == "pong" and transport.dials == 2
        nursery.cancel_scope.cancel()


async def test_a_contact_we_reached_ourselves_is_dialled_through_its_endpoints_backoff() -> None:
    """The endpoint rule is about contacts other peers name: a peer in our table (or lost from it,
    pinged back by ``LostContacts``) is dialled when its endpoint comes back, or a healed outage
    would wait out the endpoint's backoff."""
    transport = CountingTcp()
    router = Router()

    @router.unary("dht.ping")
    async def ping(request):
        return "pong"

    async with (
        open_peer_host(Identity.generate(), transport=transport) as host,
        open_peer_host(Identity.generate(), router=router) as honest,
        trio.open_nursery() as nursery,
    ):
        table = RoutingTable(placed_contact(0), 20)
        contacts = Contacts(host, table, Background(nursery), rpc_timeout=2.0)
        endpoint = honest.listen_address
        known = Contact(honest.node_id, PeerAddress(endpoint.host, endpoint.port, honest.peer_id))
        table.add_contact(known)
        contacts.endpoints.failed((endpoint.host, endpoint.port))  # as if it had been down a moment ago
        with trio.fail_after(10):
            proof = NodeIDProof.solve(Identity.generate().peer_id, LOCAL_DIFFICULTY)
            stranger = Contact(proof, PeerAddress(endpoint.host, endpoint.port, proof.peer_id))
            assert await contacts.call(stranger, "dht.ping", None) is None  # another's claim: not dialled
            assert transport.dials == 0
            reply = await contacts.call(known, "dht.ping", None)
            assert reply is not None and reply.body == "pong" and transport.dials == 1
        nursery.cancel_scope.cancel()


async def test_an_endpoint_that_accepts_and_says_nothing_is_not_waited_on_nor_dialled_again() -> None:
    async with open_peer_host(Identity.generate()) as host, trio.open_nursery() as nursery:
        tarpit = CountingListener(silent=True)
        port = await nursery.start(tarpit.serve)
        contacts = Contacts(host, RoutingTable(placed_contact(0), 20), Background(nursery), rpc_timeout=0.2)
        with trio.fail_after(5):  # (the handshake's own timeout is 10 s)
            for _ in range(3):
                proof = NodeIDProof.solve(Identity.generate().peer_id, LOCAL_DIFFICULTY)
                named = Contact(proof, PeerAddress("127.0.0.1", port, proof.peer_id))
                assert await contacts.call(named, "dht.ping", None) is None
        assert tarpit.accepted == 1
        nursery.cancel_scope.cancel()
