"""NATs on the simulated internet (``peer/simnet/nat.py``): the bookkeeping alone, sans I/O, then
dials between hosts behind them under trio's virtual clock: what a far end sees, what a NAT lets
in, and two dials from bound ports that cross (TCP's simultaneous open, what hole punching uses)."""

from __future__ import annotations

import contextlib
import errno

import pytest
import trio

from peer import ConnectError, PeerAddress, Router, open_peer_host
from peer.nat import NAT, PUBLIC, NatTraversal
from peer.nat_state import RelayLimits
from peer.relay import RENEW_AFTER, Relay, RelayClient
from peer.relay_dials import CALL_TIMEOUT as RELAY_CALL_TIMEOUT
from peer.relay_dials import REVERSAL_WAIT
from peer.simnet import SimNetwork
from peer.simnet.nat import MAPPING_S, SimNats
from peer.simnet.network import SYN_RTO

RESERVATION_TTL = RelayLimits().reservation_ttl


# ---------------------------------------------------------------------- the bookkeeping, sans I/O
def test_a_nat_admits_only_the_remote_host_its_own_syn_went_to_and_only_for_a_while():
    nats = SimNats()
    public = nats.add("10.0.0.2")
    assert nats.seen_as("10.0.0.2") == public != "10.0.0.2"
    assert nats.seen_as("10.0.0.3") == "10.0.0.3"  # a host with no NAT is seen as itself
    assert not nats.admits("10.0.0.2", 4000, "10.0.0.3", now=0.0)
    nats.opened("10.0.0.2", 4000, "10.0.0.3", now=10.0)
    assert nats.admits("10.0.0.2", 4000, "10.0.0.3", now=11.0)
    assert not nats.admits("10.0.0.2", 4000, "10.0.0.4", now=11.0)  # another remote host
    assert not nats.admits("10.0.0.2", 4001, "10.0.0.3", now=11.0)  # another port
    assert not nats.admits("10.0.0.2", 4000, "10.0.0.3", now=10.0 + MAPPING_S)
    assert nats.admits("10.0.0.3", 4000, "10.0.0.9", now=0.0)  # no NAT: everything gets in


def test_a_syn_to_a_public_address_reaches_the_host_behind_it_and_a_private_one_goes_nowhere():
    nats = SimNats()
    public = nats.add("10.0.0.2")
    assert nats.machine(public, source="10.0.0.3") == "10.0.0.2"
    assert nats.machine("10.0.0.2", source="10.0.0.3") is None
    assert nats.machine("10.0.0.2", source="10.0.0.2") == "10.0.0.2"  # (its own machine)
    assert nats.machine("10.0.0.3", source="10.0.0.2") == "10.0.0.3"
    assert len({nats.add(f"10.0.1.{i}") for i in range(300)}) == 300  # every home its own address


def test_expired_mappings_are_forgotten():
    nats = SimNats()
    nats.add("10.0.0.2")
    for port in range(100):
        nats.opened("10.0.0.2", port, "10.0.0.3", now=float(port))
    nats.opened("10.0.0.2", 4000, "10.0.0.3", now=100.0 + MAPPING_S)
    assert not nats.admits("10.0.0.2", 99, "10.0.0.3", now=100.0 + MAPPING_S)
    assert nats.mappings("10.0.0.2") == 1  # (the table holds what the last MAPPING_S opened)


# ---------------------------------------------------------------------- dials through NATs
async def listening(network, transport):
    (_, port), [listener] = await transport.listen(transport.address, 0)
    return port, listener


async def test_a_host_behind_nat_is_seen_from_its_public_address_and_reached_by_nobody(autojump_clock):
    network = SimNetwork(seed=1)
    home, public = network.add_host(behind_nat=True), network.add_host()
    home_port, _ = await listening(network, home)
    public_port, public_listener = await listening(network, public)
    accepted = []

    async def accept():
        accepted.append(await public_listener.accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        outgoing = await network.dial(home.address, public.address, public_port)
    seen = network.nats.seen_as(home.address)
    assert seen != home.address
    assert outgoing.local[0] == home.address  # (its own end knows its private address)
    assert public.remote_address(accepted[0]) == (seen, outgoing.local[1])  # port preserving
    for address in (seen, home.address):  # its NAT drops the SYN; its private address goes nowhere
        with trio.move_on_after(10) as unanswered:
            await network.dial(public.address, address, home_port)
        assert unanswered.cancelled_caught


async def test_a_syn_a_nat_dropped_is_sent_again_and_gets_in_once_the_mapping_opens(autojump_clock):
    network = SimNetwork(seed=5)
    home, peer = network.add_host(behind_nat=True), network.add_host()
    home_port, home_listener = await listening(network, home)
    rtt = network.model.rtt(peer.address, home.address)
    started = trio.current_time()

    async def open_mapping_later():
        await trio.sleep(rtt + 0.1)  # after the first SYN was dropped
        network.nats.opened(home.address, home_port, peer.address, trio.current_time())
        await home_listener.accept()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_mapping_later)
        await network.dial(peer.address, network.nats.seen_as(home.address), home_port)
    assert trio.current_time() - started == pytest.approx(SYN_RTO + rtt)  # sent again 1 s after the first


async def test_a_syn_from_the_port_a_nat_mapped_to_that_host_gets_in(autojump_clock):
    """A host behind NAT that sent from its listen port to a peer lets that peer's SYN to the port
    in (the peer's SYN then reaches the host's listener), and no other host's."""
    network = SimNetwork(seed=2)
    home, peer, stranger = network.add_host(behind_nat=True), network.add_host(), network.add_host()
    home_port, home_listener = await listening(network, home)
    public = network.nats.seen_as(home.address)
    network.nats.opened(home.address, home_port, peer.address, trio.current_time())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(home_listener.accept)
        stream = await network.dial(peer.address, public, home_port)
    assert stream.remote == (public, home_port)
    with trio.move_on_after(10) as unanswered:
        await network.dial(stranger.address, public, home_port)
    assert unanswered.cancelled_caught


@pytest.mark.parametrize("first_behind, second_behind", [(True, True), (False, True)])
async def test_two_dials_from_bound_ports_that_cross_become_one_connection(autojump_clock, first_behind, second_behind):
    """Hole punching: each side dials the other's public endpoint from its listen port at about
    the same time; each NAT sees its own side's SYN leave first, and the two dials meet as one
    connection, whose bytes go both ways."""
    network = SimNetwork(seed=3)
    a, b = network.add_host(behind_nat=first_behind), network.add_host(behind_nat=second_behind)
    a_port, _ = await listening(network, a)
    b_port, _ = await listening(network, b)
    a_public, b_public = network.nats.seen_as(a.address), network.nats.seen_as(b.address)
    ends = {}

    async def punch(transport, port, remote, name, delay):
        await trio.sleep(delay)
        ends[name] = await transport.connect_from(("0.0.0.0", port), remote, timeout=3.0)

    before = network.connections_total
    async with trio.open_nursery() as nursery:
        nursery.start_soon(punch, a, a_port, (b_public, b_port), "a", 0.0)
        nursery.start_soon(punch, b, b_port, (a_public, a_port), "b", 0.02)
    assert network.connections_total == before + 1
    assert ends["a"].remote == (b_public, b_port) and ends["b"].remote == (a_public, a_port)
    await ends["a"].send_all(b"hello")
    assert await ends["b"].receive_some() == b"hello"
    await ends["b"].send_all(b"back")
    assert await ends["a"].receive_some() == b"back"
    # a second dial between the same two endpoints finds them connected
    with pytest.raises(OSError) as taken:
        await a.connect_from(("0.0.0.0", a_port), (b_public, b_port), timeout=3.0)
    assert taken.value.errno == errno.EADDRINUSE


async def test_a_punch_at_a_nat_that_never_opened_a_mapping_gets_no_answer(autojump_clock):
    network = SimNetwork(seed=4)
    a, b = network.add_host(), network.add_host(behind_nat=True)
    a_port, _ = await listening(network, a)
    b_port, _ = await listening(network, b)
    with pytest.raises(trio.TooSlowError):
        await a.connect_from(("0.0.0.0", a_port), (network.nats.seen_as(b.address), b_port), timeout=3.0)


# ---------------------------------------------------------------------- real NAT traversal on it
async def wait_until(predicate, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.5)


async def test_peers_behind_nat_find_out_take_relays_and_punch_direct_connections(autojump_clock):
    """Real hosts with ``NatTraversal`` on the simulated internet: three public peers, two behind
    NAT. Those behind NAT learn it (dial-backs that get no answer), reserve on a public peer and
    announce relayed addresses. A public peer not yet connected to one of them asks its relay for
    connection reversal and is dialed back directly; the other NAT'd peer reaches it through a
    circuit, and hole punching replaces that relayed connection with a direct one."""
    network = SimNetwork(seed=7)
    transports = [network.add_host() for _ in range(3)] + [network.add_host(behind_nat=True) for _ in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        hosts = [
            await stack.enter_async_context(
                open_peer_host(network.identity(), router=_echo_router(), transport=transport)
            )
            for transport in transports
        ]
        relay_host, public, stranger, home, other_home = hosts
        initial = [relay_host.listen_address, public.listen_address]
        nursery = await stack.enter_async_context(trio.open_nursery())
        traversals = [
            NatTraversal(host, initial_peers=[a for a in initial if a.peer_id != host.peer_id]) for host in hosts
        ]
        for traversal in traversals:
            nursery.start_soon(traversal.run)
        await wait_until(lambda: all(host.presence.announced for host in (home, other_home)), timeout=60)
        assert [traversal.reachability.status for traversal in traversals] == [PUBLIC, PUBLIC, PUBLIC, NAT, NAT]
        assert traversals[3].reachability.observed[0] == network.nats.seen_as(transports[3].address)
        relay = home.presence.announced[0]  # (as announced: the relay's endpoint and ID)
        relayed_address = PeerAddress(relay.host, relay.port, home.peer_id, relay.relay)
        assert relay.relay in (relay_host.peer_id, public.peer_id)
        # a public peer asks for connection reversal: the peer behind NAT dials it, no circuit
        assert stranger.connection_to(home.peer_id) is None
        connection = await stranger.connect(relayed_address)
        assert connection.relayed_via is None and traversals[2].client.dials.reversed == 1
        assert (await connection.call("echo", "reversed")).body == "reversed"
        # a peer behind NAT itself goes through a circuit, then punches a direct connection
        assert other_home.connection_to(home.peer_id) is None
        connection = await other_home.connect(relayed_address)
        assert connection.relayed_via is not None
        await wait_until(lambda: _direct(other_home, home), timeout=60)
        direct = other_home.connection_to(home.peer_id)
        assert (await direct.call("echo", "direct")).body == "direct"
        assert sum(traversal.puncher.successes for traversal in traversals) >= 1
        nursery.cancel_scope.cancel()


def _echo_router() -> Router:
    router = Router()

    async def echo(request):
        await trio.lowlevel.checkpoint()
        return request.body

    router.add_unary("echo", echo)
    return router


def _direct(dialer, target) -> bool:
    connection = dialer.connection_to(target.peer_id)
    return connection is not None and connection.relayed_via is None


async def test_a_reversal_that_never_arrives_falls_back_to_a_circuit(autojump_clock):
    """A dialer that takes itself for reachable while it is behind NAT asks for reversal; the
    peer's dial back dies at the dialer's NAT, and after ``REVERSAL_WAIT`` the dialer goes
    through a circuit instead: one failed round trip, not a failed connection."""
    network = SimNetwork(seed=8)
    relay_t, home_t, mistaken_t = (
        network.add_host(),
        network.add_host(behind_nat=True),
        network.add_host(behind_nat=True),
    )
    async with (
        open_peer_host(network.identity(), transport=relay_t) as relay_host,
        open_peer_host(network.identity(), router=_echo_router(), transport=home_t) as home,
        open_peer_host(network.identity(), transport=mistaken_t) as mistaken,
    ):
        Relay(relay_host)
        relay_id, _ = await RelayClient(home).reserve(relay_host.listen_address)
        dials = RelayClient(mistaken, reachable=lambda: True).dials
        listen = relay_host.listen_address
        started = trio.current_time()
        connection = await mistaken.connect(PeerAddress(listen.host, listen.port, home.peer_id, relay_id))
        assert connection.relayed_via == relay_id and dials.reversed == 0
        assert trio.current_time() - started >= REVERSAL_WAIT
        assert (await connection.call("echo", "relayed")).body == "relayed"


async def test_a_peer_behind_nat_replaces_a_relay_that_went_silent_within_a_renewal(autojump_clock):
    """A relay's machine goes off without a word: the peer behind NAT finds out at its next
    renewal (a sixth of the reservation's lifetime) and announces another relay, so the address
    others read in its declarations names a dead relay for tens of seconds, not minutes."""
    network = SimNetwork(seed=9)
    transports = [network.add_host() for _ in range(3)] + [network.add_host(behind_nat=True)]
    async with contextlib.AsyncExitStack() as stack:
        hosts = [
            await stack.enter_async_context(open_peer_host(network.identity(), transport=transport))
            for transport in transports
        ]
        home = hosts[3]
        initial = [host.listen_address for host in hosts[:3]]
        nursery = await stack.enter_async_context(trio.open_nursery())
        traversals = [
            NatTraversal(host, initial_peers=[a for a in initial if a.peer_id != host.peer_id]) for host in hosts
        ]
        for traversal in traversals:
            nursery.start_soon(traversal.run)
        await wait_until(lambda: len(home.presence.announced) == 2, timeout=60)
        await trio.sleep(0.1)  # (right after the reservations: the longest wait for a renewal)
        gone = home.presence.announced[0].relay
        [gone_transport] = [t for t, h in zip(transports, hosts, strict=True) if h.peer_id == gone]
        network.leave(gone_transport.address)
        left = trio.current_time()
        await wait_until(lambda: gone not in {a.relay for a in home.presence.announced}, timeout=120)
        # within a renewal (20 s of the default 120-s lifetime) and its call's timeout
        assert trio.current_time() - left <= 26.0
        assert RESERVATION_TTL * RENEW_AFTER + RELAY_CALL_TIMEOUT <= 26.0
        await wait_until(lambda: len(home.presence.announced) == 2, timeout=30)  # and another took its place
        nursery.cancel_scope.cancel()


async def test_closed_connections_of_a_host_behind_nat_are_forgotten(autojump_clock):
    """The network indexes a connection's ends by the machines at its two ends (a departure looks
    only at its host's own): one seen from a NAT's public address is forgotten all the same."""
    network = SimNetwork(seed=10)
    home, public = network.add_host(behind_nat=True), network.add_host()
    port, listener = await listening(network, public)
    accepted = []

    async def accept():
        accepted.append(await listener.accept())

    for _ in range(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            outgoing = await network.dial(home.address, public.address, port)
        await outgoing.aclose()
        await accepted[-1].aclose()
    assert network.open_ends(home.address) == 0 and network.open_ends(public.address) == 0


async def test_a_dial_through_a_relay_that_went_silent_fails_once_not_twice(autojump_clock):
    """A reachable dialer asks a relay whose machine went off for reversal: the relay's silence
    fails the dial after one call's timeout; it does not then wait as long again for a circuit."""
    network = SimNetwork(seed=13)
    relay_t, home_t, dialer_t = network.add_host(), network.add_host(behind_nat=True), network.add_host()
    async with (
        open_peer_host(network.identity(), transport=relay_t) as relay_host,
        open_peer_host(network.identity(), transport=home_t) as home,
        open_peer_host(network.identity(), transport=dialer_t) as dialer,
    ):
        Relay(relay_host)
        relay_id, _ = await RelayClient(home).reserve(relay_host.listen_address)
        RelayClient(dialer, reachable=lambda: True)
        listen = relay_host.listen_address
        await dialer.connect(listen)  # (a pooled connection to the relay, which then goes silent)
        await trio.sleep(1)
        assert dialer.connection_to(relay_host.peer_id) is not None
        network.leave(relay_t.address)
        started = trio.current_time()
        with pytest.raises(ConnectError):
            await dialer.connect(PeerAddress(listen.host, listen.port, home.peer_id, relay_id))
        assert trio.current_time() - started <= RELAY_CALL_TIMEOUT + 1


async def test_two_dials_of_one_peer_through_both_its_relays_share_one_reversal(autojump_clock):
    """A reachable dialer reaches a peer behind NAT at both of its relayed addresses at once: the
    second dial waits for the reversal the first asked for and takes its connection."""
    network = SimNetwork(seed=14)
    transports = [network.add_host(), network.add_host(), network.add_host(behind_nat=True), network.add_host()]
    async with contextlib.AsyncExitStack() as stack:
        hosts = [
            await stack.enter_async_context(open_peer_host(network.identity(), transport=transport))
            for transport in transports
        ]
        first_relay, second_relay, home, dialer = hosts
        client = RelayClient(home)
        relays = []
        for relay_host in (first_relay, second_relay):
            Relay(relay_host)
            relay_id, _ = await client.reserve(relay_host.listen_address)
            listen = relay_host.listen_address
            relays.append(PeerAddress(listen.host, listen.port, home.peer_id, relay_id))
        dials = RelayClient(dialer, reachable=lambda: True).dials
        reached = []

        async def dial(address):
            reached.append(await dialer.connect(address))

        async with trio.open_nursery() as nursery:
            for address in relays:
                nursery.start_soon(dial, address)
        assert len(reached) == 2 and reached[0] is reached[1] and reached[0].relayed_via is None
        assert dials.reversed == 1
