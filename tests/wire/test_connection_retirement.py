"""Idle connections are retired without losing a call: the idle bookkeeping and the GOAWAY rules
sans I/O, then real hosts on the simulated network under the virtual clock (and hand-driven peers
that do not keep the rules)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from peer import LOCAL_DIFFICULTY, ConnectionLost, Identity, Message, NodeIDProof, Router, open_peer_host
from peer.connection_pool import ConnectionPool
from peer.framing import ProtocolError
from peer.idle_connections import (
    IDLE_CHECK_S,
    IDLE_RETIRE_MAX,
    IDLE_RETIRE_S,
    RECUR_MARGIN,
    IdleConnections,
    RecurringPeers,
)
from peer.packing import packb, unpackb
from peer.rpc import RETIRE_GRACE
from peer.rpc_events import CallOpened, CallResult, PeerLeaving
from peer.rpc_protocol import RPCProtocol
from peer.secure_channel import PROTOCOL_VERSION, Hello, secure_handshake
from peer.simnet import SimNetwork

GOAWAY, UNARY = 9, 7


# ---------------------------------------------------------------------- which are idle, sans I/O
def test_a_connection_is_idle_once_nothing_moved_and_no_call_was_open_for_the_whole_time():
    idle = IdleConnections(retire_after=90)
    quiet, busy, chatty = "quiet", "busy", "chatty"
    assert idle.look([(quiet, ((10, 10), 0)), (busy, ((5, 5), 1)), (chatty, ((1, 1), 0))], now=0) == []
    assert idle.look([(quiet, ((10, 10), 0)), (busy, ((5, 5), 1)), (chatty, ((2, 1), 0))], now=60) == []
    # 90 s after the first look that saw it as it is now; an open call with no bytes moving is not idle
    assert idle.look([(quiet, ((10, 10), 0)), (busy, ((5, 5), 1)), (chatty, ((2, 1), 0))], now=90) == [quiet]
    assert idle.look([(busy, ((5, 5), 0)), (chatty, ((2, 1), 0))], now=149) == []
    assert idle.look([(busy, ((5, 5), 0)), (chatty, ((2, 1), 0))], now=150) == [chatty]
    assert idle.look([(busy, ((5, 5), 0)), (quiet, ((10, 10), 0))], now=240) == [busy]  # quiet: forgotten, new again
    with pytest.raises(ValueError):
        IdleConnections(retire_after=0)


def test_a_connection_allowed_longer_stays_until_its_own_allowance():
    idle = IdleConnections(retire_after=90)
    idle.allow("long", 300)
    idle.allow("short", 30)  # never below the base
    connections = [("long", ((1, 1), 0)), ("short", ((1, 1), 0)), ("plain", ((1, 1), 0))]
    assert idle.look(connections, now=0) == []
    assert sorted(idle.look(connections, now=90)) == ["plain", "short"]
    assert idle.look([("long", ((1, 1), 0))], now=299) == []
    assert idle.look([("long", ((1, 1), 0))], now=300) == ["long"]
    idle.look([], now=301)  # retiring: the looks no longer see it, but its allowance stays...
    assert idle.allowance("long") == 300
    idle.forget("long")  # ...until it is gone
    assert idle.allowance("long") == 90


def test_a_peer_called_again_after_its_connection_was_retired_may_stay_idle_as_long_as_its_quiet():
    recurring = RecurringPeers(base=90, maximum=IDLE_RETIRE_MAX, remembered=2)
    assert recurring.connected("once", now=0) == 90  # a peer met for the first time
    # rounds two minutes apart: retired 90 s after the last call, called again 30 s later
    recurring.retired("round", now=100, idle_for=90)
    assert recurring.connected("round", now=130) == RECUR_MARGIN * 120
    assert recurring.connected("round", now=400) == RECUR_MARGIN * 120  # it keeps its allowance
    # a longer rhythm is learnt from a retirement under the longer allowance; capped
    recurring.retired("round", now=1000, idle_for=RECUR_MARGIN * 120)
    assert recurring.connected("round", now=1500) == IDLE_RETIRE_MAX
    recurring.retired("gone", now=0, idle_for=90)
    assert recurring.connected("gone", now=IDLE_RETIRE_MAX + 1) == 90  # came back too late to be a rhythm
    # bounded: the least recently met peers are forgotten
    for peer in ("a", "b", "c"):
        recurring.retired(peer, now=2000, idle_for=90)
        recurring.connected(peer, now=2010)
    assert recurring.connected("round", now=2020) == 90


def test_a_peer_that_comes_back_too_late_for_a_rhythm_loses_its_long_allowance():
    recurring = RecurringPeers(base=90, maximum=600)
    recurring.retired("p", now=100, idle_for=90)
    assert recurring.connected("p", now=130) == 180  # a rhythm: 1.5 x 120 s
    recurring.retired("p", now=1000, idle_for=180)
    assert recurring.connected("p", now=1000 + 3600) == 90  # an hour later: a peer met once again


class QuietConnection:
    """What the pool reads of a connection that carries nothing."""

    def __init__(self, peer: str = "p", relayed_via: str | None = None):
        self.remote_peer_id, self.relayed_via = peer, relayed_via
        self.takes_calls, self.retired = True, False
        self.protocol = SimpleNamespace(active_calls=0)

    def link_progress(self) -> tuple[int, int]:
        return (1, 1)

    def goaway(self) -> None:  # one side said GOAWAY and the other answered
        self.takes_calls, self.retired = False, True


def first_retirement(pool: ConnectionPool, connection, since: float, until: float = 5000.0) -> float:
    """When the pool's looks (every IDLE_CHECK_S from ``since``) first find ``connection`` idle."""
    now = since
    while now <= until:
        if connection in pool.idle(now):
            return now
        now += IDLE_CHECK_S
    raise AssertionError(f"not retired by {until}")


def test_what_a_retirement_teaches_is_the_quiet_the_looks_saw_whoever_ended_it():
    pool = ConnectionPool(retire_idle_after=90)
    first = QuietConnection()
    pool.add(first, 0.0)
    assert first_retirement(pool, first, 0.0) == 90
    first.goaway()
    pool.remove(first, 91.0)
    second = QuietConnection()
    pool.add(second, 121.0)  # back 30 s later: 1.5 x (30 + 91) s
    retired_at = first_retirement(pool, second, 135.0)
    assert retired_at - 135.0 >= 1.5 * 120
    second.goaway()
    pool.idle(retired_at + IDLE_CHECK_S)  # a look while it drains (a call crossed the GOAWAY)
    pool.remove(second, retired_at + IDLE_CHECK_S + 1)
    third = QuietConnection()
    back = retired_at + IDLE_CHECK_S + 61
    pool.add(third, back)  # it came back from its whole quiet and 60 s, not from 90 s and 60 s
    assert first_retirement(pool, third, back + IDLE_CHECK_S) - (back + IDLE_CHECK_S) >= 1.5 * (180 + 60)
    # the peer retires it after its own 90 s: we learn those 90 s, not our longer allowance
    third.goaway()
    pool.remove(third, back + IDLE_CHECK_S + 91)
    fourth = QuietConnection()
    again = back + IDLE_CHECK_S + 91 + 30
    pool.add(fourth, again)
    assert first_retirement(pool, fourth, again) - again <= 1.5 * (91 + 30 + IDLE_CHECK_S) + IDLE_CHECK_S


def test_a_duplicate_retired_beside_a_live_connection_teaches_no_rhythm():
    # Two connections to one peer (they dialled each other at once): the quiet one retiring while
    # the other still takes calls says nothing of the peer's quiet, so the peer's next connection
    # gets the base allowance, not one stretched to a rhythm it never had.
    pool = ConnectionPool(retire_idle_after=90)
    busy, duplicate = QuietConnection(), QuietConnection()
    pool.add(busy, 0.0)
    pool.add(duplicate, 0.0)
    assert first_retirement(pool, duplicate, 0.0) == 90
    duplicate.goaway()
    pool.remove(duplicate, 91.0)
    busy.takes_calls = False  # then the busy one breaks (not retired)
    pool.remove(busy, 300.0)
    fresh = QuietConnection()
    pool.add(fresh, 300.0)
    assert first_retirement(pool, fresh, 300.0) == 390


def test_a_relayed_connection_goes_after_the_base_allowance_however_its_peer_recurs():
    pool = ConnectionPool(retire_idle_after=90)
    for start in (0.0, 120.0, 240.0):  # a relayed peer called every two minutes
        relayed = QuietConnection(relayed_via="relay")
        pool.add(relayed, start)
        assert first_retirement(pool, relayed, start) == start + 90
        relayed.goaway()
        pool.remove(relayed, start + 91)


# ---------------------------------------------------------------------- GOAWAY, sans I/O
def pair() -> tuple[RPCProtocol, RPCProtocol]:
    return RPCProtocol(initiator=True), RPCProtocol(initiator=False)


def test_goaway_is_answered_and_both_sides_are_drained_once_every_call_ended():
    a, b = pair()
    # b's call crosses a's GOAWAY in flight: a still serves it
    call_id, request = b.open_unary("m", None, 0, None)
    goaway = a.go_away()
    assert a.go_away() is None  # said once
    assert b.receive_header(goaway) == [PeerLeaving()]
    answer = b.go_away()
    assert not b.drained  # its call is still open
    (opened,) = a.receive_header(request)
    assert isinstance(opened, CallOpened) and opened.call_id == call_id
    assert a.receive_header(answer) == [PeerLeaving()]
    assert not a.drained  # the crossing call is still being served
    result = a.send_result(call_id, "done", 0)
    assert a.drained
    assert b.receive_header(result) == [CallResult(call_id, "done", b"")]
    assert b.drained


def test_no_call_opens_after_goaway_and_a_peer_that_opens_one_breaks_the_protocol():
    a, b = pair()
    goaway = a.go_away()
    with pytest.raises(RuntimeError):
        a.open_unary("m", None, 0, None)
    with pytest.raises(RuntimeError):
        a.open_stream("m", None)
    assert b.receive_header(goaway) == [PeerLeaving()]
    cheater = RPCProtocol(initiator=True)
    said = cheater.go_away()
    _, request = RPCProtocol(initiator=True).open_unary("m", None, 0, None)  # what it sends anyway
    victim = RPCProtocol(initiator=False)
    victim.receive_header(said)
    with pytest.raises(ProtocolError, match="after GOAWAY"):
        victim.receive_header(request)
    with pytest.raises(ProtocolError):  # sticky
        victim.receive_header(packb([GOAWAY, 0]))


@pytest.mark.parametrize("header", [[GOAWAY, 1], [GOAWAY], [GOAWAY, 0, 0], [GOAWAY, -1]])
def test_a_malformed_goaway_breaks_the_protocol(header):
    with pytest.raises(ProtocolError):
        RPCProtocol(initiator=False).receive_header(packb(header))


# ---------------------------------------------------------------------- real hosts
def echo_router() -> Router:
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return Message(request.body)

    @router.unary("slow_echo")
    async def slow_echo(request):
        await trio.sleep(0.5)
        return Message(request.body)

    @router.stream("hold")
    async def hold(stream):
        await trio.sleep(math.inf)

    @router.stream("three")
    async def three(stream):
        for number in range(3):
            await stream.send(number)

    @router.unary("longer_than_the_grace")
    async def longer_than_the_grace(request):
        await trio.sleep(RETIRE_GRACE + 10)
        return Message("done")

    @router.unary("large")
    async def large(request):
        await trio.sleep(0.5)
        return Message("ok", b"x" * (8 << 20))

    return router


async def test_an_idle_connection_is_retired_on_both_sides_and_the_next_call_dials_again(autojump_clock):
    network = SimNetwork(seed=21)
    async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as server:
        async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as client:
            first = await client.connect(server.listen_address)
            assert (await first.call("echo", "hi")).body == "hi"
            last_call = trio.current_time()
            theirs = server.connection_to(client.peer_id)
            assert theirs is not None
            with trio.fail_after(IDLE_RETIRE_S + 2 * IDLE_CHECK_S + 5):
                await first.closed.wait()
                await theirs.closed.wait()
            assert trio.current_time() - last_call >= IDLE_RETIRE_S
            assert "retired" in first.close_reason and first.retired and theirs.retired  # (not "dropped")
            assert client.connection_to(server.peer_id) is None
            with pytest.raises(ConnectionLost, match="retir|closed"):
                await first.call("echo", "on the old one")
            again = await client.connect(server.listen_address)
            assert again is not first and (await again.call("echo", "again")).body == "again"


async def test_a_peer_called_every_two_minutes_keeps_its_connection_once_it_came_back(autojump_clock):
    # Rounds further apart than the idle limit: the first quiet retires the connection, the call
    # after it shows a rhythm, and from then on the same connection carries every round.
    network = SimNetwork(seed=24)
    async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as server:
        async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as client:
            first = await client.connect(server.listen_address)
            await first.call("echo", "round 1")
            await trio.sleep(120)
            assert first.closed.is_set() and first.retired
            again = await client.connect(server.listen_address)
            await again.call("echo", "round 2")
            for number in range(3, 7):
                await trio.sleep(120)
                assert client.connection_to(server.peer_id) is again, f"round {number} dialled again"
                assert (await again.call("echo", number)).body == number
            await trio.sleep(IDLE_RETIRE_MAX + 2 * IDLE_CHECK_S)  # the rhythm ends: it still goes
            assert again.closed.is_set() and again.retired


async def test_a_connection_with_an_open_call_is_not_retired_however_quiet(autojump_clock):
    network = SimNetwork(seed=22)
    async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as server:
        async with open_peer_host(network.identity(), listen=None, transport=network.add_host()) as client:
            connection = await client.connect(server.listen_address)
            async with connection.stream("hold"):
                await trio.sleep(10 * IDLE_RETIRE_S)
                assert connection.takes_calls and not connection.closed.is_set()
            with trio.fail_after(IDLE_RETIRE_S + 2 * IDLE_CHECK_S + 5):
                await connection.closed.wait()  # once the call ended, it is idle like any other


@pytest.mark.parametrize("second_dial_after", [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5])
async def test_two_peers_dialled_to_each_other_and_both_connections_retire_when_idle(autojump_clock, second_dial_after):
    # Each host pools one connection per peer. When two peers dial each other while the first
    # handshake is under way, the second connection can find each of its ends with a pooled
    # connection beside it. It still carries its dialer's calls, and must retire like any other
    # once quiet: a node joining a large DHT is dialled back by peers it is dialling, and every
    # connection left behind would hold buffers and tasks on both peers for as long as they run.
    network = SimNetwork(seed=25)
    here, there = network.add_host(), network.add_host()
    async with open_peer_host(network.identity(), router=echo_router(), transport=here) as one:
        async with open_peer_host(network.identity(), router=echo_router(), transport=there) as two:
            dialled: dict[str, Any] = {}

            async def dial_and_call(name: str, host: Any, address: Any, after: float) -> None:
                await trio.sleep(after)
                dialled[name] = connection = await host.connect(address)
                await connection.call("echo", name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dial_and_call, "one", one, two.listen_address, 0.0)
                nursery.start_soon(dial_and_call, "two", two, one.listen_address, second_dial_after)
            await trio.sleep(IDLE_RETIRE_S + 2 * IDLE_CHECK_S + 1)
            assert dialled["one"].closed.is_set() and dialled["two"].closed.is_set()
            assert network.open_ends(here.address) == 0


async def read_all(connection, method: str) -> list:
    got = []
    async with connection.stream(method) as stream:
        async for message in stream:
            got.append(message.body)
            await trio.sleep(0.2)  # the caller works on each message
    return got


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("slow_echo", lambda c: c.call("slow_echo", "crossing", timeout=10)),
        ("longer_than_the_grace", lambda c: c.call("longer_than_the_grace", timeout=RETIRE_GRACE + 30)),
        ("large", lambda c: c.call("large", timeout=60)),
        ("three", lambda c: read_all(c, "three")),
    ],
)
async def test_a_call_that_crosses_the_goaway_in_flight_is_answered_in_full(autojump_clock, method, expected):
    network = SimNetwork(seed=23)
    async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as server:
        async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as client:
            ours = await client.connect(server.listen_address)
            await ours.call("echo", "warm")
            theirs = server.connection_to(client.peer_id)
            results = []

            async def call() -> None:
                results.append(await expected(ours))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()  # the request is on its way...
                theirs.retire()  # ...when the server says GOAWAY
                while ours.takes_calls:  # (virtual time: until the GOAWAY has arrived)
                    await trio.sleep(0.001)
                # while it drains: no new call goes on it, and the pool dials a fresh connection
                assert client.connection_to(server.peer_id) is None and server.connection_to(client.peer_id) is None
                with pytest.raises(ConnectionLost, match="retiring"):
                    await ours.call("echo", "on the retiring one")
                fresh = await client.connect(server.listen_address)
                assert fresh is not ours and (await fresh.call("echo", "fresh")).body == "fresh"
            (result,) = results
            if method == "three":
                assert result == [0, 1, 2]
            elif method == "large":
                assert result.body == "ok" and len(result.payload) == 8 << 20
            else:
                assert result.body in ("crossing", "done")
            with trio.fail_after(5):
                await ours.closed.wait()
                await theirs.closed.wait()
            assert ours.retired and theirs.retired and "retired" in ours.close_reason + theirs.close_reason


async def until_closed(channel) -> None:
    """Read (and drop) records until the other side closes the connection."""
    with pytest.raises((trio.EndOfChannel, trio.BrokenResourceError)):
        while True:
            await channel.receive_record()


async def hand_driven(network: SimNetwork, address) -> tuple[Identity, object]:
    """A secure channel to ``address`` from a peer that follows no rule unless told."""
    identity = network.identity()
    nonce = NodeIDProof.solve(identity.peer_id, LOCAL_DIFFICULTY).nonce
    stream = await network.add_host().connect(address)
    hello = Hello(PROTOCOL_VERSION, "default", node_id_nonce=nonce)
    return identity, await secure_handshake(stream, identity, hello, initiator=True, timeout=10)


async def test_a_peer_that_never_answers_goaway_is_closed_on_after_the_grace(autojump_clock):
    network = SimNetwork(seed=24)
    async with open_peer_host(network.identity(), router=echo_router(), transport=network.add_host()) as server:
        identity, channel = await hand_driven(network, server.listen_address)
        await channel.send_record(packb([UNARY, 1, "echo", None, "x", 0]))
        assert unpackb(await channel.receive_record())[:3] == [8, 1, "x"]
        start = trio.current_time()
        assert unpackb(await channel.receive_record()) == [GOAWAY, 0]  # idle: the server leaves
        assert start + IDLE_RETIRE_S - 1 <= trio.current_time() <= start + IDLE_RETIRE_S + 2 * IDLE_CHECK_S
        said = trio.current_time()
        with trio.fail_after(RETIRE_GRACE + 5):
            await until_closed(channel)
        assert trio.current_time() - said >= RETIRE_GRACE - 1
        assert server.connection_to(identity.peer_id) is None


async def test_a_peer_that_calls_after_its_own_goaway_is_not_served(autojump_clock):
    network = SimNetwork(seed=25)
    served = []
    router = Router()

    @router.unary("note")
    async def note(request):
        served.append(request.body)

    async with open_peer_host(network.identity(), router=router, transport=network.add_host()) as server:
        identity, channel = await hand_driven(network, server.listen_address)
        await channel.send_record(packb([GOAWAY, 0]))
        await channel.send_record(packb([UNARY, 1, "note", None, "late", 0]))
        with trio.fail_after(5):
            await until_closed(channel)
        assert served == [] and server.connection_to(identity.peer_id) is None
