"""NAT traversal against a hostile remote: claims in hole-punch messages, dial-back answers and
raw circuit ends cost the attacker, never crash us or buy it more than a bounded share. Punches
dial from the listening port (the transport's ``connect_from``: over TCP ``peer/reuse_port.py``)."""

from __future__ import annotations

import socket
import struct

import pytest
import trio

from peer import BusyError, Identity, PeerAddress, Router, open_peer_host
from peer.holepunch import ATTEMPT_TIMEOUT, HolePuncher, connect_until, dialable
from peer.nat_state import DialBackLimiter
from peer.reachability import PUBLIC, UNKNOWN, ReachabilityService, check_reachability
from peer.relay import MAX_PENDING_PER_SOURCE, MAX_WAITING_ENDS
from peer.transport import TcpTransport
from tests.wire.test_relay import relayed, until  # noqa: F401 (a fixture)


async def test_a_punch_naming_a_host_that_cannot_be_encoded_costs_the_caller_only(relayed):  # noqa: F811
    """A punch's addresses are the caller's claims: one naming a host the resolver cannot even
    encode (IDNA) must fail that dial, not escape into the host and take the peer down."""
    relay_host, _, behind, dialer = relayed
    puncher = HolePuncher(behind, lambda: "127.0.0.1")
    listen = relay_host.listen_address
    connection = await dialer.connect(PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id))
    assert connection.relayed_via == relay_host.peer_id
    await connection.call("nat.punch", {"addresses": ["bad..host:1", "x" * 70 + ":2"]}, timeout=5)
    await connection.call("nat.sync", {"delay": 0}, timeout=5)
    with trio.fail_after(5):
        await until(lambda: not puncher.punching)
    assert (await connection.call("echo", "still here", timeout=5)).body["echo"] == "still here"
    # and a dial to such a host, however it got there, is one failed dial
    dial = TcpTransport().connect_from
    assert await connect_until(dial, ("127.0.0.1", 0), ("bad..host", 1), trio.current_time() + 1) is None


async def test_a_nat_verdict_needs_failures_from_two_distinct_peers():
    """One peer listed under two addresses (say an initial peer by name and by the address it
    announces) answers for one peer only: its two "could not dial you" make no NAT verdict."""
    router = Router()

    @router.unary("nat.dialback")
    async def lie(request):
        return {"reachable": False, "observed": ["127.0.0.1", 1], "reason": "says it could not"}

    async with open_peer_host(Identity.generate(), router=router) as liar, open_peer_host(Identity.generate()) as asker:
        listen = liar.listen_address
        servers = [PeerAddress(listen.host, listen.port), PeerAddress(listen.host, listen.port, liar.peer_id)]
        result = await check_reachability(asker, servers)
        assert result.status == UNKNOWN, result
        assert result.answers == 1


async def test_silent_circuit_ends_cannot_hold_the_relay_door(relayed):  # noqa: F811
    """Raw ends that open with the circuit byte and then say nothing cost a stranger nothing: they
    wait for their token under the same fair limits as pending handshakes (the oldest yields), so
    a crowd of them cannot keep a real circuit's ends out."""
    relay_host, relay, behind, dialer = relayed
    listen = relay_host.listen_address
    silent = []
    for _ in range(MAX_WAITING_ENDS + 8):
        stream = await trio.open_tcp_stream(listen.host, listen.port)
        await stream.send_all(b"\xff")
        silent.append(stream)
    address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
    with trio.fail_after(10):
        assert (await dialer.call(address, "echo", "through", timeout=5)).body["echo"] == "through"
    for stream in silent:
        await trio.aclose_forcefully(stream)


async def test_a_peer_that_says_it_dialed_us_back_must_have_done_so(monkeypatch):
    """ "reachable: true" is a claim: it counts only if that peer's dial-back connection really
    reached us. Otherwise one liar among the servers keeps a peer behind NAT from ever taking a
    relay (it would announce an address nobody can dial)."""
    monkeypatch.setattr("peer.reachability.DIALBACK_EVIDENCE", 0.3)
    router = Router()

    @router.unary("nat.dialback")
    async def lie(request):
        return {"reachable": True, "observed": ["127.0.0.1", 1], "reason": "says it could"}

    async with (
        open_peer_host(Identity.generate(), router=router) as liar,
        open_peer_host(Identity.generate()) as honest,
        open_peer_host(Identity.generate()) as asker,
    ):
        honest.service(ReachabilityService)
        assert (await check_reachability(asker, [liar.listen_address])).status == UNKNOWN
        result = await check_reachability(asker, [liar.listen_address, honest.listen_address])
        assert result.status == PUBLIC and result.answers == 1, result


async def test_a_punch_at_a_host_that_refuses_sends_it_a_handful_of_syns(autojump_clock):
    """A punch's addresses may name a third party. A refusal is retried (a NAT refuses until its
    own peer's SYN opens the mapping), but with growing pauses: a few dials per address, not one
    every 50 ms for the whole attempt, or each punch would send a victim over a hundred SYNs."""
    dials = []

    async def refuse(local, remote, timeout):
        dials.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        raise ConnectionRefusedError

    start = trio.current_time()
    assert await connect_until(refuse, ("127.0.0.1", 0), ("192.0.2.1", 9), start + ATTEMPT_TIMEOUT) is None
    assert 4 <= len(dials) <= 8, dials
    assert dials[1] - dials[0] < 0.2  # the first retry comes soon: the other side's SYN is near


async def test_a_punch_cannot_aim_a_peer_at_its_own_machine(relayed, monkeypatch):  # noqa: F811
    """A public peer's address is never loopback or unspecified (0.0.0.0 dials this machine): a
    punch naming one would have the peer send handshake bytes to its own local services."""
    relay_host, _, behind, dialer = relayed
    dials = []

    async def record(local, remote, timeout):
        dials.append(remote)
        await trio.lowlevel.checkpoint()
        raise ConnectionRefusedError

    monkeypatch.setattr(behind.transport, "connect_from", record)
    HolePuncher(behind, lambda: "198.51.100.7")
    listen = relay_host.listen_address
    connection = await dialer.connect(PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id))
    monkeypatch.setattr("peer.holepunch.ATTEMPT_TIMEOUT", 0.2)
    local = (["127.0.0.1:6379", "0.0.0.0:6379"], ["[::ffff:127.0.0.1]:6379"])
    for claims in (*local, ["192.0.2.1:9"]):  # then a public one
        await connection.call("nat.punch", {"addresses": claims}, timeout=5)
        await connection.call("nat.sync", {"delay": 0}, timeout=5)
    with trio.fail_after(5):
        await until(lambda: dials)
    assert dials[0] == ("192.0.2.1", 9), dials


def test_one_address_cannot_spend_everyone_s_dial_backs():
    """Dial-backs are limited per endpoint, but an endpoint's port is the caller's to choose: one
    host naming port after port would take the whole budget, and every newcomer's check would be
    refused (unknown reachability: a peer behind NAT then never looks for a relay)."""
    limiter = DialBackLimiter(0)
    granted = [limiter.start(f"198.51.100.7:{port}", 0, group="198.51.100.7") for port in range(1, 9)]
    assert granted[:4] == [None] * 4  # a few peers behind one NAT check at once
    assert all(why is not None and "address" in why for why in granted[4:]), granted
    assert limiter.start("203.0.113.9:31337", 0, group="203.0.113.9") is None  # others still get theirs
    assert limiter.start("198.51.100.7:99", 30, group="198.51.100.7") is None  # and it gets more later


async def test_servers_that_do_not_answer_are_passed_over_for_others():
    """The first servers listed (the initial peers) may be gone, or refuse: the check then asks
    the next ones rather than stay unknown forever (behind NAT that would mean never a relay)."""
    async with open_peer_host(Identity.generate()) as one, open_peer_host(Identity.generate()) as two:
        async with open_peer_host(Identity.generate()) as asker:
            for server in (one, two):
                server.service(ReachabilityService)
            gone = []
            for _ in range(3):
                closed = trio.socket.socket()
                await closed.bind(("127.0.0.1", 0))
                gone.append(PeerAddress("127.0.0.1", closed.getsockname()[1]))
                closed.close()
            result = await check_reachability(asker, [*gone, one.listen_address, two.listen_address])
            assert result.status == PUBLIC and result.answers == 2, result


async def test_one_source_cannot_take_every_slot_for_incoming_circuits(relayed, monkeypatch):  # noqa: F811
    """Each circuit the relay announces has us dial it and wait for a handshake; one source (a
    relay allows 8 circuits per peer) must leave room for others' circuits."""
    relay_host, _, behind, _ = relayed

    async def slow(address):
        await trio.sleep_forever()  # a slow relay: the circuit stays in setup

    monkeypatch.setattr(behind, "open_stream", slow)
    reservation = relay_host.connection_to(behind.peer_id)
    greedy, other = Identity.generate().peer_id, Identity.generate().peer_id

    async def incoming(source):
        body = {"source": source.to_bytes(), "token": bytes(16)}
        return await reservation.call("relay.incoming", body, timeout=5)

    for _ in range(MAX_PENDING_PER_SOURCE):
        await incoming(greedy)
    with pytest.raises(BusyError):
        await incoming(greedy)
    await incoming(other)


async def test_a_punch_address_that_resets_the_connection_costs_one_attempt_not_the_host(relayed):  # noqa: F811
    """The peer at the other end of a relayed connection names an address whose host accepts the
    punched connection and resets it before a byte: that attempt fails, and the dialer's host
    (every connection it holds) goes on."""
    relay_host, _, behind, dialer = relayed
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def reset_everyone(listener):
        while True:
            stream = await listener.accept()
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await trio.sleep(0.05)
            stream.socket.close()  # (lingering 0 s: a reset, not a FIN)

    async def punch(request):
        return {"addresses": [f"127.0.0.1:{port}"]}

    async def sync(request):
        return None

    behind.router.add_unary("nat.punch", punch)
    behind.router.add_unary("nat.sync", sync)
    puncher = HolePuncher(dialer, lambda: "127.0.0.1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reset_everyone, listeners[0])
        listen = relay_host.listen_address
        relayed_connection = await dialer.connect(
            PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
        )
        with trio.fail_after(10):
            await until(lambda: puncher.failures >= 1)
        assert (await relayed_connection.call("echo", "still here", timeout=5)).body["echo"] == "still here"
        nursery.cancel_scope.cancel()


def test_a_public_peer_is_never_aimed_into_its_own_network():
    """Addresses in punches and dial-back requests are claims. A peer seen at a public address
    dials only public ones (never its LAN, a carrier's shared space or a cloud's metadata
    service); a peer on a private network may dial its neighbours; loopback only on loopback."""
    public, private, loopback = "8.8.8.8", "10.1.2.3", "127.0.0.1"
    assert dialable("1.1.1.1", public) and dialable("2001:4860::8888", public)
    for claim in ("10.0.0.1", "192.168.1.1", "100.64.0.1", "169.254.169.254", "fe80::1", "127.0.0.1", "example.com"):
        assert not dialable(claim, public), claim
    assert dialable("192.168.1.1", private) and dialable("1.1.1.1", private)
    assert not dialable("169.254.169.254", private) and not dialable("127.0.0.1", private)
    assert dialable("127.0.0.1", loopback)
    assert not dialable("10.0.0.1", None) and not dialable("10.0.0.1", "0.0.0.0")  # (ours unknown: public only)
