"""Reading per-peer DHT dictionaries: what survives is unexpired and well-formed, with plain values."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import trio

from averaging.progress import PeerProgress, ProgressTracker
from averaging.state_sharing import DonorOffer
from dht.node import DHTNode
from dht.peer_dictionary import dictionary_entries, peer_entries
from dht.records import DHTValue
from peer import PeerID

NOW = 1_000.0
ALICE, BOB, CAROL = (PeerID(bytes([n]) * 20) for n in (1, 2, 3))


def dictionary(entries: dict[Any, tuple[Any, float]]) -> DHTValue:
    """A get's answer for a dictionary key: subkey -> (value, expiration)."""
    items = {subkey: DHTValue(value, expiration) for subkey, (value, expiration) in entries.items()}
    return DHTValue(items, max((e for _, e in entries.values()), default=NOW + 10))


def positive(peer: PeerID, value: Any) -> int:
    if type(value) is not int:
        raise TypeError("not an int")
    if value <= 0:
        raise ValueError("not positive")
    return value


def test_well_formed_unexpired_entries_come_back_with_parsed_subkeys():
    found = dictionary({ALICE.to_bytes(): (1, NOW + 5), BOB.to_bytes(): (2, NOW + 0.001)})
    assert dict(peer_entries(found, positive, now=NOW)) == {ALICE: 1, BOB: 2}


def test_expired_entries_are_dropped_including_one_expiring_exactly_now():
    found = dictionary({ALICE.to_bytes(): (1, NOW - 1), BOB.to_bytes(): (2, NOW), CAROL.to_bytes(): (3, NOW + 1)})
    assert dict(peer_entries(found, positive, now=NOW)) == {CAROL: 3}


def test_values_the_parser_refuses_are_dropped_and_the_rest_kept():
    found = dictionary(
        {
            ALICE.to_bytes(): ("seven", NOW + 5),  # TypeError
            BOB.to_bytes(): (-4, NOW + 5),  # ValueError
            CAROL.to_bytes(): (3, NOW + 5),
        }
    )
    assert dict(peer_entries(found, positive, now=NOW)) == {CAROL: 3}


def test_a_parser_may_index_a_map_and_let_a_missing_field_drop_the_entry():
    found = dictionary({ALICE.to_bytes(): ({"x": 1}, NOW + 5), BOB.to_bytes(): ({}, NOW + 5)})
    assert dict(peer_entries(found, lambda peer, body: body["x"], now=NOW)) == {ALICE: 1}


@pytest.mark.parametrize(
    "subkey",
    [
        b"short",  # not 20 bytes
        "a" * 20,  # a string, not bytes
        tuple(range(20)),  # bytes() would accept a list of ints: a peer ID is bytes only
        7,
        None,
    ],
)
def test_subkeys_that_name_no_peer_are_dropped(subkey):
    found = dictionary({subkey: (1, NOW + 5), ALICE.to_bytes(): (1, NOW + 5)})
    assert dict(peer_entries(found, positive, now=NOW)) == {ALICE: 1}


@pytest.mark.parametrize(
    "found",
    [
        None,  # nothing stored under the key
        DHTValue(5, NOW + 5),  # a plain value where a dictionary was expected
        DHTValue([ALICE.to_bytes(), 1], NOW + 5),
        DHTValue({ALICE.to_bytes(): 1}, NOW + 5),  # items that are not DHT values
    ],
)
def test_what_is_not_a_dictionary_of_records_yields_nothing(found):
    assert list(peer_entries(found, positive, now=NOW)) == []


def test_other_subkey_types_with_their_own_parser():
    def coordinate(subkey: Any) -> int:
        if type(subkey) is not int or subkey < 0:
            raise ValueError("not a coordinate")
        return subkey

    found = dictionary({0: ("a", NOW + 5), -1: ("b", NOW + 5), True: ("c", NOW + 5), 2: ("d", NOW - 5)})
    assert dict(dictionary_entries(found, coordinate, lambda c, v: v, now=NOW)) == {0: "a"}


def test_the_wall_clock_is_the_default():
    found = dictionary({ALICE.to_bytes(): (1, 1.0), BOB.to_bytes(): (2, 4e9)})  # 1970 and 2096
    assert dict(peer_entries(found, positive)) == {BOB: 2}


# The readers built on it: each one's parser, fed what a hostile or stale peer could store.


def test_a_donor_offering_another_peers_address_is_not_a_donor():
    found = dictionary(
        {
            ALICE.to_bytes(): ({"address": f"127.0.0.1:5/{ALICE}", "version": 3}, NOW + 5),
            BOB.to_bytes(): ({"address": f"127.0.0.1:6/{CAROL}", "version": 9}, NOW + 5),  # not its own
            CAROL.to_bytes(): ({"address": "127.0.0.1:7", "version": 9}, NOW + 5),  # unpinned
            PeerID(bytes([4]) * 20).to_bytes(): ({"address": f"127.0.0.1:8/{ALICE}"}, NOW + 5),  # no version
        }
    )
    offers = dict(peer_entries(found, DonorOffer.from_wire, now=NOW))
    assert list(offers) == [ALICE] and offers[ALICE].version == 3 and offers[ALICE].address.port == 5


async def test_progress_fetch_keeps_sane_records_and_this_peers_own_view():
    async with DHTNode.open(initial_peers=[]) as node:
        tracker = ProgressTracker(node, "junk")
        expires = time.time() + 30
        await node.store(tracker.key, {"epoch": 4, "samples": 10, "sps": 2.5}, expires, subkey=ALICE.to_bytes())
        await node.store(tracker.key, {"epoch": -1, "samples": 10, "sps": 1.0}, expires, subkey=BOB.to_bytes())
        await node.store(tracker.key, "not a record", expires, subkey=CAROL.to_bytes())
        await node.store(tracker.key, {"epoch": 9, "samples": 1, "sps": 1.0}, expires, subkey=b"no peer")
        # a record of ours from the past must not override what we know now
        await node.store(tracker.key, {"epoch": 7, "samples": 1, "sps": 1.0}, expires, subkey=tracker.me.to_bytes())
        mine = PeerProgress(2, 5, 1.0)
        with trio.fail_after(10):
            swarm = await tracker.fetch(mine)
        assert swarm.peers == {tracker.me: mine, ALICE: PeerProgress(4, 10, 2.5)}
        assert swarm.epoch == 4 and not math.isnan(swarm.samples_per_s)
