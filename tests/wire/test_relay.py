"""Circuit relays and reachability on loopback: a peer reached only through a relay answers calls
end to end (the relay forwards ciphertext only), relay limits hold against a greedy client, and
dial-back tells a listening peer from one nobody can reach."""

from __future__ import annotations

import functools
import socket
import struct
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from peer import BusyError, ConnectError, Identity, PeerAddress, Router, open_peer_host
from peer.holepunch import HolePuncher
from peer.nat import ADDRESSES, NatTraversal, relay_limits
from peer.nat_state import DialBackLimiter, RelayBook, RelayLimits, RelayRefused, TokenBucket, reachability_verdict
from peer.reachability import NAT, PUBLIC, UNKNOWN, Reachability, ReachabilityService, check_reachability
from peer.relay import RESERVE, Relay, RelayClient, dial_through_relay

SECRET = b"plaintext-the-relay-must-never-see" * 4


async def until(condition) -> None:
    """Poll ``condition`` (the caller's deadline bounds the wait)."""
    while not condition():
        await trio.sleep(0.01)


def echo_router() -> Router:
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return {"echo": request.body, "payload_size": len(request.payload)}

    return router


@asynccontextmanager
async def relay_behind_and_dialer(dial_relayed=None, **relay_host_options):
    """(relay host, relay service, NAT'd host B with a reservation, dialer host A); A dials relayed
    addresses with ``dial_relayed(A, address)`` (default: ``dial_through_relay``)."""
    async with (
        open_peer_host(Identity.generate(), **relay_host_options) as relay_host,
        open_peer_host(Identity.generate(), router=echo_router()) as behind,
        open_peer_host(Identity.generate()) as dialer,
    ):
        relay = Relay(relay_host)
        client = RelayClient(behind)
        if dial_relayed is None:
            RelayClient(dialer)  # a dialer needs a relay dialer, not reservations
        else:
            dialer.presence.dial_relayed_with(functools.partial(dial_relayed, dialer))
        await client.reserve(relay_host.listen_address)
        yield relay_host, relay, behind, dialer


@pytest.fixture
async def relayed():
    async with relay_behind_and_dialer() as hosts:
        yield hosts


class TappedStream(trio.abc.Stream):
    """A circuit end that records every byte sent into it and received from it: all the relay
    forwards between its dialer and the target, both ways. It shows no socket, so the secure
    channel uses the stream API."""

    def __init__(self, inner: trio.abc.Stream, seen: list[bytes]):
        self.inner, self.seen = inner, seen

    async def send_all(self, data) -> None:
        self.seen.append(bytes(data))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        data = await self.inner.receive_some(max_bytes)
        self.seen.append(bytes(data))
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_peer_is_reached_through_a_relay_end_to_end_encrypted():
    seen: list[bytes] = []

    async def tapped_dial(host, address):
        return TappedStream(await dial_through_relay(host, address), seen)

    async with relay_behind_and_dialer(tapped_dial) as (relay_host, relay, behind, dialer):
        listen = relay_host.listen_address
        address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
        assert PeerAddress.parse(str(address)) == address
        reply = await dialer.call(address, "echo", {"hello": "there"}, payload=SECRET, timeout=10)
        assert reply.body == {"echo": {"hello": "there"}, "payload_size": len(SECRET)}
        connection = dialer.connection_to(behind.peer_id)
        assert connection is not None and connection.relayed_via == relay_host.peer_id
        # B accepted it as a relayed connection, and sees A's identity
        incoming = behind.connection_to(dialer.peer_id)
        assert incoming is not None and incoming.relayed_via == relay_host.peer_id
        relayed_bytes = b"".join(seen)
        assert relay.bytes_relayed >= len(SECRET) and len(relayed_bytes) >= len(SECRET)
        assert SECRET[:20] not in relayed_bytes  # the relay forwarded ciphertext only, both ways
        assert b"payload_size" not in relayed_bytes  # (the reply, on its way back)
        assert relay.book.circuits == 1
        connection.close()
        with trio.fail_after(5):
            await until(lambda: relay.book.circuits == 0)


async def test_a_relay_refuses_unreserved_targets_and_bogus_tokens(relayed):
    relay_host, relay, behind, dialer = relayed
    stranger = Identity.generate().peer_id
    address = PeerAddress(relay_host.listen_address.host, relay_host.listen_address.port, stranger, relay_host.peer_id)
    with pytest.raises(ConnectError, match="relay refused"):
        await dialer.connect(address)
    # a relay that found itself behind NAT takes no reservations
    relay.accept_reservations(False)
    with pytest.raises(BusyError, match="relays for nobody"):
        await dialer.call(relay_host.listen_address, "relay.reserve", None, timeout=5)
    assert dialer.peer_id not in relay.book.reservations
    # a raw circuit end with a token nobody issued is dropped at once
    stream = await trio.open_tcp_stream(relay_host.listen_address.host, relay_host.listen_address.port)
    await stream.send_all(b"\xff" + bytes(16))
    with trio.fail_after(5):
        assert await stream.receive_some(10) == b""
        await until(lambda: relay.waiting_ends == 0)
    assert relay.book.circuits == 0


async def test_a_circuit_end_reset_midway_through_its_token_costs_only_that_connection(relayed):
    relay_host, relay, behind, dialer = relayed
    for _ in range(3):
        sock = socket.create_connection((relay_host.listen_address.host, relay_host.listen_address.port))
        sock.sendall(b"\xff" + bytes(5))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, not a clean end
    with trio.fail_after(5):
        await until(lambda: relay.waiting_ends == 0)
    listen = relay_host.listen_address
    address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
    assert (await dialer.call(address, "echo", 1, timeout=10)).body["echo"] == 1  # the relay still relays


async def test_a_silent_circuit_end_is_dropped_after_its_token_deadline():
    # a token is due as soon as a handshake would be: within 0.3 s here, not the default 10 s
    async with relay_behind_and_dialer(handshake_timeout=0.3) as (relay_host, relay, _, _):
        stream = await trio.open_tcp_stream(relay_host.listen_address.host, relay_host.listen_address.port)
        await stream.send_all(b"\xff")
        with trio.fail_after(5):
            assert await stream.receive_some(10) == b""
            await until(lambda: relay.waiting_ends == 0)


def test_relay_book_caps_circuits_and_expires_pending_ones():
    book = RelayBook(RelayLimits(max_reservations=2, max_circuits=3, max_circuits_per_peer=2, pending_timeout=5))
    book.reserve("b", 0)
    book.reserve("c", 0)
    with pytest.raises(RelayRefused, match="reservations"):
        book.reserve("d", 0)
    book.reserve("b", 1)  # renewing is not a new reservation
    with pytest.raises(RelayRefused, match="no reservation"):
        book.open_circuit("a", "d", 0)
    first = book.open_circuit("a", "b", 0)
    book.open_circuit("a", "c", 0)
    with pytest.raises(RelayRefused, match="a is at its maximum"):
        book.open_circuit("a", "b", 0)  # one requester cannot hold more than its share
    book.open_circuit("x", "c", 0)
    with pytest.raises(RelayRefused, match="maximum of 3 circuits"):
        book.open_circuit("y", "b", 0)
    # tokens are one-time; both ends make the circuit active with its lifetime
    assert book.arrive(first.tokens[0], "end-a", 1) is first and not first.active
    assert book.arrive(first.tokens[0], "again", 1) is None
    assert book.arrive(first.tokens[1], "end-b", 1) is first and first.active
    # the other two never got their ends: they expire, freeing their slots
    assert len(book.expire(10)) == 2 and book.circuits == 1
    assert book.arrive(bytes(16), "junk", 10) is None
    book.close_circuit(first)
    assert book.circuits == 0 and book.counted() == (0, 0)


def test_a_relay_admits_a_whole_groups_circuits_to_one_peer_behind_nat():
    """Every NAT'd member of an averaging group (16 by default) dials a NAT'd reducer at once."""
    book = RelayBook(RelayLimits())
    book.reserve("reducer", 0, group="198.18.0.1")
    for member in range(15):
        book.open_circuit(f"member-{member}", "reducer", 0, f"198.18.1.{member}")
    assert book.circuits == 15


def test_one_address_cannot_hold_every_reservation_or_circuit_with_many_identities():
    limits = RelayLimits(max_reservations_per_address=2, max_circuits_per_address=3, pending_timeout=5)
    book = RelayBook(limits)
    book.reserve("sybil-1", 0, group="203.0.113.7")
    book.reserve("sybil-2", 0, group="203.0.113.7")
    with pytest.raises(RelayRefused, match="203.0.113.7 holds its maximum of 2 reservations"):
        book.reserve("sybil-3", 0, group="203.0.113.7")
    book.reserve("sybil-1", 1, group="203.0.113.7")  # renewing is not a new reservation
    book.reserve("honest", 0, group="198.51.100.1")  # another address still gets a slot
    book.reserve("local", 0, group=None)  # loopback has no per-address limit
    for caller in ("sybil-a", "sybil-b", "sybil-c"):  # fresh identities, one address
        book.open_circuit(caller, "honest", 0, "192.0.2.9")
    with pytest.raises(RelayRefused, match="192.0.2.9 is at its maximum of 3 circuits"):
        book.open_circuit("sybil-d", "local", 0, "192.0.2.9")
    book.open_circuit("other", "local", 0, "192.0.2.10")
    # a target's address counts too: circuits to the Sybils' reservations share their address's cap
    for caller in ("p", "q", "r"):
        book.open_circuit(caller, "sybil-1", 0, None)
    with pytest.raises(RelayRefused, match="203.0.113.7 is at its maximum"):
        book.open_circuit("s", "sybil-2", 0, None)
    assert len(book.expire(10)) == 7 and book.counted()[1] == 0
    book.drop_reservation("sybil-1")
    book.reserve("sybil-3", 11, group="203.0.113.7")  # a dropped reservation frees its address's slot


def test_token_bucket_and_dial_back_limits():
    bucket = TokenBucket(rate=100, burst=50, now=0)
    assert bucket.take(50, 0) == 0
    assert bucket.take(100, 0) == pytest.approx(1.0)
    limiter = DialBackLimiter(0, rate=1, burst=2, per_address_interval=10)
    assert limiter.start("1.2.3.4:1", 0) is None
    assert "in progress" in limiter.start("1.2.3.4:1", 0)
    limiter.finished("1.2.3.4:1")
    assert "ago" in limiter.start("1.2.3.4:1", 1)
    assert limiter.start("5.6.7.8:1", 1) is None
    assert limiter.start("6.6.6.6:1", 1) is None  # the bucket (2, one more per second) is now empty
    assert "too many" in limiter.start("9.9.9.9:1", 1)
    assert limiter.start("1.2.3.4:1", 11) is None
    assert reachability_verdict([]) == UNKNOWN
    assert reachability_verdict([False]) == UNKNOWN
    assert reachability_verdict([False, False]) == NAT
    assert reachability_verdict([False, True]) == PUBLIC


async def test_dial_back_tells_a_reachable_peer_from_an_unreachable_one():
    async with open_peer_host(Identity.generate()) as one, open_peer_host(Identity.generate()) as two:
        async with open_peer_host(Identity.generate()) as asker:
            servers = [one.listen_address, two.listen_address]
            for server in (one, two):
                server.service(ReachabilityService)
            result = await check_reachability(asker, servers)
            assert result.status == PUBLIC, result
            assert result.observed is not None and result.observed[0] == "127.0.0.1"
            # a port nobody listens on stands for a NAT that drops unsolicited connections
            closed = trio.socket.socket()
            await closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
            closed.close()
            result = await check_reachability(asker, servers, port=port)
            assert result.status == NAT, result
            assert "could dial us back" in result.reason
            # asking again at once is refused by the rate limit: unknown, not a wrong verdict
            again = await check_reachability(asker, servers, port=port)
            assert again.status == UNKNOWN, again


async def test_hole_punching_moves_a_relayed_connection_to_a_direct_one(relayed, monkeypatch):
    relay_host, relay, behind, dialer = relayed
    monkeypatch.setattr("peer.host.RELAY_HANDOVER_GRACE", 0.2)
    punchers = [HolePuncher(host, lambda: "127.0.0.1") for host in (behind, dialer)]
    listen = relay_host.listen_address
    address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
    relayed_connection = await dialer.connect(address)
    assert relayed_connection.relayed_via == relay_host.peer_id
    with trio.fail_after(10):
        await until(lambda: punchers[1].successes + punchers[1].failures > 0)
    assert punchers[1].successes == 1, punchers[1].status()
    # each side pools the punched connection when its own handshake ends (its task may run later)
    with trio.fail_after(5):
        await until(lambda: (c := behind.connection_to(dialer.peer_id)) is not None and c.relayed_via is None)
        await until(lambda: (c := dialer.connection_to(behind.peer_id)) is not None and c.relayed_via is None)
    direct = dialer.connection_to(behind.peer_id)
    # the punched connection runs from one listen port to the other, and carries calls
    sockname = direct.channel.stream.socket.getsockname()
    peername = direct.channel.stream.socket.getpeername()
    assert sockname[1] == dialer.listen_address.port and peername[1] == behind.listen_address.port
    reply = await dialer.call(address, "echo", "direct", timeout=5)
    assert reply.body["echo"] == "direct"
    with trio.fail_after(5):
        await relayed_connection.closed.wait()  # the relay is let go after the grace period
        await until(lambda: relay.book.circuits == 0)


async def test_a_failed_punch_is_tried_again_while_the_relayed_connection_lives(relayed, monkeypatch):
    # the reached peer does not know its public address yet (its reachability check is still
    # running on a busy machine): the first round has nothing to dial and fails
    relay_host, relay, behind, dialer = relayed
    monkeypatch.setattr("peer.host.RELAY_HANDOVER_GRACE", 0.2)
    monkeypatch.setattr("peer.holepunch.RETRY_PAUSE", 0.5)
    known: list[str] = []
    HolePuncher(behind, lambda: known[0] if known else None)
    puncher = HolePuncher(dialer, lambda: "127.0.0.1")
    listen = relay_host.listen_address
    address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
    relayed_connection = await dialer.connect(address)
    with trio.fail_after(10):
        await until(lambda: puncher.failures > 0)
    assert puncher.successes == 0 and dialer.connection_to(behind.peer_id).relayed_via is not None
    known.append("127.0.0.1")
    with trio.fail_after(10):
        await until(lambda: puncher.successes == 1)
        await until(lambda: (c := dialer.connection_to(behind.peer_id)) is not None and c.relayed_via is None)
        await relayed_connection.closed.wait()
    assert puncher.failures == 1, puncher.status()


async def test_a_relayed_connection_made_while_every_punch_slot_is_taken_is_punched_later(relayed, monkeypatch):
    relay_host, relay, behind, dialer = relayed
    monkeypatch.setattr("peer.host.RELAY_HANDOVER_GRACE", 0.2)
    monkeypatch.setattr("peer.holepunch.NOT_READY_PAUSE", 0.3)
    monkeypatch.setattr("peer.holepunch.MAX_PUNCHES", 0)  # every slot taken (by punches with others)
    HolePuncher(behind, lambda: "127.0.0.1")
    puncher = HolePuncher(dialer, lambda: "127.0.0.1")
    listen = relay_host.listen_address
    address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
    relayed_connection = await dialer.connect(address)
    await trio.sleep(1.0)
    assert puncher.attempts == 0 and relayed_connection.relayed_via is not None
    monkeypatch.setattr("peer.holepunch.MAX_PUNCHES", 8)  # the other punches are over
    with trio.fail_after(10):
        await until(lambda: puncher.successes == 1)
        await relayed_connection.closed.wait()
    assert puncher.failures == 0, puncher.status()


async def test_an_unreachable_peer_falls_back_to_client_mode_until_a_relay_takes_it(monkeypatch):
    verdict = Reachability(NAT, ("203.0.113.7", 40000), 3, "none of 3 peers could dial us back")

    async def unreachable(host, servers, **options):
        return verdict

    monkeypatch.setattr("peer.nat.check_reachability", unreachable)
    monkeypatch.setattr("peer.nat.RELAY_GRACE", 0.1)
    monkeypatch.setattr("peer.relay.RESERVE_RETRY", 0.1)
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate()) as behind,
        open_peer_host(Identity.generate()) as other,
        trio.open_nursery() as nursery,
    ):
        NatTraversal(relay_host)
        nat = NatTraversal(behind)  # knows no public peer yet: nobody to relay for it
        NatTraversal(other, relay=False)  # --no-relay: it will not relay for anyone
        await behind.connect(other.listen_address)
        nursery.start_soon(nat.run)
        with trio.fail_after(5):
            await until(lambda: nat.fallback_client_mode)
        assert behind.client_mode and nat.status()["status"] == NAT
        assert not nat.relay.accepting  # a peer behind NAT relays for nobody
        assert nat.status()["observed_address"] == "203.0.113.7:40000"
        # a public peer to relay through appears: reserved, announced, pushed to connected peers
        nat.initial_peers.append(relay_host.listen_address)
        with trio.fail_after(5):
            await until(lambda: not nat.fallback_client_mode)
            seen = other.connection_to(behind.peer_id)
            await until(lambda: seen.remote_listen_address is not None and seen.remote_listen_address.relay)
        assert not behind.client_mode
        assert seen.remote_listen_address.relay == relay_host.peer_id
        assert nat.status()["relayed_addresses"] == [str(behind.presence.announced[0])]
        nursery.cancel_scope.cancel()


async def test_a_circuit_is_held_to_its_byte_rate_and_lifetime():
    limits = RelayLimits(circuit_bytes_per_s=2 * 2**20, circuit_burst_bytes=256 * 1024, circuit_lifetime=3.0)
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate(), router=echo_router()) as behind,
        open_peer_host(Identity.generate()) as dialer,
    ):
        relay = Relay(relay_host, limits)
        await RelayClient(behind).reserve(relay_host.listen_address)
        RelayClient(dialer)
        listen = relay_host.listen_address
        address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
        connection = await dialer.connect(address)
        opened = trio.current_time()
        payload = bytes(4 * 2**20)
        await dialer.call(address, "echo", None, payload=payload, timeout=30)
        # 4 MiB at 2 MiB/s after a 256 KiB burst cannot pass in less than ~1.9 s
        assert trio.current_time() - opened >= (len(payload) - limits.circuit_burst_bytes) / limits.circuit_bytes_per_s
        with trio.fail_after(limits.circuit_lifetime + 3):
            await connection.closed.wait()  # the relay ends the circuit at its lifetime
        assert trio.current_time() - opened >= limits.circuit_lifetime - 0.5
        with trio.fail_after(2):
            await until(lambda: relay.book.circuits == 0)


def test_peerd_status_says_in_one_line_how_the_peer_is_reached():
    from peerd.cli import reachability_line

    line = reachability_line(
        {
            "status": "nat",
            "observed_address": "203.0.113.7:31337",
            "relayed_addresses": ["198.51.100.1:31337/RELAY/relay"],
            "client_mode_fallback": False,
            "connections": {"direct": 3, "relayed": 1},
        }
    )
    assert line == (
        "nat; seen as 203.0.113.7:31337; reached via 198.51.100.1:31337/RELAY/relay; 3 direct, 1 relayed connections"
    )


class _Owner:
    def __init__(self, tensors):
        self.tensors = tensors

    @asynccontextmanager
    async def locked_tensors(self):
        yield self.tensors

    def state_metadata(self):
        return {"epoch": 7}


async def test_a_newcomer_downloads_state_from_a_donor_reached_only_through_a_relay():
    import torch

    from averaging.state_sharing import StateSharing
    from dht.node import DHTNode

    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate()) as donor_host,
        open_peer_host(Identity.generate()) as newcomer_host,
    ):
        Relay(relay_host)
        listen = relay_host.listen_address
        # behind NAT from its first hello on: it announces only the relayed address
        donor_host.presence.announce([PeerAddress(listen.host, listen.port, None, relay_host.peer_id)])
        await RelayClient(donor_host).reserve(listen)
        RelayClient(newcomer_host)
        async with (
            DHTNode.open(host=relay_host) as relay_node,
            DHTNode.open(host=donor_host, initial_peers=[relay_node.address]) as donor_node,
        ):
            state = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 4)]
            donor = StateSharing(donor_host, donor_node, "run.state", _Owner(state))
            await donor.announce(5)  # (before the newcomer joins: the donor's store does not dial it)
            async with DHTNode.open(host=newcomer_host, initial_peers=[relay_node.address]) as newcomer_node:
                newcomer = StateSharing(newcomer_host, newcomer_node, "run.state", _Owner([]))
                metadata, tensors = await newcomer.download([torch.zeros(1000), torch.zeros(3, 4)], timeout=20)
                assert metadata == {"epoch": 7}
                assert all(torch.equal(got, want) for got, want in zip(tensors, state, strict=True))
                connection = newcomer_host.connection_to(donor_host.peer_id)
                assert connection is not None and connection.relayed_via == relay_host.peer_id


async def test_all_circuits_together_are_held_to_the_relay_s_total_rate():
    """Circuits from several identities share one budget: each alone may use its own rate, but
    together they cannot take more of the relay's uplink than the total."""
    limits = RelayLimits(
        circuit_bytes_per_s=4 * 2**20,
        circuit_burst_bytes=256 * 1024,
        total_bytes_per_s=2 * 2**20,
        total_burst_bytes=256 * 1024,
    )
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate(), router=echo_router()) as behind,
        open_peer_host(Identity.generate()) as first,
        open_peer_host(Identity.generate()) as second,
    ):
        relay = Relay(relay_host, limits)
        await RelayClient(behind).reserve(relay_host.listen_address)
        listen = relay_host.listen_address
        address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
        payload = bytes(2 * 2**20)
        opened = trio.current_time()
        async with trio.open_nursery() as nursery:
            for dialer in (first, second):
                RelayClient(dialer)
                nursery.start_soon(functools.partial(dialer.call, address, "echo", None, payload=payload, timeout=30))
        # 2 x 2 MiB through one 2 MiB/s budget (each circuit alone could do 4 MiB/s)
        relayed = 2 * len(payload)
        assert relay.bytes_relayed >= relayed
        assert trio.current_time() - opened >= (relayed - limits.total_burst_bytes) / limits.total_bytes_per_s - 0.1


def test_relay_limits_hold_one_circuit_to_the_total():
    limits = relay_limits(4.0)
    assert limits.total_bytes_per_s == 4 * 2**20
    assert limits.circuit_bytes_per_s == 4 * 2**20  # below the per-circuit default of 16 MiB/s
    assert relay_limits(100.0).circuit_bytes_per_s == RelayLimits().circuit_bytes_per_s


async def test_a_reservation_goes_with_the_connection_it_was_made_on():
    """A NAT'd peer that went away (or came back under a new identity, as the hole-punching lab
    peer does each try) held its slot, and its address's share of them, until the TTL ran out: the
    17th try from one address was refused ("holds its maximum of 16 reservations")."""
    async with open_peer_host(Identity.generate()) as relay_host:
        relay = Relay(relay_host)
        for _ in range(3):
            async with open_peer_host(Identity.generate()) as behind:
                client = RelayClient(behind)
                await client.reserve(relay_host.listen_address)
                await client.reserve(relay_host.listen_address)  # a renewal on the same connection
                assert behind.peer_id in relay.book.reservations
            with trio.fail_after(5):
                await until(lambda: not relay.book.reservations)


def test_forgetting_every_reservation_forgets_where_each_came_from():
    book = RelayBook(RelayLimits(max_reservations_per_address=1))
    book.reserve("a", 0.0, group="203.0.113.7")
    book.drop_reservations()
    book.reserve("b", 1.0, group="203.0.113.7")  # the address's one slot is free again
    assert list(book.reservations) == ["b"]


async def second_connection(host, address: PeerAddress):
    """Another connection from ``host`` to ``address`` beside the one its pool holds (as two dials
    that raced leave)."""
    return await host.secure_outgoing(await host.open_stream(address), address)


def task_count(task: trio.lowlevel.Task) -> int:
    return 1 + sum(task_count(child) for nursery in task.child_nurseries for child in nursery.child_tasks)


async def test_a_reservation_the_relay_takes_carries_circuits_whichever_connection_it_came_on(relayed):
    # Two direct connections between the NAT'd peer and the relay; the relay pools one. A
    # reservation renewed over the other is tied to it, so circuits must reach the peer over it: a
    # renewal that succeeds while circuits are refused leaves the peer announcing a dead address.
    relay_host, relay, behind, dialer = relayed
    relay_address = relay_host.listen_address
    first = behind.connection_to(relay_host.peer_id)
    second = await second_connection(behind, relay_address)
    assert relay_host.connection_to(behind.peer_id) is not None and second is not first
    first.close()  # the relay's pooled connection to the peer goes (say, retired as idle there)
    with trio.fail_after(5):
        await until(lambda: relay_host.connection_to(behind.peer_id) is None)
    await second.call(RESERVE, None, timeout=5)  # the renewal, on the connection left
    address = PeerAddress(relay_address.host, relay_address.port, behind.peer_id, relay_host.peer_id)
    reply = await dialer.call(address, "echo", "through the reserved connection", timeout=10)
    assert reply.body["echo"] == "through the reserved connection"


async def test_new_addresses_told_over_either_of_two_connections_reach_what_the_peer_reads():
    # Two connections between the two peers; each side pools one. The addresses a peer tells over
    # either must be what the other side reads of it (its DHT contact, its dial-back servers),
    # which comes from the connection that side pools.
    async with (
        open_peer_host(Identity.generate()) as told,
        open_peer_host(Identity.generate()) as teller,
    ):
        NatTraversal(told)
        pooled = await teller.connect(told.listen_address)
        second = await second_connection(teller, told.listen_address)
        assert second is not pooled
        moved = PeerAddress("127.0.0.1", 4321, None, told.peer_id)  # (a relayed address)
        await second.call(ADDRESSES, [str(moved)], timeout=5)
        seen = told.connection_to(teller.peer_id).remote_listen_address
        assert seen is not None and seen.relay == told.peer_id


async def test_renewals_alternating_between_two_connections_cost_the_relay_no_more_tasks(relayed):
    # A peer may hold several connections to the relay (MAX_CONNECTIONS_PER_IDENTITY): renewing
    # over each in turn must not leave the relay one more task per renewal, each living as long
    # as its connection.
    relay_host, relay, behind, dialer = relayed
    first = behind.connection_to(relay_host.peer_id)
    second = await second_connection(behind, relay_host.listen_address)
    await first.call(RESERVE, None, timeout=5)
    await second.call(RESERVE, None, timeout=5)
    await trio.testing.wait_all_tasks_blocked()
    root = trio.lowlevel.current_root_task()
    before = task_count(root)
    for _ in range(100):
        await first.call(RESERVE, None, timeout=5)
        await second.call(RESERVE, None, timeout=5)
    await trio.testing.wait_all_tasks_blocked()
    assert task_count(root) - before <= 2
