"""Fair admission: strangers cannot hold the door, one identity or address cannot take every seat.

The rules are checked on the plain ``Admission`` object; the floods run against a real host, with
the attacker's connections made from 127.0.0.2 (another host, as far as the server can tell) or
from the legitimate peer's own address."""

from __future__ import annotations

import socket

import pytest
import trio

from peer import Identity, open_peer_host
from peer.admission import Admission, address_group
from tests.wire.test_hostile import echo_router


def test_the_oldest_pending_handshake_of_a_full_address_yields_to_a_new_one() -> None:
    admission = Admission(max_pending=100, max_pending_per_address=3)
    for ticket in ("a1", "a2", "a3"):
        assert admission.handshake_started(ticket, "10.0.0.1") == []
    assert admission.handshake_started("a4", "10.0.0.1") == ["a1"]
    assert admission.handshake_started("b1", "10.0.0.2") == []  # another address is not affected
    admission.handshake_ended("a2")
    admission.handshake_ended("a2")  # twice is harmless
    assert admission.handshake_started("a5", "10.0.0.1") == []
    assert admission.pending == 4


def test_when_every_slot_is_taken_the_oldest_overall_yields() -> None:
    admission = Admission(max_pending=3, max_pending_per_address=3)
    for ticket, group in (("x", "1"), ("y", "2"), ("z", "3")):
        admission.handshake_started(ticket, group)
    assert admission.handshake_started("w", "4") == ["x"]
    assert admission.pending == 3


def test_connections_per_identity_replace_the_oldest_and_per_address_are_refused() -> None:
    admission = Admission(max_connections_per_address=3, max_connections_per_identity=2)
    assert admission.connection_opened("c1", "h", "alice") == []
    assert admission.connection_opened("c2", "h", "alice") == []
    assert admission.connection_opened("c3", "h", "alice") == ["c1"]  # alice reconnects: oldest goes
    assert admission.connection_opened("c4", "h", "bob") == []
    assert admission.connection_opened("c5", "h", "carol") is None  # address full
    admission.connection_closed("c4")
    assert admission.connection_opened("c5", "h", "carol") == []
    assert admission.connections == 3


def test_connections_in_all_are_capped() -> None:
    admission = Admission(max_connections=2, max_connections_per_identity=1)
    assert admission.connection_opened("c1", "a", "alice") == []
    assert admission.connection_opened("c2", None, "bob") == []
    assert admission.connection_opened("c3", "c", "carol") is None  # full, whatever the address
    assert admission.connection_opened("c4", "a", "alice") == ["c1"]  # a reconnect replaces its own


def test_ipv6_addresses_are_limited_per_64_prefix() -> None:
    assert address_group("2001:db8::1") == address_group("2001:db8::ffff:1") == "2001:db8::/64"
    assert address_group("2001:db8:0:1::1") != address_group("2001:db8::1")
    assert address_group("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_group("10.0.0.1") != address_group("10.0.0.2")


def test_loopback_peers_count_only_toward_the_totals() -> None:
    """One-host swarms reach each other through 127.0.0.1: per-address limits would cap them."""
    assert address_group("127.0.0.1") is None and address_group("::1") is None
    assert address_group("::ffff:127.0.0.2") is None
    admission = Admission(max_pending=3, max_pending_per_address=1, max_connections_per_address=1)
    assert admission.handshake_started("a", None) == [] and admission.handshake_started("b", None) == []
    assert admission.connection_opened("c1", None, "alice") == []
    assert admission.connection_opened("c2", None, "bob") == []  # no per-address refusal
    assert admission.handshake_started("c", None) == [] and admission.handshake_started("d", None) == ["a"]


async def idle_connections(count: int, port: int, source: str) -> list[socket.socket]:
    """``count`` TCP connections from ``source`` that never send a byte (plain sockets: cheap)."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        sockets.append(sock)
        if len(sockets) % 100 == 0:
            await trio.sleep(0)  # let the server accept as we go, as a real flood would
    return sockets


async def seconds_to_get_in(server) -> float:
    started = trio.current_time()
    with trio.fail_after(10):
        async with open_peer_host(Identity.generate(), listen=None, run_id="r") as client:
            connection = await client.connect(server.listen_address)
            assert (await connection.call("echo", "hello", timeout=5)).body == "hello"
    return trio.current_time() - started


@pytest.mark.parametrize("attacker_address", ["127.0.0.2", "127.0.0.1"])
async def test_a_legitimate_peer_gets_in_within_a_second_while_1000_idle_connections_are_held(attacker_address):
    """The attack that kept everyone out: 1,000 connections that never start their handshake. The
    server must keep only a bounded number of them pending and still admit the honest peer fast
    (1 s is the issue's bound; an unloaded handshake takes a few ms), whether the flood comes from
    another address or from the honest peer's own."""
    async with open_peer_host(Identity.generate(), router=echo_router(), run_id="r", handshake_timeout=30) as server:
        flood = await idle_connections(1000, server.listen_address.port, attacker_address)
        try:
            await trio.sleep(0.2)  # the server has accepted the flood
            assert server.admission.pending <= 512
            assert await seconds_to_get_in(server) < 1.0
        finally:
            for sock in flood:
                sock.close()


async def test_one_identity_cannot_open_unbounded_connections() -> None:
    async with open_peer_host(Identity.generate(), router=echo_router(), run_id="r") as server:
        attacker = Identity.generate()
        async with trio.open_nursery() as nursery:
            hosts = []
            for _ in range(12):  # each host dials separately: 12 connections of one identity
                hosts.append(await nursery.start(_hold_connection, attacker, server.listen_address))
            await trio.sleep(0.2)
            assert server.admission.connections <= server.admission.max_connections_per_identity
            assert await seconds_to_get_in(server) < 1.0
            nursery.cancel_scope.cancel()


async def _hold_connection(identity, address, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_peer_host(identity, listen=None, run_id="r") as host:
        await host.connect(address)
        task_status.started(host)
        await trio.sleep_forever()
