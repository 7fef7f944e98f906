"""Reading per-peer DHT dictionaries: what survives is unexpired, well-formed and under its signer's
owner-marked subkey, with plain values (the DHT checks the signatures; tests/dht/test_owned_records.py)."""

from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from typing import Any

import pytest
import trio

from averaging.matchmaking import Declaration
from averaging.progress import PeerProgress, ProgressTracker
from averaging.state_sharing import DonorOffer
from dht.node import DHTNode
from dht.peer_dictionary import dictionary_entries, peer_entries, peer_subkey, subkey_peer
from dht.records import DHTValue
from moe.announce import announced_address, announcement_subkey, pick_servers
from peer import LOCAL_DIFFICULTY, Identity, NodeIDProof, PeerAddress, PeerID

NOW = 1_000.0
KEYS = [Identity.generate() for _ in range(4)]
ALICE, BOB, CAROL, DAVE = (identity.peer_id for identity in KEYS)
# The subkey each of them writes under: its owner marker, which only its signature can fill.
A, B, C, D = (peer_subkey(identity.public_key) for identity in KEYS)


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
    found = dictionary({A: (1, NOW + 5), B: (2, NOW + 0.001)})
    assert dict(peer_entries(found, positive, now=NOW)) == {ALICE: 1, BOB: 2}


def test_expired_entries_are_dropped_including_one_expiring_exactly_now():
    found = dictionary({A: (1, NOW - 1), B: (2, NOW), C: (3, NOW + 1)})
    assert dict(peer_entries(found, positive, now=NOW)) == {CAROL: 3}


def test_values_the_parser_refuses_are_dropped_and_the_rest_kept():
    found = dictionary(
        {
            A: ("seven", NOW + 5),  # TypeError
            B: (-4, NOW + 5),  # ValueError
            C: (3, NOW + 5),
        }
    )
    assert dict(peer_entries(found, positive, now=NOW)) == {CAROL: 3}


def test_a_parser_may_index_a_map_and_let_a_missing_field_drop_the_entry():
    found = dictionary({A: ({"x": 1}, NOW + 5), B: ({}, NOW + 5)})
    assert dict(peer_entries(found, lambda peer, body: body["x"], now=NOW)) == {ALICE: 1}


def test_the_peer_of_an_entry_is_the_one_whose_key_the_subkey_names():
    assert subkey_peer(A) == ALICE == PeerID.from_public_key(KEYS[0].public_key)


@pytest.mark.parametrize(
    "subkey",
    [
        ALICE.to_bytes(),  # a plain peer ID: nobody signs it, so anyone could have written it
        str(ALICE),
        A.upper(),  # the DHT only checks signatures for lower-case hex markers
        A + "x",  # a marker inside other text: one owner could hold many such entries
        "x" + A,
        A[:-2] + "]",
        (0, A),
        7,
        None,
    ],
    # the keys are fresh each run: ids that name the case keep parallel workers' collections alike
    ids=["peer-id-bytes", "peer-id-text", "upper-case", "marker-then-text", "text-then-marker", "cut-marker"]
    + ["tuple", "int", "none"],
)
def test_subkeys_that_name_no_owner_are_dropped(subkey):
    found = dictionary({subkey: (1, NOW + 5), A: (1, NOW + 5)})
    assert dict(peer_entries(found, positive, now=NOW)) == {ALICE: 1}


@pytest.mark.parametrize(
    "found",
    [
        None,  # nothing stored under the key
        DHTValue(5, NOW + 5),  # a plain value where a dictionary was expected
        DHTValue([A, 1], NOW + 5),
        DHTValue({A: 1}, NOW + 5),  # items that are not DHT values
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
    found = dictionary({A: (1, 1.0), B: (2, 4e9)})  # 1970 and 2096
    assert dict(peer_entries(found, positive)) == {BOB: 2}


# The readers built on it: each one's parser, fed what a hostile or stale peer could store.


def test_a_declaration_is_its_signers_and_may_not_name_another_peers_address():
    def declaration(address: str | None) -> dict:
        return {"address": address, "bandwidth": 1.0, "mode": "node", "schema": "s", "round": 1}

    found = dictionary(
        {
            A: (declaration(f"127.0.0.1:5/{ALICE}"), NOW + 5),
            B: (declaration(f"127.0.0.1:5/{ALICE}"), NOW + 5),  # Bob poses as Alice's address
            C: (declaration("127.0.0.1:7"), NOW + 5),  # unpinned: a group member's address names it
            D: (declaration(None), NOW + 5),  # a reducing member needs an address
        }
    )
    declarations = dict(peer_entries(found, Declaration.from_wire, now=NOW))
    assert list(declarations) == [ALICE] and declarations[ALICE].peer_id == ALICE
    assert declarations[ALICE].address == PeerAddress("127.0.0.1", 5, ALICE)


def test_a_donor_offering_another_peers_address_is_not_a_donor():
    nonce = {peer: NodeIDProof.solve(peer, LOCAL_DIFFICULTY).nonce for peer in (ALICE, BOB, CAROL, DAVE)}
    found = dictionary(
        {
            A: ({"address": f"127.0.0.1:5/{ALICE}", "version": 3, "nonce": nonce[ALICE]}, NOW + 5),
            B: ({"address": f"127.0.0.1:6/{CAROL}", "version": 9, "nonce": nonce[BOB]}, NOW + 5),  # not its own
            C: ({"address": "127.0.0.1:7", "version": 9, "nonce": nonce[CAROL]}, NOW + 5),  # unpinned
            D: ({"address": f"127.0.0.1:8/{ALICE}", "nonce": nonce[DAVE]}, NOW + 5),  # no version
        }
    )
    offers = dict(peer_entries(found, partial(DonorOffer.from_wire, difficulty=LOCAL_DIFFICULTY), now=NOW))
    assert list(offers) == [ALICE] and offers[ALICE].version == 3 and offers[ALICE].address.port == 5


def test_expert_announcements_are_pinned_to_their_signer():
    def entries(found: DHTValue) -> dict:
        return dict(dictionary_entries(found, announcement_subkey, announced_address, now=NOW))

    found = dictionary(
        {
            (3, A): (f"10.0.0.1:5/{ALICE}", NOW + 5),
            (3, B): (f"10.0.0.1:5/{ALICE}", NOW + 5),  # Bob announces Alice's server as his
            (4, C): ("10.0.0.3:7", NOW + 5),  # unpinned: pinned to its signer
            (-1, D): (f"10.0.0.4:8/{DAVE}", NOW + 5),
            (True, D): (f"10.0.0.4:8/{DAVE}", NOW + 5),
            3: (f"10.0.0.6:9/{ALICE}", NOW + 5),  # the unsigned layout: anyone could have written it
            (5, ALICE.to_bytes()): (f"10.0.0.6:9/{ALICE}", NOW + 5),
        }
    )
    assert entries(found) == {
        (3, ALICE): PeerAddress("10.0.0.1", 5, ALICE),
        (4, CAROL): PeerAddress("10.0.0.3", 7, CAROL),
    }


def test_each_announced_coordinate_gets_one_of_its_servers_at_random():
    mine, theirs = PeerAddress("10.0.0.1", 5, ALICE), PeerAddress("10.0.0.2", 6, BOB)
    entries = [((3, ALICE), mine), ((3, BOB), theirs), ((4, BOB), theirs)]
    picks = [pick_servers(entries) for _ in range(200)]
    assert all(pick[4] == theirs and set(pick) == {3, 4} for pick in picks)
    assert {pick[3] for pick in picks} == {mine, theirs}  # neither announcer draws all the traffic


async def test_progress_fetch_keeps_sane_records_and_this_peers_own_view():
    async with contextlib.AsyncExitStack() as stack:
        node = await stack.enter_async_context(DHTNode.open(initial_peers=[]))
        tracker = ProgressTracker(node, "junk")
        expires = time.time() + 30
        # Each writer signs its own entry (a node can sign only its own marker).
        writes = {
            KEYS[0]: [({"epoch": 4, "samples": 10, "sps": 2.5}, A)],
            KEYS[1]: [({"epoch": -1, "samples": 10, "sps": 1.0}, B)],
            KEYS[2]: [("not a record", C), ({"epoch": 9, "samples": 1, "sps": 1.0}, b"no peer")],
            KEYS[3]: [({"epoch": 9, "samples": 1, "sps": 1.0}, ALICE.to_bytes())],  # unsigned, Alice's plain ID
        }
        for identity, records in writes.items():
            writer = await stack.enter_async_context(DHTNode.open(identity=identity, initial_peers=[node.address]))
            for value, subkey in records:
                if isinstance(value, dict):  # (a record carries its writer's node-ID proof)
                    value = {**value, "nonce": writer.host.node_id.nonce}
                assert await writer.store(tracker.key, value, expires, subkey=subkey)
        # a record of ours from the past must not override what we know now
        await node.store(tracker.key, {"epoch": 7, "samples": 1, "sps": 1.0}, expires, subkey=tracker.subkey)
        mine = PeerProgress(2, 5, 1.0)
        with trio.fail_after(10):
            swarm = await tracker.fetch(mine)
        assert swarm.peers == {tracker.me: mine, ALICE: PeerProgress(4, 10, 2.5)}
        # One stranger two epochs ahead of a running peer is a claim, not evidence (epoch_evidence.py).
        assert swarm.epoch == 2 and not math.isnan(swarm.samples_per_s)
