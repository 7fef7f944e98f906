"""Finding peers again after a link outage: a connection whose link went silent is dropped
(``peer/link_silence.py``), and a DHT node pings the contacts it evicted while they were away
until they answer (``dht/reconnect.py``)."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from dht.reconnect import (
    GIVE_UP_AFTER,
    MAX_LOST,
    PROBE_BURST,
    PROBE_MAX,
    PROBE_MIN,
    PROBE_RATE,
    LostContacts,
)
from dht.testing import Swarm
from peer import CallTimeoutError, Identity, Router, open_peer_host
from peer.link_silence import LinkSilence
from tests.support.remote_peer import remote_peer


def test_a_link_is_taken_for_down_only_after_it_said_nothing_for_the_limit():
    silence = LinkSilence(limit=10.0)
    frozen = (100, 200)
    assert not silence.call_timed_out(0.0, frozen, frozen, 2.0)
    assert not silence.call_timed_out(2.0, frozen, frozen, 4.0)  # silent since 0.0: 4 s
    assert silence.call_timed_out(8.0, frozen, frozen, 10.0)  # silent since 0.0: 10 s


def test_any_progress_or_answer_restarts_the_count():
    silence = LinkSilence(limit=10.0)
    assert not silence.call_timed_out(0.0, (1, 1), (1, 1), 9.0)
    # the peer's kernel acknowledged our bytes: a busy peer, not a dead link
    assert not silence.call_timed_out(9.0, (1, 1), (5, 1), 20.0)
    assert not silence.call_timed_out(20.0, (5, 1), (5, 1), 22.0)  # a new silence from 20.0
    # something moved between two silent calls: the silence starts again at the later call
    assert not silence.call_timed_out(25.0, (9, 9), (9, 9), 31.0)
    assert silence.call_timed_out(26.0, (9, 9), (9, 9), 35.0)
    silence.answered()
    assert not silence.call_timed_out(40.0, (9, 9), (9, 9), 42.0)


def test_a_long_call_sent_before_the_link_went_silent_does_not_restart_the_count():
    silence = LinkSilence(limit=10.0)
    assert not silence.call_timed_out(1.0, (5, 5), (5, 5), 3.0)  # silent since 1.0
    # sent at -5.0 and acknowledged before 1.0: it saw progress, but none since the silence began
    assert not silence.call_timed_out(-5.0, (1, 1), (5, 5), 7.0)
    assert silence.call_timed_out(9.0, (5, 5), (5, 5), 11.0)  # silent since 1.0: 10 s


def hanging_router() -> Router:
    router = Router()

    @router.unary("hang")
    async def hang(request):
        await trio.sleep_forever()

    @router.unary("echo")
    async def echo(request):
        return request.body

    return router


@asynccontextmanager
async def loopback_link(limit: float, **socket_says) -> AsyncIterator[tuple]:
    """A client's connection to a server with ``hanging_router``, its dead-link limit set to
    ``limit`` and, in ``socket_says``, what its socket reports (``link_progress``, ``in_flight``,
    ``unanswered_probes``): on loopback the kernel always answers, so a down link is told by hand.
    Yields (server, client, connection)."""
    async with open_peer_host(Identity.generate(), router=hanging_router()) as server:
        async with open_peer_host(Identity.generate(), listen=None) as client:
            connection = await client.connect(server.listen_address)
            connection.silence.limit = limit
            for name, value in socket_says.items():
                setattr(connection.channel, name, lambda value=value: value)
            yield server, client, connection


async def test_a_connection_whose_link_is_silent_is_dropped_and_the_next_call_dials_again():
    # A link that is down moves neither counter, and our request went out unacknowledged.
    async with loopback_link(60.0, link_progress=(0, 0), in_flight=100) as (server, client, connection):
        with pytest.raises(CallTimeoutError):
            await connection.call("hang", timeout=0.2)
        assert not connection.is_closed  # silent for less than the limit: not yet
        # (the limit shrinks instead of the test waiting it out: a loaded machine that fires
        # the first timeout late must not make the first call's check the one that drops)
        connection.silence.limit = 0.3
        with pytest.raises(CallTimeoutError):
            await connection.call("hang", timeout=0.2)  # silent since the first call: >= 0.4 s
        # the very next call dials afresh, even before the old connection's tasks wound down
        fresh = await client.connect(server.listen_address)
        assert fresh is not connection
        assert (await fresh.call("echo", 5, timeout=5)).body == 5
        with trio.fail_after(2):
            await connection.closed.wait()
        assert "said nothing" in connection.close_reason


async def test_a_link_lost_while_the_peer_was_not_reading_is_dropped_once_its_probes_go_unanswered():
    """The peer's receive window was closed when the path went down: nothing of ours is in flight
    (it all waits for the window), but the kernel's window probes go unanswered. A live peer's
    kernel answers them, so two unanswered in a row are evidence against the path."""
    probes = {"link_progress": (0, 0), "in_flight": 0, "unanswered_probes": 2}
    async with loopback_link(60.0, **probes) as (_, _, connection):
        with pytest.raises(CallTimeoutError):
            await connection.call("hang", timeout=0.2)
        connection.silence.limit = 0.3  # (as above: a late first timeout must not be the one that drops)
        with pytest.raises(CallTimeoutError):
            await connection.call("hang", timeout=0.2)
        with trio.fail_after(2):
            await connection.closed.wait()
        assert "said nothing" in connection.close_reason


async def test_a_busy_peer_whose_kernel_acknowledges_keeps_its_connection():
    async with loopback_link(0.3) as (_, _, connection):
        for _ in range(4):
            with pytest.raises(CallTimeoutError):
                await connection.call("hang", timeout=0.2)
        assert not connection.is_closed
        assert (await connection.call("echo", 1, timeout=5)).body == 1


async def test_calls_held_up_on_our_side_are_no_evidence_against_the_link():
    """Our own event loop held up (nothing of ours reached the kernel, so nothing waits for the
    peer's acknowledgement): frozen counters do not get a healthy connection dropped."""
    async with loopback_link(0.3, link_progress=(0, 0), in_flight=0) as (_, _, connection):
        for _ in range(4):
            with pytest.raises(CallTimeoutError):
                await connection.call("hang", timeout=0.2)
        assert not connection.is_closed


async def test_a_peer_that_stops_reading_keeps_its_connection():
    """A stopped process (or one too busy to read) closes its receive window, but its kernel still
    acknowledges what was sent: the link is alive, and the connection must be there when the peer
    reads again. Our unsent bytes are no evidence against the path; only sent, unacknowledged ones
    are."""
    async with remote_peer() as remote, open_peer_host(Identity.generate(), listen=None) as client:
        connection = await client.connect(remote.address)
        assert (await connection.call("echo", 1, timeout=10)).body == 1
        connection.silence.limit = 0.3
        remote.stop()
        # enough to fill its receive buffer and our send buffer: the rest waits in our queue
        with pytest.raises(CallTimeoutError):
            await connection.call("echo", payload=bytes(32 << 20), timeout=1.0)
        for _ in range(4):
            with pytest.raises(CallTimeoutError):
                await connection.call("echo", 2, timeout=0.2)
        assert connection.channel.in_flight() == 0  # our bytes wait in our queue, none on the wire
        assert connection.channel.unanswered_probes() < 2  # its kernel answers the window probes
        assert not connection.is_closed
        remote.resume()
        assert (await connection.call("echo", 3, timeout=20)).body == 3


def test_lost_contacts_are_retried_more_rarely_as_the_loss_ages():
    lost: LostContacts[str] = LostContacts(limit=3)
    lost.lost("a", "A", now=0.0)
    assert lost.due(0.5) == []
    assert lost.due(PROBE_MIN) == ["A"]
    assert lost.due(PROBE_MIN + 0.5) == []  # just tried
    assert lost.due(40.0) == ["A"]
    assert lost.next_due() == pytest.approx(45.0)  # every eighth of the 40 s outage
    assert lost.due(1000.0) == ["A"]
    assert lost.next_due() == pytest.approx(1000.0 + PROBE_MAX)
    lost.found("a")
    assert len(lost) == 0 and lost.next_due() is None
    for name in "bcde":  # bounded: the oldest losses go
        lost.lost(name, name.upper(), now=1.0)
    assert sorted(lost.due(5.0)) == ["C", "D", "E"]


def test_one_host_cannot_take_every_lost_contact_slot():
    # One machine with an identity per port, evicted together, must not push out the contacts of
    # other hosts that a real partition took away.
    lost: LostContacts[str] = LostContacts(limit=8)
    lost.lost("honest", "HONEST", now=0.0, host="10.0.0.1")
    for port in range(100):
        lost.lost(f"sybil{port}", f"S{port}", now=1.0 + port, host="10.6.6.6")
    due = lost.due(1000.0)
    assert "HONEST" in due
    assert sorted(due) == sorted(["HONEST", "S96", "S97", "S98", "S99"])  # the host's newest 4


def test_the_per_host_cap_on_lost_contacts_counts_an_ipv6_prefix_as_one_host():
    # One machine has a /64 to itself: an identity per address in it is one host's Sybils, as an
    # identity per port is. Loopback peers (a local swarm, one per GPU) are no one's Sybils.
    from types import SimpleNamespace

    from dht.background import Background
    from dht.contacts import Contacts
    from dht.liveness import PeerHealth
    from dht.routing import Contact, RoutingTable
    from peer import NodeIDProof, PeerAddress

    def contact(host: str) -> Contact:
        peer = Identity.generate().peer_id
        return Contact(NodeIDProof.solve(peer, 0), PeerAddress(host, 4000, peer))

    table = RoutingTable(Contact.for_id(0), ksize=64)
    sybils = [contact(f"2001:db8::{n + 1:x}") for n in range(20)]
    honest, local = contact("2001:db8:1::1"), [contact("127.0.0.1") for _ in range(6)]
    contacts = Contacts(
        SimpleNamespace(node_id_difficulty=0),
        table,
        Background(None),
        rpc_timeout=1.0,
        health=PeerHealth(evict_after=1),
    )
    for c in [honest, *local, *sybils]:
        table.add_contact(c)
        contacts.failed(c)
    remembered = [c for c in [honest, *local, *sybils] if contacts.lost.get(c.peer_id) is not None]
    assert remembered == [honest, *local, *sybils[-4:]]


def test_the_probes_of_a_churning_swarm_s_departures_keep_to_a_budget_and_take_turns():
    # A departure every 2 s from our table (a churning swarm): each is a contact nobody will hear
    # from again. Its probes together cost what the budget allows (840 a minute before), and every
    # due contact gets its turn within MAX_LOST / PROBE_RATE seconds.
    lost: LostContacts[int] = LostContacts()
    late_pings, longest_wait = 0, 0.0
    due_at: dict[int, float] = {}  # by the schedule: an eighth of the loss's age after each probe
    for second in range(1800):
        if second % 2 == 0:
            lost.lost(second, second, float(second), host=second)
            due_at[second] = second + PROBE_MIN
        for target in lost.due(float(second)):
            late_pings += second >= 1200
            longest_wait = max(longest_wait, second - due_at[target])
            due_at[target] = second + min(PROBE_MAX, max(PROBE_MIN, (second - target) / 8))
    assert late_pings <= 600 * PROBE_RATE + PROBE_BURST  # the budget over the last 10 minutes
    assert longest_wait <= MAX_LOST / PROBE_RATE + PROBE_MIN
    # an outage that heals now: its contacts are probed within a turn, among the churn's backlog
    for index in range(32):
        lost.lost(("outage", index), ("outage", index), 1800.0, host=("outage", index))
    first = next(t for t in range(1800, 2000) if any(isinstance(x, tuple) for x in lost.due(float(t))))
    assert first - 1800 <= MAX_LOST / PROBE_RATE + PROBE_MIN


def test_a_lost_contact_is_given_up_after_a_bounded_number_of_pings():
    # Its address is the one its hello announced, unchecked: a peer that announced another host's
    # address and left must not make us dial that host for good.
    lost: LostContacts[str] = LostContacts()
    lost.lost("a", "A", now=0.0)
    pings = 0
    while (when := lost.next_due()) is not None and when < 10 * GIVE_UP_AFTER:
        pings += len(lost.due(when))
    assert len(lost) == 0 and 0 < pings <= 100
    # the initial peers (the operator's choice) are never given up
    initial: LostContacts[str] = LostContacts(give_up_after=math.inf)
    initial.lost("x", "X", now=0.0)
    assert initial.due(10 * GIVE_UP_AFTER) == ["X"]


async def test_a_contact_evicted_while_away_is_found_again_when_it_comes_back():
    identity = Identity.generate()
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, None, ())
        away = await swarm.add(identity=identity)
        port = away.address.port
        node = await swarm.add([away.address])
        assert away.peer_id in node.routing_table
        await swarm.kill(away)
        with trio.fail_after(20):  # our requests to it fail until it is evicted
            while away.peer_id in node.routing_table:
                await node.find_nearest(random.getrandbits(160))
                await trio.sleep(0.1)
        # it comes back at the same address knowing nobody: only our reconnect can join the two
        back = await swarm.add(identity=identity, listen=("127.0.0.1", port))
        assert len(back.routing_table) == 0
        with trio.fail_after(10):
            while back.peer_id not in node.routing_table or node.peer_id not in back.routing_table:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


def test_a_caller_that_waits_for_next_due_is_handed_a_probe_every_time():
    # next_due() says when the budget allows a probe: a caller sleeping until then and calling
    # due() must get one, or under a clock that does not move while it runs (trio's autojump
    # clock) it asks again at the same instant for ever. Times as a monotonic clock gives them.
    lost: LostContacts[int] = LostContacts()
    base = 16354.161700447034
    for index in range(40):
        lost.lost(index, index, base, host=index)
    now = base + 1.0
    lost.due(now)  # the burst
    for step in (0.26933982156191344, 0.15440198055036697, 0.05219243816865793):
        now += step
        lost.due(now)  # the budget refills by fractions of a probe
    for _ in range(60):
        when = lost.next_due()
        assert lost.due(when), f"nothing handed out at next_due() = {when!r}"
