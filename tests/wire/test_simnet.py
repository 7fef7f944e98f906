"""The simulated internet (``peer/simnet``): the model alone, sans I/O (latencies, bandwidth, link
state), its streams under trio's virtual clock, and real hosts (Noise handshake, RPC) on it."""

from __future__ import annotations

import itertools
import math

import pytest
import trio

from peer import ConnectError, Identity, Message, PeerAddress, Router, open_peer_host
from peer.simnet import MBIT, RECEIVE_WINDOW_BYTES, SEGMENT_BYTES, NetworkModel, SimNetwork
from peer.simnet.network import LISTEN_BACKLOG
from peer.simnet.streams import SimStream


# ---------------------------------------------------------------------- the model, sans I/O
def test_rtts_are_symmetric_within_range_and_triangle_consistent():
    model = NetworkModel(seed=1)
    hosts = [model.add_host().address for _ in range(40)]
    rtts = [model.rtt(a, b) for a, b in itertools.combinations(hosts, 2)]
    assert 0.010 <= min(rtts) and max(rtts) <= 0.300
    assert max(rtts) - min(rtts) > 0.1  # a spread, not one number
    for a, b in itertools.combinations(hosts, 2):
        assert model.rtt(a, b) == model.rtt(b, a)
    for a, b, c in itertools.permutations(hosts[:15], 3):
        assert model.one_way_delay(a, c) <= model.one_way_delay(a, b) + model.one_way_delay(b, c) + 1e-12


def test_a_seed_decides_every_host():
    first, again, other = NetworkModel(seed=5), NetworkModel(seed=5), NetworkModel(seed=6)
    profiles = [first.add_host() for _ in range(20)]
    assert profiles == [again.add_host() for _ in range(20)]
    assert profiles != [other.add_host() for _ in range(20)]
    assert {(host.uplink / MBIT, host.downlink / MBIT) for host in profiles} <= {(10, 50), (20, 200), (100, 1000)}


def two_hosts(up_down_a, up_down_b):
    """A model with a host of each of two bandwidth mixes (seeded: always the same two)."""
    model = NetworkModel(seed=0, mixes=[up_down_a, up_down_b])
    by_mix = {}
    while len(by_mix) < 2:
        host = model.add_host()
        by_mix.setdefault((host.uplink / MBIT, host.downlink / MBIT), host.address)
    return model, by_mix[up_down_a], by_mix[up_down_b]


def transfer(model, source, destination, size, now=0.0):
    """Send ``size`` bytes as a stream does (segment after segment, each once the one before has
    left the uplink): when the last byte arrives."""
    arrives = now
    for start in range(0, size, SEGMENT_BYTES):
        segment = model.send(source, destination, now, min(SEGMENT_BYTES, size - start))
        now, arrives = segment.sent_at, segment.arrives_at
    return arrives


@pytest.mark.parametrize("size", [SEGMENT_BYTES, 10_000_000])
def test_a_transfer_takes_the_delay_plus_its_size_over_the_slower_end(size):
    model, dsl, fibre = two_hosts((10.0, 50.0), (100.0, 1000.0))
    up = transfer(model, dsl, fibre, size)  # limited by the DSL uplink
    assert up == pytest.approx(model.one_way_delay(dsl, fibre) + size / (10 * MBIT), rel=1e-9)
    later = 1000.0
    down = transfer(model, fibre, dsl, size, now=later) - later  # limited by the DSL downlink
    assert down == pytest.approx(model.one_way_delay(fibre, dsl) + size / (50 * MBIT), rel=1e-2)


def test_connections_share_their_hosts_uplink():
    model = NetworkModel(seed=3, mixes=[(10.0, 50.0)])
    source, first, second = (model.add_host().address for _ in range(3))
    size = 1_000_000
    one = model.send(source, first, 0.0, size)
    two = model.send(source, second, 0.0, size)
    assert one.sent_at == pytest.approx(size / (10 * MBIT))
    assert two.sent_at == pytest.approx(2 * size / (10 * MBIT))  # waited for the first to leave


def test_a_downlink_takes_segments_in_the_order_they_reach_it():
    model = NetworkModel(seed=4, mixes=[(10.0, 50.0)])
    receiver, *others = (model.add_host().address for _ in range(40))
    near = min(others, key=lambda other: model.one_way_delay(other, receiver))
    far = max(others, key=lambda other: model.one_way_delay(other, receiver))
    assert model.one_way_delay(far, receiver) - model.one_way_delay(near, receiver) > 0.05
    slow = model.send(far, receiver, 0.0, SEGMENT_BYTES)  # ~52 ms on a 10 Mbit/s uplink, then far
    small = model.send(near, receiver, 0.001, 200)
    assert small.arrives_at == pytest.approx(small.sent_at + model.one_way_delay(near, receiver))
    assert small.arrives_at < 0.02 < slow.arrives_at  # not held behind the far host's segment
    assert slow.arrives_at == pytest.approx(slow.sent_at + model.one_way_delay(far, receiver))


def test_cuts_partitions_and_departures_kill_links_until_healed():
    model = NetworkModel(seed=2)
    a, b, c, d = (model.add_host().address for _ in range(4))
    model.cut(a, b)
    assert not model.linked(a, b) and not model.linked(b, a) and model.linked(a, c)
    model.heal(b, a)
    assert model.linked(a, b)
    model.partition([[a, b]])  # c and d: the other side
    assert model.linked(a, b) and model.linked(c, d) and not model.linked(a, c) and not model.linked(d, b)
    late = model.add_host().address
    assert model.linked(late, c) and not model.linked(late, a)
    model.heal_partition()
    assert model.linked(a, c)
    model.remove_host(d)
    assert not model.linked(c, d) and not model.linked(d, c)


# ---------------------------------------------------------------------- streams, virtual time
async def connected(network, server_transport, client_transport):
    (host, port), [listener] = await server_transport.listen("ignored", 0)
    client = await client_transport.connect(PeerAddress(host, port))
    server = await listener.accept()
    return client, server, listener


async def receive_exactly(stream, size):
    got = 0
    while got < size:
        chunk = await stream.receive_some(1 << 20)
        assert chunk, "the stream ended early"
        got += len(chunk)


async def test_a_dial_takes_one_rtt_and_bytes_arrive_shaped_by_both_ends(autojump_clock):
    network = SimNetwork(seed=11, mixes=[(10.0, 50.0)])
    a, b = network.add_host(), network.add_host()
    assert (b.profile.uplink, a.profile.downlink) == (10 * MBIT, 50 * MBIT)
    start = trio.current_time()
    client, server, _ = await connected(network, a, b)  # b dials a
    assert trio.current_time() - start == pytest.approx(network.model.rtt(b.address, a.address))
    size = 2_000_000
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, bytes(size))
        await receive_exactly(server, size)
    took = trio.current_time() - start
    assert took == pytest.approx(network.model.one_way_delay(b.address, a.address) + size / (10 * MBIT))  # b's uplink


async def test_a_bulk_write_stands_for_bulk_scale_times_its_bytes_and_a_small_one_for_itself(autojump_clock):
    """As a simulated 1B-parameter model's averaging runs: tensors 100x smaller than modelled, their
    writes 100x as costly on the links; the small messages around them at their own size."""
    network = SimNetwork(seed=11, mixes=[(10.0, 50.0)], bulk_scale=100.0)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    delay = network.model.one_way_delay(b.address, a.address)
    for size, stands_for in [(200_000, 20_000_000), (1_500, 150_000), (1_024, 1_024), (300, 300)]:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, bytes(size))
            await receive_exactly(server, size)
        assert trio.current_time() - start == pytest.approx(delay + stands_for / (10 * MBIT)), size


async def test_a_small_message_waits_behind_bulk_writes_as_long_as_behind_the_bytes_they_stand_for(autojump_clock):
    """Four connections on one 100 Mbit/s uplink send 64 KiB (scaled 100x: 6.4 MB each) while a
    300-byte message goes out on a fifth: it takes its turn among their segments, as among real
    6.4 MB transfers, instead of waiting behind a whole 6.4 MB segment of each."""
    waits = {}
    for scale in (1.0, 100.0):
        network = SimNetwork(seed=21, mixes=[(100.0, 1000.0)], bulk_scale=scale)
        sender = network.add_host()
        pairs = [await connected(network, network.add_host(), sender) for _ in range(5)]
        size = round(6_400_000 / scale)
        async with trio.open_nursery() as nursery:
            for client, server, _ in pairs[:4]:
                nursery.start_soon(client.send_all, bytes(size))
                nursery.start_soon(receive_exactly, server, size)
            await trio.sleep(0.05)
            client, server, _ = pairs[4]
            start = trio.current_time()
            await client.send_all(bytes(300))
            await receive_exactly(server, 300)
            waits[scale] = trio.current_time() - start
    assert waits[100.0] == pytest.approx(waits[1.0], abs=0.01), waits


async def test_a_bulk_writers_window_holds_the_bytes_it_stands_for(autojump_clock):
    """A reader that never reads stops a bulk writer once the bytes its writes stand for fill the
    receive window, as it would stop the real transfer: 1/100 of the window in real bytes."""
    network = SimNetwork(seed=17, bulk_scale=100.0)
    client, server, _ = await connected(network, network.add_host(), network.add_host())
    sent = 0
    with trio.move_on_after(3600) as stalled:
        while True:
            await client.send_all(bytes(8192))
            sent += 8192
    assert stalled.cancelled_caught
    assert RECEIVE_WINDOW_BYTES / 100 - 8192 <= sent <= RECEIVE_WINDOW_BYTES / 100


async def test_bytes_arrive_whole_and_in_order(autojump_clock):
    network = SimNetwork(seed=12)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    data = bytes(range(256)) * 1000
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, memoryview(data))
        received = b""
        while len(received) < len(data):
            received += await server.receive_some(7919)
    assert received == data
    await client.aclose()
    assert await server.receive_some() == b""  # the end of the stream, after the data


async def test_a_cut_stops_delivery_until_it_heals(autojump_clock):
    network = SimNetwork(seed=13)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    await client.send_all(b"held")
    network.cut(a.address, b.address)  # while those bytes are in flight
    with trio.move_on_after(600):
        await server.receive_some()
        raise AssertionError("bytes crossed a cut link")
    with trio.move_on_after(600) as stalled:
        await client.send_all(b"more")
    assert stalled.cancelled_caught  # a sender stalls on a dead link, as on a full window
    network.heal(a.address, b.address)
    assert await server.receive_some() == b"held"
    with trio.fail_after(1):
        await client.send_all(b"after")
    assert await server.receive_some() == b"after"


async def test_dials_are_refused_without_a_listener_and_unanswered_across_a_cut(autojump_clock):
    network = SimNetwork(seed=14)
    a, b = network.add_host(), network.add_host()
    with pytest.raises(ConnectError) as refused:
        await a.connect(PeerAddress(b.address, 4000))
    assert refused.value.refused
    (host, port), _ = await b.listen("", 0)
    network.partition([a.address])
    start = trio.current_time()
    with pytest.raises(ConnectError, match="no answer") as unanswered:
        await a.connect(PeerAddress(host, port))
    assert not unanswered.value.refused and trio.current_time() - start == pytest.approx(a.connect_timeout)
    assert network.connections_total == 0  # (reports count connections made: each costs a handshake)
    network.heal_partition()
    await a.connect(PeerAddress(host, port))
    assert network.connections_total == 1


async def test_dials_beyond_a_full_backlog_get_no_answer_until_one_is_accepted(autojump_clock):
    network = SimNetwork(seed=18)
    a, b = network.add_host(), network.add_host()
    (host, port), [listener] = await b.listen("", 0)
    waiting = [await a.connect(PeerAddress(host, port)) for _ in range(LISTEN_BACKLOG)]
    start = trio.current_time()
    with pytest.raises(ConnectError, match="no answer"):
        await a.connect(PeerAddress(host, port))  # the backlog is full: the SYN goes unanswered
    assert trio.current_time() - start == pytest.approx(a.connect_timeout)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.connect, PeerAddress(host, port))
        await trio.sleep(1)
        accepted = await listener.accept()  # makes room: the dial's next try gets in
    assert accepted.remote == waiting[0].local and len(waiting) == LISTEN_BACKLOG


async def test_closing_a_listener_closes_the_connections_it_never_accepted(autojump_clock):
    network = SimNetwork(seed=19)
    a, b = network.add_host(), network.add_host()
    (host, port), [listener] = await b.listen("", 0)
    client = await a.connect(PeerAddress(host, port))
    await listener.aclose()
    with trio.fail_after(1):
        assert await client.receive_some() == b""  # the dialer sees the connection end
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"hello?")


async def test_a_host_that_leaves_breaks_its_own_ends_and_goes_silent(autojump_clock):
    network = SimNetwork(seed=15)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    network.leave(b.address)  # the dialing side's machine is switched off
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"x")
    with pytest.raises(trio.BrokenResourceError):
        await client.receive_some()
    with trio.move_on_after(3600) as silent:
        await server.receive_some()
    assert silent.cancelled_caught  # no end of stream from a machine that is gone
    await client.aclose()  # the departed host's tasks are cancelled and close their ends
    with trio.move_on_after(3600) as stalled:
        await server.send_all(b"anyone there?")
    assert stalled.cancelled_caught  # no reset either: the far end finds out by its deadline
    with trio.move_on_after(3600) as silent:
        await server.receive_some()
    assert silent.cancelled_caught


async def test_a_reader_waiting_on_a_host_that_leaves_is_woken_with_the_break(autojump_clock):
    network = SimNetwork(seed=16)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)  # b dialled: client is b's end
    outcome = []

    async def read() -> None:
        try:
            await client.receive_some()
        except trio.BrokenResourceError:
            outcome.append("broken")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()  # b's reader waits for bytes...
        network.leave(b.address)  # ...when b's machine goes off: its own ends break at once
        with trio.fail_after(1):
            while not outcome:
                await trio.sleep(0.01)
    assert outcome == ["broken"]


async def test_a_departure_looks_only_at_the_connections_of_the_host_that_leaves(autojump_clock, monkeypatch):
    """A swarm of N hosts holds ~60 N connection ends, and a churning one loses hosts all along."""
    network = SimNetwork(seed=17)
    a, b, c = network.add_host(), network.add_host(), network.add_host()
    others = [await connected(network, b, c) for _ in range(50)]
    client, server, _ = await connected(network, a, b)  # b dialled a: server is a's end
    await server.aclose()  # a's own end closed first: b's end still waits on the flows to a
    looked: list[object] = []
    flows = SimStream.flows
    monkeypatch.setattr(SimStream, "flows", property(lambda stream: looked.append(stream) or flows.fget(stream)))
    network.leave(a.address)
    assert len(looked) == 1  # b's end of the connection to a, not the 100 ends between b and c
    with trio.move_on_after(3600) as stalled:
        await client.receive_some()
    assert stalled.cancelled_caught  # b hears nothing more from a (its deadline finds out)
    for c_end, b_end, _ in others:  # the others' connections carry on
        await b_end.send_all(b"still here")
        assert await c_end.receive_some() == b"still here"


class TaskSteps(trio.abc.Instrument):
    """How many times each task ran."""

    def __init__(self):
        self.steps: dict[trio.lowlevel.Task, int] = {}

    def before_task_step(self, task):
        self.steps[task] = self.steps.get(task, 0) + 1


async def test_a_small_message_leaves_its_writer_at_once_and_wakes_its_reader_only_when_it_arrives(autojump_clock):
    network = SimNetwork(seed=18, mixes=[(10.0, 50.0)])
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    start = trio.current_time()
    await client.send_all(bytes(1000))  # within the send buffer: no wait for the uplink
    assert trio.current_time() == start
    assert await server.receive_some() == bytes(1000)
    arrivals: list[float] = []
    reader_task: list[trio.lowlevel.Task] = []

    async def read(count):
        reader_task.append(trio.lowlevel.current_task())
        for _ in range(count):
            await server.receive_some()
            arrivals.append(trio.current_time())

    steps, sent = TaskSteps(), []
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, 5)
            await trio.sleep(1.0)  # the reader is waiting for bytes
            for _ in range(5):
                sent.append(trio.current_time())
                await client.send_all(b"ping")
                await trio.sleep(1.0)
    finally:
        trio.lowlevel.remove_instrument(steps)
    delay = network.model.one_way_delay(b.address, a.address)
    assert arrivals == pytest.approx([at + delay for at in sent], abs=1e-3)
    # one step to start, then per message one wake-up at its arrival (and the checkpoint after it)
    assert steps.steps[reader_task[0]] <= 1 + 2 * 5


async def test_a_sender_waits_while_its_reader_leaves_a_full_window_unread(autojump_clock):
    network = SimNetwork(seed=17)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    sent = 0

    async def write_until(total):
        nonlocal sent
        while sent < total:
            await client.send_all(bytes(SEGMENT_BYTES))
            sent += SEGMENT_BYTES

    with trio.move_on_after(3600) as stalled:
        await write_until(2 * RECEIVE_WINDOW_BYTES)
    assert stalled.cancelled_caught  # the reader never read: the writer waits, nothing piles up
    assert RECEIVE_WINDOW_BYTES - SEGMENT_BYTES <= sent <= RECEIVE_WINDOW_BYTES
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_until, 2 * RECEIVE_WINDOW_BYTES)
            await receive_exactly(server, 2 * RECEIVE_WINDOW_BYTES)
    assert sent == 2 * RECEIVE_WINDOW_BYTES  # once the reader reads, the writer goes on


# ---------------------------------------------------------------------- real hosts on it
async def test_real_hosts_handshake_and_call_over_the_simulated_network(autojump_clock):
    network = SimNetwork(seed=16)
    router = Router()

    async def echo(request):
        return Message(request.body, payload=request.payload)

    router.add_unary("echo", echo)
    there, here = network.add_host(), network.add_host()
    rtt = network.model.rtt(here.address, there.address)
    async with open_peer_host(network.identity(), router=router, transport=there) as server:
        assert server.listen_address.host == there.address
        async with open_peer_host(network.identity(), listen=None, transport=here) as client:
            start = trio.current_time()
            connection = await client.connect(server.listen_address)
            handshake = trio.current_time() - start
            assert connection.remote_peer_id == server.peer_id
            assert 2 * rtt <= handshake < 4 * rtt  # the dial's RTT, Noise XX's 1.5 RTTs, the hellos
            start = trio.current_time()
            reply = await connection.call("echo", "hi")
            assert reply.body == "hi"
            assert trio.current_time() - start == pytest.approx(rtt, rel=0.05)
            # a payload of 1 MB each way is shaped by both ends' links
            payload = bytes(1_000_000)
            start = trio.current_time()
            reply = await connection.call("echo", "big", payload=payload, timeout=60)
            assert bytes(reply.payload) == payload
            slowest = min(here.profile.uplink, there.profile.downlink)
            back = min(there.profile.uplink, here.profile.downlink)
            least = rtt + len(payload) / slowest + len(payload) / back
            assert least - 1e-6 <= trio.current_time() - start < 1.5 * least


def test_identities_follow_the_seed():
    first, again = SimNetwork(seed=9), SimNetwork(seed=9)
    ids = [first.identity().peer_id for _ in range(3)]
    assert ids == [again.identity().peer_id for _ in range(3)]
    assert ids[0] != SimNetwork(seed=10).identity().peer_id
    assert isinstance(first.identity(), Identity)
    assert math.isfinite(first.add_host().connect_timeout)
