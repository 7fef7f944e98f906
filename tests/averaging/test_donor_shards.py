"""Donor offers spread over shards and stored rarely (``averaging/state_sharing.py``): a newcomer
reads only as many shards as hold the donors it needs, a peer is listed only in its own shard, and
an averaging round costs a donor no DHT store once its offer is fresh."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from averaging.averager import GroupAverager
from averaging.state_sharing import (
    DONOR_REFRESH,
    DONOR_SHARDS,
    DONOR_TTL,
    DONORS_WANTED,
    SHARDS_PER_READ,
    DonorAnnouncer,
    StateSharing,
    StateUnavailable,
    donor_shard,
)
from dht.node import DHTNode
from dht.peer_dictionary import peer_entries, peer_subkey
from peer import LOCAL_DIFFICULTY, Identity, NodeIDProof
from peer.clock import SYSTEM_CLOCK, TrioClock
from peer.node_id import NONCE_BYTES

PREFIX = "sharded.state"


async def run_node(initial, clock=SYSTEM_CLOCK, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(initial_peers=initial, clock=clock) as node:
        task_status.started(node)
        await trio.sleep(math.inf)


class CountingDHT:
    """A DHT node seen through what a caller asks of it: the keys it reads and stores."""

    def __init__(self, node: DHTNode):
        self.node, self.host, self.clock = node, node.host, node.clock
        self.gets: list[str] = []
        self.stores: list[str] = []

    async def get(self, key, latest=False):
        self.gets.append(key)
        return await self.node.get(key, latest=latest)

    async def store(self, key, value, expiration_time, subkey=None):
        self.stores.append(key)
        return await self.node.store(key, value, expiration_time, subkey=subkey)


def test_an_offer_is_stored_again_only_when_due():
    announcer = DonorAnnouncer()
    assert announcer.due(0.0, "a")
    announcer.stored(0.0, "a")
    assert not announcer.due(DONOR_REFRESH - 0.1, "a")
    assert announcer.due(0.0, "b")  # a new address is announced at once
    assert announcer.due(DONOR_REFRESH, "a")
    announcer.stored(DONOR_REFRESH, "a")
    assert not announcer.due(DONOR_REFRESH + 1.0, "a")


def test_shards_spread_peers_over_every_key():
    shards = [donor_shard(NodeIDProof.solve(Identity.generate().peer_id, LOCAL_DIFFICULTY).node_id) for _ in range(400)]
    counts = [shards.count(shard) for shard in range(DONOR_SHARDS)]
    assert min(counts) > 0 and max(counts) < 3 * 400 / DONOR_SHARDS, counts


async def test_a_newcomer_reads_only_the_shards_it_needs_and_each_offer_from_its_owners_shard():
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        nodes = [first] + [await nursery.start(run_node, [first.address]) for _ in range(24)]
        state = [torch.ones(8)]
        for node in nodes[:-1]:
            await GroupAverager([t.clone() for t in state], node, prefix=PREFIX).state_sharing.announce(3)
        newcomer = CountingDHT(nodes[-1])
        sharing = StateSharing(newcomer.host, newcomer, PREFIX, owner=None)
        with trio.fail_after(30):
            donors = await sharing.donors()
        assert len(donors) >= DONORS_WANTED
        assert len(newcomer.gets) in (SHARDS_PER_READ, 3 * SHARDS_PER_READ), newcomer.gets
        assert len(set(donors)) == len(donors)
        read = {int(key.rsplit(".", 1)[1]) for key in newcomer.gets}
        node_ids = {node.host.peer_id: node.host.node_id.node_id for node in nodes}
        assert {donor_shard(node_ids[address.peer_id]) for address in donors} <= read
        nursery.cancel_scope.cancel()


async def test_a_small_swarm_newcomer_reads_every_shard_and_finds_every_donor_in_its_own_shard():
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        nodes = [first] + [await nursery.start(run_node, [first.address]) for _ in range(4)]
        for node in nodes[:3]:
            await GroupAverager([torch.ones(8)], node, prefix=PREFIX).state_sharing.announce(1)
        # a peer that lists itself only in a shard other than its own: not offered
        stray = nodes[3]
        own = donor_shard(stray.host.node_id.node_id)
        offer = {"address": str(stray.host.public_address), "version": 9, "nonce": stray.host.node_id.nonce}
        subkey = peer_subkey(stray.host.identity.public_key)
        expires = stray.clock.time() + 60
        assert await stray.store(f"{PREFIX}.state_donors.{(own + 1) % DONOR_SHARDS}", offer, expires, subkey=subkey)
        # nor one in its own shard whose nonce does not solve the puzzle (a free signing key's claim;
        # the nonce's node ID lands in that shard, so only the puzzle can tell)
        claims = (NodeIDProof(stray.host.peer_id, n.to_bytes(NONCE_BYTES, "big")) for n in range(10_000))
        unsolved = next(
            claim.nonce
            for claim in claims
            if not claim.satisfies(LOCAL_DIFFICULTY) and donor_shard(claim.node_id) == own
        )
        assert await stray.store(f"{PREFIX}.state_donors.{own}", {**offer, "nonce": unsolved}, expires, subkey=subkey)
        newcomer = CountingDHT(nodes[4])
        with trio.fail_after(30):
            donors = await StateSharing(newcomer.host, newcomer, PREFIX, owner=None).donors()
        assert {address.peer_id for address in donors} == {node.host.peer_id for node in nodes[:3]}
        assert sorted(int(key.rsplit(".", 1)[1]) for key in newcomer.gets) == list(range(DONOR_SHARDS))
        nursery.cancel_scope.cancel()


async def test_rounds_within_the_refresh_cost_a_donor_no_store(autojump_clock):
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [], TrioClock())  # record times on the test's clock
        counted = CountingDHT(first)
        sharing = StateSharing(first.host, counted, PREFIX, owner=None)
        for version in range(1, 6):  # five rounds, a second apart
            await sharing.announce(version)
            await trio.sleep(1.0)
        assert len(counted.stores) == 1
        await trio.sleep(DONOR_REFRESH)
        await sharing.announce(6)
        assert counted.stores == [sharing.key(donor_shard(first.host.node_id.node_id))] * 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("round_s", [5.0, 55.0])
async def test_a_donor_stores_once_a_minute_and_stays_listed_through_a_failed_refresh(autojump_clock, round_s):
    """Every peer of a swarm is a donor, and each store of its offer costs a lookup and k stores:
    a donor stores at most once a minute, and with rounds up to a minute apart its offer stays
    listed through a refresh that fails (tried again at the end of the next round)."""
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [], TrioClock())
        counted = FailingSecondStore(first)
        sharing = StateSharing(first.host, counted, PREFIX, owner=None)
        key = sharing.key(donor_shard(first.host.node_id.node_id))
        start = trio.current_time()
        for version in range(1, 1 + int(3 * DONOR_TTL / round_s)):  # rounds round_s apart, three lifetimes
            if version > 1:
                found = await first.get(key, latest=True)
                listed = list(peer_entries(found, lambda peer, body: body, now=first.clock.time()))
                assert len(listed) == 1, f"the offer lapsed by {trio.current_time() - start:.0f} s"
            await sharing.announce(version)
            await trio.sleep(round_s)
        minutes = (trio.current_time() - start) / 60.0
        assert counted.failed == 1 and len(counted.stores) <= minutes + 2, counted.stores
        nursery.cancel_scope.cancel()


class FailingSecondStore(CountingDHT):
    """A DHT whose second store fails (nothing stored): the first refresh of an offer."""

    failed = 0

    async def store(self, key, value, expiration_time, subkey=None):
        self.stores.append(key)
        if len(self.stores) == 2:
            self.failed += 1
            return False
        return await self.node.store(key, value, expiration_time, subkey=subkey)


class HeldStores(CountingDHT):
    """A DHT whose stores wait until ``release`` is set."""

    def __init__(self, node: DHTNode):
        super().__init__(node)
        self.release = trio.Event()

    async def store(self, key, value, expiration_time, subkey=None):
        self.stores.append(key)
        await self.release.wait()
        return await self.node.store(key, value, expiration_time, subkey=subkey)


async def test_an_offer_is_stored_in_a_task_of_the_hosts_one_at_a_time(autojump_clock):
    """A store is a lookup and k stores: a peer whose offer fell due would return from its round
    later than the others and matchmake after them, so the offer is stored in a task of the host's,
    one at a time."""
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [], TrioClock())
        held = HeldStores(first)
        sharing = StateSharing(first.host, held, PREFIX, owner=None)
        sharing.announce_soon(1)  # (not awaited: the round that calls it returns at once)
        sharing.announce_soon(2)  # the first is still being stored: no second store
        await trio.sleep(1.0)
        assert len(held.stores) == 1
        held.release.set()
        await trio.sleep(1.0)
        found = await first.get(sharing.key(donor_shard(first.host.node_id.node_id)), latest=True)
        offers = peer_entries(found, lambda peer, body: body, now=first.clock.time())
        assert [body["version"] for _, body in offers] == [1]
        sharing.announce_soon(3)  # stored a second ago: not due
        await trio.sleep(1.0)
        assert len(held.stores) == 1
        nursery.cancel_scope.cancel()


async def test_a_direct_announce_while_an_offer_is_on_its_way_stores_nothing_more(autojump_clock):
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [], TrioClock())
        held = HeldStores(first)
        sharing = StateSharing(first.host, held, PREFIX, owner=None)
        sharing.announce_soon(1)
        await trio.sleep(1.0)
        await sharing.announce(2)  # (as a replica announces its state)
        assert len(held.stores) == 1
        held.release.set()
        nursery.cancel_scope.cancel()


async def test_a_newcomer_that_finds_no_offer_yet_reads_again_until_its_deadline(autojump_clock):
    """A swarm's first offers are stored after its first round returns: a newcomer that asks at
    once finds none, and finds the first one stored a few seconds later."""
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [], TrioClock())
        second = await nursery.start(run_node, [first.host.listen_address], TrioClock())
        donor = StateSharing(first.host, first, PREFIX, owner=None)
        newcomer = CountingDHT(second)
        sharing = StateSharing(second.host, newcomer, PREFIX, owner=None)

        async def offer_later() -> None:
            await trio.sleep(3.0)
            await donor.announce(1)

        nursery.start_soon(offer_later)
        with pytest.raises(StateUnavailable) as failed:  # (this donor has no state to serve)
            await sharing.download([torch.zeros(2)], timeout=20.0)
        assert "no donor announced itself" not in str(failed.value), failed.value  # it found the offer
        assert len(newcomer.gets) > DONOR_SHARDS  # by reading again
        nursery.cancel_scope.cancel()
