"""Peers behind NAT in the DHT (``dht/contacts.py``): on the simulated internet with its NATs,
real nodes run ``NatTraversal`` as ``peerd join`` does; a peer that announces a relayed address
is a client of the DHT (it asks, nobody asks it), as libp2p's Kademlia runs peers that are not
publicly reachable, and the swarm's keys are held by those others can dial."""

from __future__ import annotations

import trio

from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm


async def test_peers_behind_nat_ask_the_dht_and_stay_out_of_every_routing_table(autojump_clock):
    network = SimNetwork(seed=11)
    async with open_sim_swarm(network, 16, nat_fraction=0.4) as swarm:
        behind = sorted(swarm.behind_nat)
        assert 3 <= len(behind) <= 12
        with trio.fail_after(120):
            while not all(swarm.traversals[i].client.reserved for i in behind):
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
