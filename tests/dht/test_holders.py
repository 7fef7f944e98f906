"""A key's holders, remembered for a minute (``dht/holders.py``): a repeated store goes straight to
them, a holder that stops answering is dropped from them, and once a quarter of them are gone the
next store goes back to a full lookup; a newcomer or two that belong among them are admitted, a
start-up wave sends the store back to a lookup."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from dht import DHTConfig
from dht.holders import ADMIT_AT_MOST, HOLDERS_TTL, REFRESH_BELOW, HolderCache
from dht.records import DHTRecord, key_id, pack
from dht.replicas import StoreTally
from peer.simnet import SimNetwork
from tests.support.sim_swarm import open_sim_swarm


def placed(long_id: int) -> SimpleNamespace:
    return SimpleNamespace(id=long_id.to_bytes(20, "big"), long_id=long_id)


def contacts(count: int) -> list:
    return [placed(distance) for distance in range(1, count + 1)]


def test_holders_are_fresh_for_their_lifetime_and_then_gone():
    cache = HolderCache(ttl=60)
    nearest = contacts(3)
    cache.remember(7, nearest, now=100.0, k=3)
    assert cache.holders(7, now=159.9) == nearest
    assert cache.holders(7, now=160.0) is None
    assert len(cache) == 0 and cache.holders(8, now=100.0) is None


def test_a_forgotten_or_empty_answer_is_not_a_set_of_holders():
    cache = HolderCache()
    cache.remember(1, [], now=0.0, k=3)
    assert cache.holders(1, now=0.0) is None
    gone = contacts(2)
    cache.remember(2, gone, now=0.0, k=3)
    cache.lost(2, gone)
    assert cache.holders(2, now=0.0) is None


def test_the_cache_keeps_at_most_its_size_dropping_the_least_recently_used():
    cache = HolderCache(max_targets=2)
    for target in range(3):
        cache.remember(target, contacts(1), now=0.0, k=3)
    assert len(cache) == 2 and cache.holders(0, now=0.0) is None
    cache.holders(1, now=0.0)  # used: 2 is now the oldest
    cache.remember(3, contacts(1), now=0.0, k=3)
    assert cache.holders(2, now=0.0) is None and cache.holders(1, now=0.0) is not None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        HolderCache(ttl=-1)


def test_a_newcomer_is_a_peer_nearer_than_the_farthest_holder_that_the_lookup_did_not_find():
    target, cache = 0, HolderCache()
    holders = [placed(distance) for distance in (1, 2, 4, 8)]
    cache.remember(target, holders, now=0.0, k=4)
    assert cache.admit(target, holders[:2], k=4) == holders  # the table knows only holders
    assert cache.admit(target, [*holders, placed(16)], k=4) == holders  # a farther one: not a holder
    cache.lost(target, [holders[3]])
    assert cache.admit(target, holders, k=4) == holders[:3]  # a dropped holder the table still names
    assert cache.admit(target, [placed(9)], k=4) == holders[:3]  # nor one beyond the lookup's reach
    assert [c.long_id for c in cache.admit(target, [placed(3)], k=4)] == [1, 2, 3, 4]  # nearer: admitted
    # the lookup found fewer than k (the swarm was smaller than k): any peer it lacks belongs among them
    cache.remember(target, holders, now=0.0, k=20)
    assert [c.long_id for c in cache.admit(target, [placed(9)], k=20)] == [1, 2, 4, 8, 9]


def test_a_few_newcomers_are_admitted_among_the_holders_and_many_send_the_store_to_a_lookup():
    target, cache = 0, HolderCache()
    holders = [placed(distance) for distance in (1, 2, 4, 8)]
    cache.remember(target, holders, now=0.0, k=4)
    assert cache.admit(target, [*holders[:2], placed(16)], k=4) == holders  # nobody new within reach
    admitted = cache.admit(target, [placed(3)], k=4)
    assert [c.long_id for c in admitted] == [1, 2, 3, 4]  # the farthest gives way, as a lookup's k nearest
    assert cache.holders(target, now=1.0) == admitted
    assert cache.admit(target, [placed(3), placed(8)], k=4) == admitted  # admitted; and 8 is now beyond reach
    cache.remember(target, [placed(distance) for distance in (100, 200, 400, 800)], now=0.0, k=4)
    wave = [placed(distance) for distance in range(101, 102 + ADMIT_AT_MOST)]
    assert cache.admit(target, wave, k=4) is None  # more than a few: the key is looked up again
    assert cache.holders(target, now=1.0) is None
    assert cache.admit(7, [placed(3)], k=4) is None  # a key not remembered
    # a wave that arrives one newcomer at a time is a wave too: at most ADMIT_AT_MOST in the minute
    cache.remember(target, [placed(distance) for distance in (1000, 2000, 4000, 8000)], now=0.0, k=4)
    for distance in range(999, 999 - ADMIT_AT_MOST, -1):  # each nearer the key than every holder
        assert cache.admit(target, [placed(distance)], k=4) is not None
    assert cache.admit(target, [placed(999 - ADMIT_AT_MOST)], k=4) is None


async def test_a_newcomer_among_a_key_s_holders_gets_the_next_store_without_a_walk(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=13), 40, config=DHTConfig()) as swarm:
        writer, clock, k = swarm.nodes[0], swarm.clock, DHTConfig().k
        keys = [f"declarations-{n}" for n in range(16)]
        for key in keys:
            assert await writer.store(key, "first", clock.time() + 600, subkey="me")
        newcomer = await swarm.add([writer.address])  # our table meets it as it joins through us
        await trio.sleep(5)  # its joining traffic is over

        def rank(key: str) -> int:  # the newcomer's place among the key's nearest live nodes
            target = key_id(pack(key))
            order = sorted((swarm.nodes[i] for i in swarm.alive()[1:]), key=lambda node: node.node_id ^ target)
            return order.index(newcomer)

        key = min(keys, key=rank)
        assert rank(key) < k // 2  # (one of 16 keys has it well among its k nearest)
        before = served(swarm)
        assert await writer.store(key, "second", clock.time() + 600, subkey="me")
        assert served(swarm) - before <= k + ADMIT_AT_MOST  # the stores alone: no walk to the holders
        found = newcomer.records.found(pack(key))
        assert found is not None and newcomer.records.decode(pack(key), found).value["me"].value == "second"


def test_holders_that_stop_answering_are_dropped_until_too_few_are_left():
    cache, k = HolderCache(), 20
    nearest = contacts(k)
    cache.remember(5, nearest, now=0.0, k=k)
    floor = round(REFRESH_BELOW * k)
    cache.lost(5, nearest[:1])
    assert cache.holders(5, now=1.0) == nearest[1:]
    cache.lost(5, nearest[1 : k - floor])  # exactly the floor left
    assert cache.holders(5, now=1.0) == nearest[k - floor :]
    cache.lost(5, [placed(999)])  # not a holder: nothing changes
    assert len(cache.holders(5, now=1.0)) == floor
    cache.lost(5, nearest[-1:])
    assert cache.holders(5, now=1.0) is None  # too few: the next store looks the holders up again
    cache.lost(6, nearest)  # a key not remembered: nothing to drop


def served(swarm) -> int:
    return sum(swarm.nodes[i].requests_served for i in swarm.alive())


async def test_a_repeated_store_asks_only_the_holders_still_answering_until_too_few_are(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=11), 40, config=DHTConfig()) as swarm:
        writer, clock = swarm.nodes[0], swarm.clock
        await trio.sleep(5)  # the swarm's own joining traffic is over
        before = served(swarm)
        assert await writer.store("declarations", "first", clock.time() + 600, subkey="me")
        first = served(swarm) - before
        k = DHTConfig().k
        assert first > k  # a lookup (finds) and then the k stores

        before = served(swarm)
        assert await writer.store("declarations", "second", clock.time() + 600, subkey="me")
        assert served(swarm) - before <= k  # the stores alone: no walk to the holders
        assert (await swarm.nodes[25].get("declarations", latest=True)).value["me"].value == "second"

        holding = [i for i in swarm.alive()[1:] if swarm.nodes[i].records.found(pack("declarations")) is not None]
        gone = holding[0]
        swarm.leave(gone)
        assert await writer.store("declarations", "third", clock.time() + 600, subkey="me")
        before = served(swarm)
        assert await writer.store("declarations", "fourth", clock.time() + 600, subkey="me")
        assert served(swarm) - before <= k - 1  # the holder that did not answer is dropped, not walked for

        for index in holding[1 : k - round(REFRESH_BELOW * k) + 1]:  # a quarter of them gone
            swarm.leave(index)
        assert await writer.store("declarations", "fifth", clock.time() + 600, subkey="me")
        before = served(swarm)
        assert await writer.store("declarations", "sixth", clock.time() + 600, subkey="me")
        assert served(swarm) - before > k  # too few answered: looked up again

        await trio.sleep(HOLDERS_TTL)
        before = served(swarm)
        assert await writer.store("declarations", "seventh", clock.time() + 600, subkey="me")
        assert served(swarm) - before > k  # a minute later the holders are looked up afresh
        reader = swarm.nodes[next(i for i in swarm.alive()[1:] if i not in holding)]
        assert (await reader.get("declarations", latest=True)).value["me"].value == "seventh"


async def test_a_swarm_that_grows_past_the_holders_sends_the_next_store_back_to_a_lookup(autojump_clock):
    async with open_sim_swarm(SimNetwork(seed=12), 6, config=DHTConfig()) as swarm:
        writer, clock, k = swarm.nodes[0], swarm.clock, DHTConfig().k
        assert await writer.store("declarations", "first", clock.time() + 600, subkey="me")
        stored_at = trio.current_time()
        async with trio.open_nursery() as wave:  # a start-up wave: most of the key's k nearest are newcomers now
            for index in range(40):
                wave.start_soon(swarm.add, [swarm.nodes[i].address for i in (0, index % 6)])
        assert trio.current_time() - stored_at < HOLDERS_TTL  # the holders are still remembered
        assert await writer.store("declarations", "second", clock.time() + 600, subkey="me")
        target = key_id(pack("declarations"))
        nearest = sorted(swarm.nodes[1:], key=lambda node: node.node_id ^ target)[:k]

        def holds_second(node) -> bool:  # (newcomers may hold "first", handed over as they joined)
            found = node.records.found(pack("declarations"))
            return found is not None and node.records.decode(pack("declarations"), found).value["me"].value == "second"

        holding = [node for node in nearest if holds_second(node)]
        assert len(holding) == k, f"{len(holding)} of the {k} nearest hold the second value"


def held_value(node, key: str, subkey: str):
    found = node.records.found(pack(key))
    return None if found is None else node.records.decode(pack(key), found).value[subkey].value


async def test_a_store_for_a_majority_does_not_wait_out_a_holder_that_left(autojump_clock):
    """A holder that left answers nothing: a store waiting for every holder takes the whole RPC
    timeout, one waiting for a majority returns once most accepted, and the rest still get it."""
    async with open_sim_swarm(SimNetwork(seed=12), 40, config=DHTConfig()) as swarm:
        writer, clock, timeout = swarm.nodes[0], swarm.clock, DHTConfig().rpc_timeout
        await trio.sleep(5)  # the swarm's own joining traffic is over
        assert await writer.store("declarations", "first", clock.time() + 600, subkey="me")
        holding = [i for i in swarm.alive()[1:] if held_value(swarm.nodes[i], "declarations", "me") == "first"]
        assert len(holding) >= 10

        swarm.leave(holding[0])
        started = trio.current_time()
        assert await writer.store("declarations", "second", clock.time() + 600, subkey="me", majority=True)
        assert trio.current_time() - started < timeout / 4
        await trio.sleep(timeout)  # the sends to the rest, in the writer's background
        assert all(held_value(swarm.nodes[i], "declarations", "me") == "second" for i in holding[1:])

        swarm.leave(holding[1])
        started = trio.current_time()
        assert await writer.store("declarations", "third", clock.time() + 600, subkey="me")
        assert trio.current_time() - started >= timeout  # every holder: the one that left is waited out


def test_a_tally_settles_on_a_majority_of_all_the_sends_or_when_all_answered():
    tally = StoreTally()
    tally.started(2)
    tally.answer(2, 2)  # both of the first two accepted: but the caller is still sending
    assert not tally.settled.is_set()
    tally.started(3)
    tally.all_sent()
    assert not tally.settled.is_set()  # 2 of 5
    tally.answer(1, 1)
    assert tally.settled.is_set()  # 3 of 5
    refused = StoreTally()
    refused.started(2)
    refused.all_sent()
    refused.answer(0, 2)
    assert refused.settled.is_set() and refused.accepted == 0


async def test_holders_that_refuse_a_majority_store_while_its_lookup_runs_are_not_remembered(autojump_clock):
    """A store sends to holders as its lookup finds them: those that refuse before the lookup ends
    are dropped once it has remembered the holders, as after a store that waits for all."""
    async with open_sim_swarm(SimNetwork(seed=13), 40, config=DHTConfig()) as swarm:
        writer, clock, k = swarm.nodes[0], swarm.clock, DHTConfig().k
        await trio.sleep(5)  # the swarm's own joining traffic is over
        target = key_id(pack("declarations"))
        nearest = sorted(swarm.alive()[1:], key=lambda i: swarm.nodes[i].node_id ^ target)
        newer = DHTRecord(pack("declarations"), pack("me"), pack("newer"), clock.time() + 900)
        refusing = nearest[:4]
        assert all(swarm.nodes[i].records.store(newer) for i in refusing)  # they hold a newer version
        assert await writer.store("declarations", "first", clock.time() + 600, subkey="me", majority=True)
        await trio.sleep(DHTConfig().rpc_timeout)  # (its sends still under way, in the background)
        before = served(swarm)
        assert await writer.store("declarations", "second", clock.time() + 600, subkey="me", majority=True)
        await trio.sleep(DHTConfig().rpc_timeout)
        assert served(swarm) - before <= k - len(refusing)  # straight to the holders that kept ours
