"""A simulated connection tells its link's state as a socket's kernel does
(``SimStream.link_counts``), so that the real dead-link check (``peer/link_silence.py``) runs on
the simulated internet: calls across a cut link close the connection after ``DEAD_LINK_SILENCE``,
and what they wrote dies with it instead of reaching the peer, stale, when the link heals (in the
64-peer churn scenario, a healed partition delivered ~13 stale pings per peer at once to the nodes
everyone talks to, each a fifth of that node's load over the run)."""

from __future__ import annotations

import trio

from peer import Message, Router, open_peer_host
from peer.link_silence import DEAD_LINK_SILENCE
from peer.simnet import RECEIVE_WINDOW_BYTES, SEGMENT_BYTES, SimNetwork
from tests.wire.test_simnet import connected


async def test_link_counts_say_what_arrived_and_what_a_cut_holds_in_flight(autojump_clock):
    network = SimNetwork(seed=21)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    await client.send_all(b"x" * 1000)
    assert client.link_counts() == (0, 0, 1000)  # sent, not arrived yet
    assert await server.receive_some() == b"x" * 1000
    assert client.link_counts() == (1000, 0, 0) and server.link_counts() == (0, 1000, 0)
    network.cut(a.address, b.address)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, b"y" * 500)  # held by the dead link
        await trio.sleep(30)
        assert client.link_counts() == (1000, 0, 500)  # in flight, as a kernel holds it unacknowledged
        network.heal(a.address, b.address)
    assert await server.receive_some() == b"y" * 500
    assert client.link_counts() == (1500, 0, 0)


async def test_bytes_on_their_way_when_the_link_is_cut_stay_in_flight_until_it_heals(autojump_clock):
    network = SimNetwork(seed=24)
    a, b = network.add_host(), network.add_host()
    client, server, _ = await connected(network, a, b)
    assert client.link_counts() == (0, 0, 0)
    await client.send_all(b"z" * 700)
    network.cut(a.address, b.address)  # before they arrive
    await trio.sleep(60)
    assert client.link_counts() == (0, 0, 700)  # a dead link delivers nothing, whenever they were due
    network.heal(a.address, b.address)
    assert await server.receive_some() == b"z" * 700
    assert client.link_counts() == (700, 0, 0)


async def test_a_write_held_by_a_full_window_is_not_in_flight(autojump_clock):
    network = SimNetwork(seed=22)
    a, b = network.add_host(), network.add_host()
    client, _server, _ = await connected(network, a, b)

    async def write_forever():
        while True:
            await client.send_all(bytes(SEGMENT_BYTES))  # the reader never reads

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_forever)
        await trio.sleep(3600)
        delivered, _, in_flight = client.link_counts()
        assert delivered >= RECEIVE_WINDOW_BYTES - SEGMENT_BYTES
        assert in_flight == 0  # (what waits for room waits in our own queue: the far kernel answers)
        nursery.cancel_scope.cancel()


async def test_calls_across_a_cut_drop_the_connection_and_never_reach_the_peer_stale(autojump_clock):
    network = SimNetwork(seed=23)
    served = []
    router = Router()

    async def ping(request):
        served.append(trio.current_time())
        return Message(None)

    router.add_unary("ping", ping)
    there, here = network.add_host(), network.add_host()
    async with open_peer_host(network.identity(), router=router, transport=there) as server:
        async with open_peer_host(network.identity(), listen=None, transport=here) as client:
            connection = await client.connect(server.listen_address)
            await connection.call("ping", None)
            network.cut(here.address, there.address)
            cut_at = trio.current_time()
            for _ in range(10):  # calls every 2 s, each timing out, for 20 s
                with trio.move_on_after(2.5):
                    try:
                        await connection.call("ping", None, timeout=2.0)
                    except Exception:
                        pass
                    await trio.sleep(2.5)
            assert connection.is_closed  # taken for dead once silent for DEAD_LINK_SILENCE
            network.heal(here.address, there.address)
            await trio.sleep(60)
            assert served and max(served) < cut_at  # none of the calls across the cut arrived later
            fresh = await client.connect(server.listen_address)
            await fresh.call("ping", None)
            assert len(served) == 2
    assert 20.0 > DEAD_LINK_SILENCE
