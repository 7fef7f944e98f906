"""Peers behind NAT in the DHT (``dht/contacts.py``): on the simulated internet with its NATs,
real nodes run ``NatTraversal`` as ``peerd join`` does; a peer that announces a relayed address
is a client of the DHT (it asks, nobody asks it), as libp2p's Kademlia runs peers that are not
publicly reachable, and the swarm's keys are held by those others can dial."""

from __future__ import annotations

import trio

from dht import DHTNode
from peer import Router, open_peer_host
from peer.relay import RelayClient
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm


def told_everyone(swarm, behind: list[int]) -> bool:
    """Every peer behind NAT has told each peer connected to it its relayed addresses (a
    reservation is pushed to the connections after it is made, a round trip later)."""
    for index in behind:
        peer = swarm.nodes[index].peer_id
        for other in swarm.alive():
            connection = swarm.nodes[other].host.connection_to(peer)
            announced = connection.remote_listen_address if connection is not None else None
            if announced is not None and announced.relay is None:
                return False
    return True


async def test_peers_behind_nat_ask_the_dht_and_stay_out_of_every_routing_table(autojump_clock):
    network = SimNetwork(seed=11)
    async with open_sim_swarm(network, 16, nat_fraction=0.4) as swarm:
        behind = sorted(swarm.behind_nat)
        assert 3 <= len(behind) <= 12
        with trio.fail_after(120):
            while not all(swarm.traversals[i].client.reserved for i in behind) or not told_everyone(swarm, behind):
                await trio.sleep(1)
        # (before it knew, a peer behind NAT served those it had dialed: its hello named its listen port)
        served = {index: swarm.nodes[index].requests_served for index in behind}
        clock = swarm.clock
        for index in swarm.alive():  # every node stores a key and reads another's
            assert await swarm.nodes[index].store(f"key-{index}", index, clock.time() + 600)
        for index in swarm.alive():
            other = (index + 5) % len(swarm.nodes)
            assert (await swarm.nodes[index].get(f"key-{other}")).value == other
        nat_ids = {swarm.nodes[i].peer_id for i in behind}
        for index in swarm.alive():
            table = {contact.peer_id: contact for contact in swarm.nodes[index].routing_table.contacts()}
            assert not any(contact.address.relay is not None for contact in table.values())
            held = nat_ids & set(table)
            assert not held, f"node {index} holds peers behind NAT: {[str(table[p].address) for p in held]}"
        for index in behind:  # and once they announced a relay, nobody asked them
            assert swarm.nodes[index].requests_served == served[index], index


async def test_a_newcomer_that_joins_through_a_peer_behind_nat_joins_through_its_relay(autojump_clock):
    """An initial peer behind NAT (named by its relayed address, as its status page shows it) is a
    client of the DHT and never enters a table: the newcomer meets its relay instead, a public
    peer, and joins the swarm through it."""
    network = SimNetwork(seed=12)
    async with open_sim_swarm(network, 12, nat_fraction=0.4) as swarm:
        behind = sorted(swarm.behind_nat)
        with trio.fail_after(120):
            while not all(swarm.traversals[i].client.reserved for i in behind):
                await trio.sleep(1)
        for index in swarm.alive():
            assert await swarm.nodes[index].store(f"key-{index}", index, swarm.clock.time() + 600)
        entry = swarm.nodes[behind[0]].host.public_address
        assert entry.relay is not None
        async with open_peer_host(network.identity(), router=Router(), transport=network.add_host()) as host:
            RelayClient(host)  # (it dials relayed addresses, as every ``peerd join`` does)
            async with DHTNode.open(host=host, initial_peers=[entry], clock=swarm.clock) as newcomer:
                assert host.connection_to(entry.peer_id) is None  # (no circuit only to learn it is a client)
                assert len(list(newcomer.routing_table.contacts())) >= 5
                found = [await newcomer.get(f"key-{index}") for index in range(12)]
                assert all(record is not None for record in found)
