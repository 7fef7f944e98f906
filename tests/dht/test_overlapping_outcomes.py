"""Requests run to their own deadlines whoever stopped waiting, so the outcomes of requests that
overlapped in time all land: one stall of an honest peer must cost it one strike, not one per
request that happened to be in flight during it."""

from __future__ import annotations

import trio

from dht.background import Background
from dht.contacts import Contacts
from dht.routing import Contact, RoutingTable
from dht.testing import placed_contact
from peer import PeerAddress, Router, open_peer_host
from peer.simnet import SimNetwork


async def test_one_stall_of_an_honest_peer_is_one_strike_however_many_requests_it_caught(autojump_clock) -> None:
    network = SimNetwork(seed=51)
    router = Router()
    stalls = {"left": 0}

    @router.unary("dht.ping")
    async def ping(request):
        if stalls["left"]:
            stalls["left"] -= 1
            await trio.sleep(3.0)  # a GC pause or a busy event loop, past the request deadline
        return "pong"

    async with (
        open_peer_host(network.identity(), transport=network.add_host()) as host,
        open_peer_host(network.identity(), router=router, transport=network.add_host()) as honest,
        trio.open_nursery() as nursery,
    ):
        table = RoutingTable(placed_contact(0), 20)
        contacts = Contacts(host, table, Background(nursery), rpc_timeout=2.0)
        endpoint = honest.listen_address
        peer = Contact(honest.node_id, PeerAddress(endpoint.host, endpoint.port, honest.peer_id))
        assert await contacts.call(peer, "dht.ping", None) is not None  # connected, and in our table
        assert table.get(peer.peer_id) is not None
        stalls["left"] = 3

        async def lookup_done_elsewhere() -> None:
            with trio.move_on_after(0.2):  # another holder answered: this lookup stops waiting
                await contacts.call(peer, "dht.ping", None)

        async with trio.open_nursery() as lookups:  # three lookups meet the peer during one stall
            for _ in range(3):
                lookups.start_soon(lookup_done_elsewhere)
        await trio.sleep(5.0)  # the stall is over; every request has met its deadline
        assert table.get(peer.peer_id) is not None, "evicted for a single stall"
        nursery.cancel_scope.cancel()
