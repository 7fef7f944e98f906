"""Hostile writers against the record store: owner-signed versions, per-type lifetimes, fair eviction.

Mostly plain values and a fake clock (``RecordStore``, ``LocalRecords``, validators); the last tests
replay the attacks through real DHT nodes on 127.0.0.1.
"""

from __future__ import annotations

import time

import pytest

from dht.lifetimes import DEFAULT_TTL_CAPS, TTLCap
from dht.local import LocalRecords
from dht.node import DHTNode
from dht.records import CLOCK_SKEW, MAX_TTL, DHTRecord, pack, unpack
from dht.storage import RecordStore, StoredValue, merge_found
from dht.testing import open_swarm
from dht.validation import CompositeValidator, SignatureValidator, owner_marker, signed_version
from dht.wire import encode_record
from peer import Identity

NOW = 1_000_000.0
DAY = 24 * 3600.0
MALLORY, ALICE, BOB = b"mallory-peer-id", b"alice-peer-id", b"bob-peer-id"


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def node_records(clock: Clock, *validators, **store_options) -> LocalRecords:
    """What one node runs: signature checks (always on) in front of a store with a fake clock."""
    validator = CompositeValidator([SignatureValidator(), *validators])
    return LocalRecords(validator, RecordStore(clock=clock, **store_options))


def signed(owner: Identity, clock: Clock, key: str, subkey, value, ttl: float) -> DHTRecord:
    """The wire-form record the owner's node would send, signed at the clock's time."""
    record = DHTRecord(pack(key), None if subkey is None else pack(subkey), pack(value), clock.now + ttl)
    signer = SignatureValidator(owner, clock=clock)
    return DHTRecord(record.key, record.subkey, signer.sign(record), record.expiration_time)


def held(records: LocalRecords, key: str):
    """The decoded value at ``key`` (for dictionaries: subkey -> value), None if nothing is held."""
    found = records.found(pack(key))
    if found is None:
        return None
    value = records.decode(pack(key), found).value
    return {subkey: item.value for subkey, item in value.items()} if isinstance(found, dict) else value


# ---------------------------------------------------------------------- owner-signed records
def test_attacker_cannot_write_or_lock_an_owner_signed_subkey():
    clock, owner, mallory = Clock(), Identity.generate(), Identity.generate()
    records = node_records(clock)
    mine = owner_marker(owner.public_key)
    # Without the owner's key the subkey cannot be written at all, however long-lived.
    forged = DHTRecord(pack("group"), pack(mine), pack("evil"), NOW + DAY)
    assert not records.store(forged, MALLORY)
    # Nor with a well-formed envelope signed by her own key (her node refuses to make one).
    message = pack([b"peerd-dht-record/2", forged.key, forged.subkey, forged.value, forged.expiration_time, 1])
    mallory_signed = DHTRecord(forged.key, forged.subkey, pack([forged.value, 1, mallory.sign(message)]), NOW + DAY)
    assert signed_version(mallory_signed) == 1
    assert not records.store(mallory_signed, MALLORY)
    # An unsigned plain value of a day under the same key used to lock out every shorter subkey.
    assert records.store(DHTRecord(pack("group"), None, pack("squat"), NOW + DAY), MALLORY)
    for step in range(5):  # the owner re-stores with a 4 s TTL, as matchmaking does
        clock.now = NOW + 3 * step
        assert records.store(signed(owner, clock, "group", mine, f"me-{step}", 4.0), ALICE)
        assert held(records, "group") == {mine: f"me-{step}"}
    # ... and the plain value cannot come back over the signed subkey.
    assert not records.store(DHTRecord(pack("group"), None, pack("squat"), clock.now + DAY), MALLORY)


def test_owner_replaces_its_long_lived_record_with_a_newer_short_one():
    clock, owner = Clock(), Identity.generate()
    records = node_records(clock)
    key = f"donor{owner_marker(owner.public_key)}"
    assert records.store(signed(owner, clock, key, None, "long", DAY), ALICE)
    clock.now += 1
    assert records.store(signed(owner, clock, key, None, "short", 10.0), ALICE)
    found = records.found(pack(key))
    assert held(records, key) == "short" and found.expiration_time == clock.now + 10


def test_replay_of_an_older_signed_record_is_refused_until_it_must_have_expired():
    clock, owner = Clock(), Identity.generate()
    records = node_records(clock)
    mine = owner_marker(owner.public_key)
    old = signed(owner, clock, "group", mine, "old", 3600.0)
    assert records.store(old, ALICE)
    clock.now += 1
    assert records.store(signed(owner, clock, "group", mine, "new", 10.0), ALICE)
    assert not records.store(old, MALLORY)  # while the newer one is held
    clock.now += 60
    assert held(records, "group") is None  # the newer one expired ...
    assert not records.store(old, MALLORY)  # ... and the replay is still refused
    clock.now = old.expiration_time + 1  # nothing older can still be alive: the guard is gone
    assert records.store(signed(owner, clock, "group", mine, "later", 10.0), ALICE)


def test_same_signed_record_again_is_idempotent_and_merge_prefers_newer_versions():
    clock, owner = Clock(), Identity.generate()
    records = node_records(clock)
    mine = owner_marker(owner.public_key)
    old = signed(owner, clock, "group", mine, "old", 3600.0)
    assert records.store(old, ALICE) and records.store(old, BOB)
    clock.now += 1
    new = signed(owner, clock, "group", mine, "new", 10.0)
    # Two nodes answer a lookup: one still has the old long-lived record, one the new short one.
    answers = [records.validated([old]), records.validated([new])]
    for a, b in (answers, answers[::-1]):
        merged = merge_found(a, b)
        assert merged[pack(mine)].expiration_time == new.expiration_time
    # An unsigned plain value never outranks a dictionary holding a signed subkey.
    squat = {pack(mine): StoredValue(new.value, new.expiration_time, signed_version(new))}
    assert merge_found(StoredValue(b"x", NOW + DAY), squat) is squat


def test_signer_versions_only_grow_even_if_the_clock_stands_still_or_goes_back():
    clock, owner = Clock(), Identity.generate()
    signer = SignatureValidator(owner, clock=clock)
    first = signer.next_version()
    clock.now -= 10
    assert signer.next_version() == first + 1


def test_future_signatures_and_lifetimes_beyond_the_signing_time_are_refused():
    clock, owner = Clock(), Identity.generate()
    records = node_records(clock)
    key = f"x{owner_marker(owner.public_key)}"
    ahead = Clock()
    ahead.now = NOW + CLOCK_SKEW + 60
    assert not records.store(signed(owner, ahead, key, None, "v", 10.0), ALICE)
    # Signed an hour ago with a day's TTL less an hour: fine; expiring beyond signed time + cap: no.
    behind = Clock()
    behind.now = NOW - 3600
    assert records.store(signed(owner, behind, key, None, "v", DAY - 60), ALICE)
    record = signed(owner, behind, "y" + key, None, "v", DAY)
    late = DHTRecord(record.key, None, record.value, record.expiration_time)
    assert records.lifetime_error(late, NOW) is None  # within now + cap ...
    too_long = signed(owner, behind, f"z{owner_marker(owner.public_key)}.progress", None, "v", 3000.0)
    assert not records.store(too_long, ALICE)  # ... but a progress record signed an hour ago is over


# ---------------------------------------------------------------------- lifetimes per record type
@pytest.mark.parametrize(
    ("key", "allowed", "refused"),
    [
        ("run.progress", 60, 120),
        ("run.progress.cells8.5", 60, 120),
        ("run.matchmaking", 300, 600),
        ("run.state_donors.3", 300, 600),
        ("ffn.3.", 600, 900),
    ],
)
def test_default_ttl_caps_per_record_type(key, allowed, refused):
    clock = Clock()
    records = node_records(clock)
    assert records.store(DHTRecord(pack(key), pack("peer"), pack("v"), NOW + allowed), ALICE)
    assert not records.store(DHTRecord(pack(key), pack("peer2"), pack("v"), NOW + refused + CLOCK_SKEW + 1), ALICE)
    assert records.found(pack(key)) is not None and len(records.found(pack(key))) == 1


def test_application_caps_and_global_cap():
    clock = Clock()
    records = node_records(clock, TTLCap(r"^checkpoints/", 30.0))
    assert records.max_ttl(DHTRecord(pack("checkpoints/a"), None, pack(1), NOW)) == 30.0
    assert records.max_ttl(DHTRecord(pack("anything"), None, pack(1), NOW)) == MAX_TTL
    assert records.max_ttl(DHTRecord(pack(["not", "a", "string"]), None, pack(1), NOW)) == MAX_TTL
    assert not records.store(DHTRecord(pack("checkpoints/a"), None, pack(1), NOW + 30 + CLOCK_SKEW + 1))
    # Readers drop over-long records a dishonest node returns, as storage would have refused them.
    squat = DHTRecord(pack("run.progress"), pack("p"), pack(1), NOW + DAY)
    assert records.validated([squat]) is None
    with pytest.raises(ValueError):
        TTLCap("x", 0)


def test_callers_ttls_fit_their_caps():
    from averaging.progress import PROGRESS_TTL
    from averaging.state_sharing import DONOR_TTL
    from moe.announce import HEARTBEAT_TTL, prefix_key

    records = node_records(Clock())

    def cap(key: str) -> float:
        return records.max_ttl(DHTRecord(pack(key), None, pack(0), NOW))

    assert PROGRESS_TTL <= cap("run.progress") < MAX_TTL
    assert DONOR_TTL <= cap("run.state_donors.15") < MAX_TTL
    assert 5.0 + 1.0 <= cap("run.matchmaking") < MAX_TTL  # Averager's default matchmaking timeout + 1 s
    assert HEARTBEAT_TTL <= cap(prefix_key("ffn", ())) == cap(prefix_key("ffn", (3,))) < MAX_TTL
    assert len(DEFAULT_TTL_CAPS) == 4


# ---------------------------------------------------------------------- room per writer and per key
def test_a_flooding_writer_cannot_lock_out_another_writers_short_record():
    store = RecordStore(max_records=50, clock=Clock())
    flood = 0
    while store.store(b"junk%d" % flood, None, b"v", NOW + DAY, writer=MALLORY) and flood < 200:
        flood += 1
    assert store.usage(MALLORY)[0] == 50  # alone, the flooder may use all the room
    assert store.store(b"progress", b"alice", b"v", NOW + 4, writer=ALICE)
    assert store.usage(MALLORY)[0] == 49 and len(store) == 50
    # The flood goes on: each new junk record now costs the flooder one of its own.
    for more in range(100):
        store.store(b"more%d" % more, None, b"v", NOW + DAY + more, writer=MALLORY)
    assert store.get(b"progress") is not None and store.usage(ALICE) == (1, len(b"progressalicev"))
    # Local stores (writer None) get their share too.
    assert store.store(b"own", None, b"v", NOW + 1)


def test_byte_flood_evicts_the_flooders_bytes():
    store = RecordStore(max_bytes=10_000, clock=Clock())
    for index in range(20):
        store.store(b"big%d" % index, None, b"x" * 1000, NOW + DAY, writer=MALLORY)
    assert store.nbytes <= 10_000
    assert store.store(b"k", b"s", b"v" * 500, NOW + 5, writer=BOB)
    assert store.usage(BOB)[0] == 1 and store.nbytes <= 10_000


def test_one_writer_fills_a_dictionary_key_but_others_still_get_subkeys():
    store = RecordStore(max_subkeys=8, clock=Clock())
    for index in range(20):
        store.store(b"group", b"sybil%d" % index, b"v", NOW + DAY, writer=MALLORY)
    assert len(store.get(b"group")) == 8
    assert store.store(b"group", b"alice", b"v", NOW + 4, writer=ALICE)
    assert store.store(b"group", b"bob", b"v", NOW + 4, writer=BOB)
    assert {b"alice", b"bob"} <= set(store.get(b"group")) and len(store.get(b"group")) == 8
    # Equal shares do not evict each other: bob's second subkey replaces none of alice's.
    small = RecordStore(max_subkeys=2, clock=Clock())
    assert small.store(b"g", b"a", b"v", NOW + 10, writer=ALICE)
    assert small.store(b"g", b"b", b"v", NOW + 10, writer=BOB)
    assert not small.store(b"g", b"b2", b"v", NOW + 5, writer=BOB)  # would outlive none of bob's own
    assert set(small.get(b"g")) == {b"a", b"b"}


def test_replay_guards_are_bounded():
    store = RecordStore(max_records=4, clock=Clock())
    for index in range(10):
        store.store(b"k%d" % index, None, b"v", NOW + 10, version=index + 1, replay_horizon=NOW + 100 + index)
    assert len(store.replay_guards) <= 4


# ---------------------------------------------------------------------- through real nodes
async def send(caller: DHTNode, node: DHTNode, *records: DHTRecord) -> list[bool]:
    """A raw ``dht.store`` from ``caller`` to ``node``, as a hostile peer would send it."""
    reply = await caller.host.call(node.address, "dht.store", [encode_record(r) for r in records], timeout=5)
    return reply.body


async def test_owner_signed_records_through_real_nodes():
    owner = Identity.generate()
    mine = owner_marker(owner.public_key)
    key, subkey = pack("group"), pack(mine)
    async with open_swarm(5, seed=11) as swarm:
        async with (
            DHTNode.open(identity=owner, initial_peers=[swarm.nodes[0].address]) as alice,
            DHTNode.open(initial_peers=[swarm.nodes[0].address]) as mallory,
        ):
            # Mallory squats on the key with a day-long plain value on every node.
            for node in swarm.nodes:
                assert await send(mallory, node, DHTRecord(key, None, pack("squat"), time.time() + DAY - 60)) == [True]
            # The owner's long-lived record, then a newer short-lived one: both accepted.
            assert await alice.store("group", "long", time.time() + DAY - 60, subkey=mine)
            old = next(found[subkey] for n in swarm.nodes if isinstance(found := n.storage.get(key), dict))
            assert await alice.store("group", "short", time.time() + 5, subkey=mine)
            found = await swarm.nodes[-1].get("group", latest=True)
            assert {k: v.value for k, v in found.value.items()} == {mine: "short"}
            assert found.expiration_time < time.time() + 6
            # Replaying the older signed record is refused by every node that saw the newer one.
            replay = DHTRecord(key, subkey, old.value, old.expiration_time)
            holders = [node for node in swarm.nodes if node.storage.get(key) is not None]
            assert holders
            for node in holders:
                assert await send(mallory, node, replay) == [False]
            # Lifetimes per record type: refused on the wire, and a clear error for one's own store.
            day_progress = DHTRecord(pack("run.progress"), pack("me"), pack(1), time.time() + DAY - 60)
            assert await send(mallory, swarm.nodes[1], day_progress) == [False]
            with pytest.raises(ValueError, match="at most 60 s"):
                await alice.store("run.progress", 1, time.time() + 3600, subkey="me")
            assert await alice.store("run.progress", 1, time.time() + 15, subkey="me")


async def test_flood_through_real_nodes_does_not_lock_out_short_records():
    async with open_swarm(2, seed=12) as swarm:
        target = swarm.nodes[1]
        target.records.storage = target.storage = RecordStore(max_records=100)
        async with (
            DHTNode.open(initial_peers=[swarm.nodes[0].address]) as mallory,
            DHTNode.open(initial_peers=[swarm.nodes[0].address]) as honest,
        ):
            expiration = time.time() + DAY - 60
            for request in range(12):  # 144 day-long records in 12-record requests, as in the incident
                await send(
                    mallory,
                    target,
                    *(DHTRecord(pack(f"junk{request}.{i}"), None, pack(0), expiration) for i in range(12)),
                )
            assert len(target.storage) == 100 and target.storage.usage(mallory.peer_id.to_bytes())[0] == 100
            short = DHTRecord(pack("run.matchmaking"), pack("honest"), pack(1), time.time() + 4)
            assert await send(honest, target, short) == [True]
            assert unpack(target.storage.get(pack("run.matchmaking"))[pack("honest")].value) == 1


def test_an_owner_refreshing_one_record_does_not_grow_the_store():
    store = RecordStore(clock=Clock())
    for version in range(1, 5000):
        assert store.store(b"k", b"s", b"v%d" % version, NOW + 10, version=version, replay_horizon=NOW + version)
    assert len(store) == 1 and store.replay_guards.heap_entries <= 2 * len(store.replay_guards) + 1024
    assert store.expiry_entries <= 2 * len(store) + 1024


def test_a_refused_replacement_keeps_the_record_it_would_have_replaced() -> None:
    """At capacity, the owner's bigger newer version is refused for want of room: its older record
    must stay (it used to be deleted first, and then even its replay was accepted again)."""
    now = 1000.0
    store = RecordStore(max_records=10, max_bytes=40, clock=lambda: now)
    writer = b"A" * 20
    assert store.store(b"k1", None, b"x" * 10, now + 100, writer=writer)
    assert store.store(b"k2", None, b"x" * 10, now + 100, version=1, writer=writer)
    assert not store.store(b"k2", None, b"y" * 27, now + 90, version=2, writer=writer)
    kept = store.get(b"k2")
    assert kept is not None and kept.value == b"x" * 10 and kept.version == 1
    assert store.get(b"k1") is not None
    assert len(store) == 2 and store.nbytes == 24


def test_a_signer_whose_clock_steps_back_keeps_producing_storable_records() -> None:
    """NTP corrects a fast clock by 400 s: counting on from the old versions made every later
    record "signed in the future", refused by every node, and publishing progress raised."""
    identity = Identity.generate()
    offset = [400.0]
    signer = SignatureValidator(identity, clock=lambda: time.time() + offset[0])
    key, subkey = pack("run.progress"), pack(owner_marker(identity.public_key))

    def signed(ttl: float) -> DHTRecord:
        record = DHTRecord(key, subkey, pack({"epoch": 1}), time.time() + ttl)
        return DHTRecord(key, subkey, signer.sign(record), record.expiration_time)

    signed(5)  # while the clock ran fast
    offset[0] = 0.0
    LocalRecords(CompositeValidator([SignatureValidator()])).check_lifetime(signed(15), time.time())


def test_key_ttl_cap_matches_the_caps_as_validators():
    from dht.lifetimes import key_ttl_cap

    caps = CompositeValidator(DEFAULT_TTL_CAPS)
    for key in ["run.progress", "run.matchmaking", "ffn.3.", "plain", 7, b"raw"]:
        record = DHTRecord(pack(key), None, pack(1), time.time() + 10)
        assert key_ttl_cap(record.key, DEFAULT_TTL_CAPS) == caps.max_ttl(record)
    assert key_ttl_cap(b"\xc1", DEFAULT_TTL_CAPS) is None  # undecodable: no cap of its own
