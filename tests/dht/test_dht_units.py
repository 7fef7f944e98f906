"""DHT rules without sockets: routing table, lookup bookkeeping, storage, validators, wire parsing."""

from __future__ import annotations

import random

import pytest
from kademlia.routing import RoutingTable as PackageRoutingTable

from dht.liveness import PeerHealth, UnansweredEndpoints
from dht.lookup import IterativeLookup
from dht.lookup_driver import DIAL_STALL, INITIAL_RTT, MIN_HEDGE_DELAY, STALL_FLOOR, STALL_RTTS, HedgeTimer, Stalls
from dht.records import MAX_TTL, DHTRecord, RecordError, check_expiration, pack, unpack
from dht.routing import Contact, RoutingTable
from dht.storage import RecordStore, StoredValue
from dht.testing import placed_contact
from dht.validation import CompositeValidator, SchemaValidator, SignatureValidator, ValidationError, owner_marker
from dht.wire import parse_contacts, parse_found, parse_store_request
from peer import BadRequest, Identity, NodeIDProof, PeerID
from peer.node_id import NONCE_BYTES

NOW = 1_000_000.0


def contact(number: int, port: int = 1000) -> Contact:
    return placed_contact(number, port)


# ---------------------------------------------------------------------- routing
def test_bucket_boundary_is_inclusive():
    table = RoutingTable(Contact.for_id(0), ksize=2)
    table.split_bucket(0)  # [0, mid] and [mid + 1, max]
    low, high = table.buckets
    edge = Contact.for_id(low.range[1])
    assert table.get_bucket_for(edge) == 0
    # The package puts an ID equal to a bucket's upper bound in the next bucket:
    package = PackageRoutingTable(None, 2, Contact.for_id(0))
    package.buckets = [low, high]
    assert package.get_bucket_for(edge) == 1


def test_a_table_that_knows_only_its_nearest_nodes_reads_the_swarm_s_size_from_their_spread():
    # A newcomer's table right after its join: the k nearest of the swarm and a few others.
    # Reads draw a few of a key's holders only in a large swarm (``DHTConfig.draw_reads_above``).
    draw = random.Random(7)
    for swarm in (200, 2000, 20000):
        me = draw.getrandbits(160)
        ids = [draw.getrandbits(160) for _ in range(swarm)]
        table = RoutingTable(Contact.for_id(me), ksize=20)
        for number in sorted(ids, key=lambda node_id: node_id ^ me)[:20] + ids[:5]:
            table.add_contact(contact(number))
        assert len(table) <= 25
        assert swarm / 2 <= table.estimated_swarm_size() <= swarm * 2
    small = RoutingTable(Contact.for_id(0), ksize=20)
    for number in range(1, 16):
        small.add_contact(contact(number << 150))
    assert small.estimated_swarm_size() == 15  # (it knows of no others)


def test_buckets_go_stale_by_the_table_s_clock():
    now = [5.0]  # a simulated swarm's monotonic time starts near zero, far below time.monotonic()
    table = RoutingTable(Contact.for_id(0), ksize=2, clock=lambda: now[0])
    table.split_bucket(0)
    assert table.stale_buckets(60) == []
    now[0] = 70.0
    table.touch(0)  # a lookup went to the low half
    assert table.stale_buckets(60) == [table.buckets[1]]
    now[0] = 200.0
    assert table.stale_buckets(60) == table.buckets


def test_a_contact_new_to_a_bucket_counts_as_its_refresh_and_one_already_there_does_not():
    now = [5.0]
    table = RoutingTable(Contact.for_id(0), ksize=4, clock=lambda: now[0])
    table.split_bucket(0)
    far = contact(2**159 + 7)  # in the high half
    now[0] = 50.0
    table.add_contact(far)
    now[0] = 100.0
    assert table.stale_buckets(60) == [table.buckets[0]]  # met at 50: fresh; the low half is not
    for second in range(101, 200):  # the same contact calling again and again holds nothing off
        now[0] = float(second)
        table.add_contact(far)
    assert table.stale_buckets(60) == table.buckets
    table.remove_contact(far)  # it leaves (a peer announcing a relayed address is dropped)...
    table.add_contact(far)  # ...and enters again: not a range met anew
    assert table.stale_buckets(60) == table.buckets
    table.add_contact(contact(2**159 + 9, 1001))  # a contact new to the high half
    assert table.stale_buckets(60) == [table.buckets[0]]


def test_find_neighbors_is_exact():
    rng = random.Random(7)
    me = rng.getrandbits(160)
    table = RoutingTable(Contact.for_id(me), ksize=20)
    contacts = [contact(rng.getrandbits(160), 1000 + i) for i in range(400)]
    for c in contacts:
        table.add_contact(c)
    kept = list(table.contacts())
    # targets anywhere, and near our own ID, where the table splits its buckets finest
    targets = [rng.getrandbits(160) for _ in range(50)] + [me ^ rng.getrandbits(bits) for bits in range(0, 160, 4)]
    for target in targets:
        for k in (1, 20, 45):
            truth = sorted(kept, key=lambda c: c.long_id ^ target)[:k]
            assert table.find_neighbors(Contact.for_id(target), k) == truth
        odd = [c for c in kept if c.long_id % 2]
        truth = sorted(odd, key=lambda c: c.long_id ^ target)[:20]
        assert table.find_neighbors(Contact.for_id(target), 20, exclude=lambda c: c.long_id % 2 == 0) == truth


def test_find_neighbors_looks_at_the_nearest_buckets_only():
    rng = random.Random(8)
    me = rng.getrandbits(160)
    table = RoutingTable(Contact.for_id(me), ksize=20)
    for i in range(2000):
        table.add_contact(contact(rng.getrandbits(160), 1000 + i))
    assert len(table) > 100
    looked: list[Contact] = []
    for _ in range(20):
        looked.clear()
        table.find_neighbors(Contact.for_id(rng.getrandbits(160)), 20, exclude=lambda c: looked.append(c) is not None)
        assert 20 <= len(looked) <= 60  # the buckets that hold the 20 nearest, not all the table


def test_full_bucket_returns_head_to_ping_instead_of_asyncio():
    table = RoutingTable(Contact.for_id(0), ksize=2)
    # Three IDs in the far half whose first two share exactly 5 leading bits: a full bucket of depth
    # 5 (a multiple of 5) not holding our ID does not split.
    base = 0b10000 << 155
    far = [contact(base), contact(base | 1 << 154), contact(base | 1)]
    table.add_contact(contact(1))
    assert table.add_contact(far[0]) is None
    assert table.add_contact(far[1]) is None
    head = table.add_contact(far[2])
    assert head is not None and head.id == far[0].id  # least recently seen
    table.remove_contact(head)  # the ping failed: the newest replacement takes its place
    assert far[2].peer_id in table


def test_peer_health_backoff_then_evict():
    clock = [0.0]
    health = PeerHealth(base=1.0, evict_after=3, clock=lambda: clock[0])
    peer = PeerID(b"\1" * 20)
    assert not health.failed(peer)  # one lost reply: backoff, no eviction
    assert health.backing_off(peer)
    clock[0] = 1.5
    assert not health.backing_off(peer)
    assert not health.failed(peer)
    assert health.failed(peer)
    health.succeeded(peer)
    assert not health.backing_off(peer) and health.failures(peer) == 0


def test_an_endpoint_that_did_not_answer_as_named_waits_longer_each_time_and_spares_its_own_peer():
    clock = [0.0]
    endpoints = UnansweredEndpoints(base=10.0, maximum=30.0, capacity=2, clock=lambda: clock[0])
    named, real = PeerID(b"\1" * 20), PeerID(b"\2" * 20)
    endpoint = ("192.0.2.1", 4000)
    endpoints.failed(endpoint)  # nothing answered there
    assert endpoints.blocks(endpoint, named) and endpoints.blocks(endpoint, real)
    clock[0] = 10.5
    assert not endpoints.blocks(endpoint, named)  # expired: one more dial may go
    endpoints.failed(endpoint, answered_by=real)  # a peer answered, with another identity
    assert endpoints.blocks(endpoint, named) and not endpoints.blocks(endpoint, real)
    clock[0] = 30.0
    assert endpoints.blocks(endpoint, named)  # the second failure waits twice as long (20 s)
    endpoints.failed(endpoint)
    clock[0] = 59.0
    assert endpoints.blocks(endpoint, named)  # the third: capped at 30 s
    clock[0] = 60.5
    assert not endpoints.blocks(endpoint, named)
    endpoints.failed(endpoint)
    endpoints.answered(endpoint)  # it answered as the peer named: forgotten
    assert not endpoints.blocks(endpoint, named) and len(endpoints) == 0
    for port in range(5):  # a liar naming many endpoints: the oldest failures are forgotten
        endpoints.failed(("192.0.2.1", port))
    assert len(endpoints) == 2 and endpoints.blocks(("192.0.2.1", 4), named)
    assert not endpoints.blocks(("192.0.2.1", 0), named)


# ---------------------------------------------------------------------- lookup
def test_lookup_alpha_in_flight_and_exact_result():
    rng = random.Random(1)
    world = [contact(rng.getrandbits(160), i + 1) for i in range(200)]
    target = rng.getrandbits(160)

    def neighbours_of(c: Contact) -> list[Contact]:  # every peer knows its 8 nearest to the target
        rng_local = random.Random(c.long_id)
        return sorted(rng_local.sample(world, 30), key=lambda x: x.long_id ^ target)[:8]

    search = IterativeLookup(target, world[:3], k=20, alpha=3)
    max_in_flight = 0
    while not search.done:
        batch = search.next_queries()
        max_in_flight = max(max_in_flight, search.in_flight)
        if not batch and search.in_flight == 0:
            break
        for c in batch:
            search.on_response(c, neighbours_of(c))
    assert max_in_flight <= 20
    assert search.done
    assert search.rpcs >= 20
    answered = search.closest()
    assert answered == sorted(answered, key=lambda c: c.long_id ^ target)


def test_lookup_respects_alpha_until_stalled():
    target = 0
    initial = [contact(1 << i) for i in range(100, 130)]
    search = IterativeLookup(target, initial, k=20, alpha=3)
    first = search.next_queries()
    assert len(first) == 3 and search.next_queries() == []
    closer = [contact(i) for i in range(1, 6)]
    search.on_response(first[0], closer)  # progress: stays at alpha
    assert len(search.next_queries()) == 1
    search.on_response(first[1], [])  # no closer node: widen to k (the paper's final round)
    assert len(search.next_queries()) > 1


def test_lookup_failures_drop_out_and_narrow_start():
    initial = [contact(i) for i in range(1, 6)]
    search = IterativeLookup(0, initial, k=3, alpha=3)
    search.start_narrow()
    (first,) = search.next_queries()
    assert search.next_queries() == []
    search.on_failure(first)
    batch = search.next_queries()
    assert len(batch) == 3 and first not in batch
    for c in batch:
        search.on_response(c, [first])  # a failed peer named again is not retried
    assert search.done and first.id not in {c.id for c in search.closest()}


def test_a_stalled_request_frees_its_place_and_holds_the_lookup_only_while_answers_are_fewer():
    initial = [contact(i) for i in range(1, 7)]
    search = IterativeLookup(0, initial, k=4, alpha=2)
    slow, second = search.next_queries()
    search.stall(slow)  # unanswered for long: another is asked in its place
    (third,) = search.next_queries()
    assert slow.id not in {c.id for c in [second, third]} and search.in_flight == 3
    search.on_response(second, [])
    search.on_response(third, [])
    while batch := search.next_queries():  # the stalled one is not asked again
        assert slow.id not in {c.id for c in batch}
        for c in batch:
            search.on_response(c, [])
    assert search.done  # the next candidate was asked in the stalled one's place: 4 answers outnumber 1
    assert slow.id not in {c.id for c in search.closest()}
    search.on_response(slow, [])  # its answer, while the lookup runs, still counts
    assert slow.id in {c.id for c in search.closest()} and search.in_flight == 0


def test_contacts_that_never_answer_cannot_shrink_a_lookup_s_k_nearest():
    # One answer names 9 contacts nearer the target that never answer (black holes): each stalls,
    # and the next candidates take their places, so a store still reaches k holders.
    search = IterativeLookup(0, [contact(i) for i in range(10, 50)], k=20, alpha=3)
    first, *others = search.next_queries()
    holes = [contact(i) for i in range(1, 10)]
    search.on_response(first, holes)
    for c in others:
        search.on_response(c, [])
    while not search.done:
        for c in search.next_queries():
            if c in holes:
                search.stall(c)
            else:
                search.on_response(c, [])
    replacements = [contact(i) for i in range(10, 30)]  # the 20 nearest that answer
    assert all(search.responded(c) and search.among_nearest(c) for c in replacements)  # (a store sends to them)
    assert not {c.id for c in holes} & {c.id for c in search.closest()}


def test_stalled_requests_that_outnumber_the_answers_are_waited_for():
    search = IterativeLookup(0, [contact(i) for i in range(1, 4)], k=20, alpha=3)
    first, second, third = search.next_queries()
    search.stall(first)
    search.stall(second)
    search.on_response(third, [])
    assert not search.done and search.in_flight == 2  # one answer, two stalled: wait
    search.on_failure(first)  # a stalled request that fails drops out
    assert search.in_flight == 1 and not search.done  # one answer against one stalled
    search.on_response(second, [])
    assert search.done and {c.id for c in search.closest()} == {second.id, third.id}


def test_a_lookup_s_closest_are_the_k_nearest_candidates_that_answered():
    # A far request stalls and nearer contacts push it out of the 4 nearest: what answered beyond
    # the 4 nearest live candidates is not among the closest (a store would send there).
    search = IterativeLookup(0, [contact(i) for i in (10, 11, 12, 13)], k=4, alpha=3, quorum=2)
    first, second, far = search.next_queries()
    search.stall(far)
    search.on_response(first, [contact(1), contact(2), contact(3)])
    search.on_response(second, [])
    while not search.done:
        for c in search.next_queries():
            if c.long_id in (1, 2):
                search.on_response(c, [])
    assert [c.long_id for c in search.closest()] == [1, 2, 10]  # (3 is being asked; 11 lies beyond)


def test_a_lookup_that_draws_its_holders_asks_a_spare_for_a_stalled_request():
    search = IterativeLookup(0, [contact(i) for i in range(1, 21)], k=20, quorum=2, window=20, salt=b"s")
    asked = search.next_queries()
    assert len(asked) == 2
    search.stall(asked[0])
    (spare,) = search.next_queries()
    assert spare.id not in {c.id for c in asked}
    assert search.in_flight == 3  # the stalled one still counts as asked; its answer fills the quorum
    search.on_response(asked[0], [])
    search.on_response(asked[1], [])
    assert search.done


# ---------------------------------------------------------------------- storage
def test_storage_newer_wins_and_expiry():
    clock = [NOW]
    store = RecordStore(clock=lambda: clock[0])
    assert store.store(b"k", None, b"v1", NOW + 10)
    assert not store.store(b"k", None, b"v0", NOW + 5)  # older: refused
    assert store.store(b"k", None, b"v1", NOW + 10)  # same record again: idempotent
    assert not store.store(b"k", None, b"v2", NOW + 10)  # same time, other value: refused
    assert store.store(b"k", None, b"v3", NOW + 20)
    assert store.get(b"k") == StoredValue(b"v3", NOW + 20)
    assert not store.store(b"x", None, b"v", NOW - 1)  # already expired
    clock[0] = NOW + 21
    assert store.get(b"k") is None and len(store) == 0


def test_storage_dictionary_values():
    clock = [NOW]
    store = RecordStore(clock=lambda: clock[0])
    assert store.store(b"k", b"a", b"1", NOW + 10)
    assert store.store(b"k", b"b", b"2", NOW + 20)
    assert not store.store(b"k", b"a", b"0", NOW + 5)
    assert store.get(b"k") == {b"a": StoredValue(b"1", NOW + 10), b"b": StoredValue(b"2", NOW + 20)}
    assert not store.store(b"k", None, b"plain", NOW + 15)  # older than the newest subkey
    clock[0] = NOW + 11
    assert store.get(b"k") == {b"b": StoredValue(b"2", NOW + 20)}
    assert store.store(b"k", None, b"plain", NOW + 30)  # newer than the whole dictionary
    assert store.get(b"k") == StoredValue(b"plain", NOW + 30)
    assert len(store) == 1


def test_storage_caps_evict_soonest_expiring_only_for_longer_lived():
    store = RecordStore(max_records=3, max_subkeys=2, clock=lambda: NOW)
    for i in range(3):
        assert store.store(b"k%d" % i, None, b"v", NOW + 10 + i)
    assert not store.store(b"short", None, b"v", NOW + 5)  # would outlive nothing: refused
    assert store.store(b"long", None, b"v", NOW + 100)  # evicts k0 (soonest)
    assert store.get(b"k0") is None and store.get(b"long") is not None and len(store) == 3
    store = RecordStore(max_subkeys=2, clock=lambda: NOW)
    assert store.store(b"d", b"1", b"v", NOW + 10) and store.store(b"d", b"2", b"v", NOW + 20)
    assert not store.store(b"d", b"3", b"v", NOW + 5)
    assert store.store(b"d", b"3", b"v", NOW + 30)
    assert set(store.get(b"d")) == {b"2", b"3"}


# ---------------------------------------------------------------------- validators
def signed_record(identity: Identity, signer: Identity, value: object = 1) -> tuple[DHTRecord, bytes]:
    key = pack(f"state{owner_marker(identity.public_key)}")
    record = DHTRecord(key, None, pack(value), NOW + 60)
    return record, SignatureValidator(signer).sign(record) if signer is identity else b""


def test_signed_records_accept_owner_refuse_forgery():
    owner, mallory = Identity.generate(), Identity.generate()
    validator = SignatureValidator()
    record, signed = signed_record(owner, owner)
    good = DHTRecord(record.key, None, signed, record.expiration_time)
    assert validator.validate(good) and unpack(validator.strip(good)) == 1
    with pytest.raises(ValidationError):  # mallory's node refuses to sign for the owner's key
        SignatureValidator(mallory).sign(record)
    forged_signature = mallory.sign(b"anything")
    assert not validator.validate(DHTRecord(record.key, None, pack([record.value, forged_signature]), NOW + 60))
    assert not validator.validate(DHTRecord(record.key, None, record.value, NOW + 60))  # unsigned
    assert not validator.validate(DHTRecord(record.key, None, signed, NOW + 600))  # extended expiration
    # A signed subkey under a public key: only the subkey's owner may write it.
    subkey = pack(owner_marker(owner.public_key))
    entry = DHTRecord(pack("group"), subkey, pack("addr"), NOW + 60)
    assert validator.validate(replace_value(entry, SignatureValidator(owner).sign(entry)))
    assert not validator.validate(entry)


def replace_value(record: DHTRecord, value: bytes) -> DHTRecord:
    return DHTRecord(record.key, record.subkey, value, record.expiration_time)


def test_schema_and_composition():
    owner = Identity.generate()
    schema = SchemaValidator("progress.", {"step": int}.__class__, subkey_check=str)
    composite = CompositeValidator([SignatureValidator(owner), schema])
    assert [type(v) for v in composite.validators] == [SchemaValidator, SignatureValidator]
    record = DHTRecord(pack("progress.run1"), pack(owner_marker(owner.public_key)), pack({"step": 3}), NOW + 60)
    wire_value = composite.sign(record)
    assert composite.validate(replace_value(record, wire_value))
    assert unpack(composite.strip(replace_value(record, wire_value))) == {"step": 3}
    bad = DHTRecord(record.key, record.subkey, pack([1, 2]), NOW + 60)
    assert not composite.validate(replace_value(bad, composite.sign(bad)))  # signed, but wrong schema
    other_prefix = DHTRecord(pack("other"), None, pack([1, 2]), NOW + 60)
    assert composite.validate(other_prefix)


# ---------------------------------------------------------------------- limits and wire
def test_records_limits():
    with pytest.raises(RecordError):
        check_expiration(NOW + MAX_TTL * 2, NOW)
    for bad in (float("nan"), float("inf"), True, "soon", None):
        with pytest.raises(RecordError):
            check_expiration(bad, NOW)
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(RecordError, match="nesting"):
        unpack(pack(deep))
    with pytest.raises(RecordError):
        unpack(b"\xc1")  # never-used msgpack byte


@pytest.mark.parametrize(
    "body",
    [
        None,
        "x",
        [],
        [[b"k", None, b"v"]],
        [[b"\xa1k", None, b"\xa1v", "tomorrow"]],
        [[b"\xa1k", None, b"\xa1v", 1e300]],
        [[b"\xa1k" + b"x" * 5000, None, b"\xa1v", NOW + 5]],
        [[b"\xa1k", None, b"\xc4" + b"x" * 100_000, NOW + 5]],
        [[b"\xa1k", None, b"\x91" * 100 + b"\x01", NOW + 5]],
        [[b"\xa1k", 7, b"\xa1v", NOW + 5]],
        [[b"\xa1k", None, b"\xa1v", NOW + 5]] * 100,
    ],
)
def test_store_request_parsing_refuses_bad_bodies(body):
    with pytest.raises(BadRequest):
        parse_store_request(body, NOW)


def test_reply_parsing_skips_or_refuses_garbage():
    nonce = bytes(NONCE_BYTES)
    good = [b"\2" * 20, "127.0.0.1", 5, nonce]
    garbage = [[b"\3" * 19, "h", 5, nonce], [b"\4" * 20, "h", 0, nonce], "junk", [b"\5" * 20, "h", True, nonce]]
    garbage += [[b"\6" * 20, "h", 5], [b"\7" * 20, "h", 5, b"short"]]  # no nonce, a malformed one
    parsed = parse_contacts([good, *garbage], 0)
    assert [c.peer_id for c in parsed] == [PeerID(b"\2" * 20)]
    with pytest.raises(RecordError):
        parse_contacts([good] * 1000, 0)
    assert parse_found(b"k", pack([0, b"v", NOW + 5]), NOW)[0].value == b"v"
    assert parse_found(b"k", pack([0, b"v", NOW - 5]), NOW) == []  # expired: dropped
    for garbage in (pack("x"), pack([2, 1]), pack([1, "no"]), pack([0, 5, NOW + 5]), b"\xc1"):
        with pytest.raises(RecordError):
            parse_found(b"k", garbage, NOW)


# ---------------------------------------------------------------------- hedging
def test_hedge_delay_follows_smoothed_rtt_within_floor_and_ceiling():
    timer = HedgeTimer(ceiling=2.0)
    assert timer.delay() == pytest.approx(3 * INITIAL_RTT)
    for _ in range(100):
        timer.observe(0.0001)  # loopback-fast answers: the floor keeps scheduling noise from hedging
    assert timer.delay() == MIN_HEDGE_DELAY
    timer.observe(10.0)  # one slow answer moves the estimate by a tenth of the difference only
    assert timer.rtt == pytest.approx(1.0, rel=0.01)
    assert timer.delay() == 2.0  # never longer than one request may take


def test_stalls_come_due_per_request_and_each_answer_is_timed_from_its_own_send():
    timer = HedgeTimer(ceiling=2.0)
    assert timer.stall_delay() == STALL_FLOOR and timer.stall_delay(dialling=True) == DIAL_STALL * STALL_FLOOR
    for _ in range(200):
        timer.observe(0.2)  # answers 0.2 s away: 8 of them
    assert timer.stall_delay() == pytest.approx(STALL_RTTS * 0.2, rel=0.01)
    timer.observe(100.0)
    assert timer.stall_delay() == 2.0 and timer.stall_delay(dialling=True) == 4.0  # (at most a request's deadline)
    stalls = Stalls()
    near, far = contact(1), contact(2)
    stalls.sent(near, 10.0, 0.5)
    stalls.sent(far, 10.1, 1.0)
    assert stalls.next_at() == 10.5 and stalls.due(10.4) == []
    assert stalls.due(10.5) == [near] and stalls.next_at() == pytest.approx(11.1)
    assert stalls.settled(near) == 10.0  # a stalled request's answer is timed from its own send too
    assert stalls.settled(far) == 10.1 and stalls.next_at() == float("inf")
    assert stalls.settled(contact(3)) is None  # (not one of ours)


# ---------------------------------------------------------------------- node-ID proofs on contacts
DIFFICULTY = 10


def _named(proof: NodeIDProof, port: int = 7000) -> list:
    """A contact as another peer names it in a find reply."""
    return [proof.peer_id.to_bytes(), "127.0.0.1", port, proof.nonce]


def test_a_reply_names_each_endpoint_once_and_no_peer_behind_a_relay():
    """One endpoint is one peer; a peer reached through a relay is behind NAT, a client of the
    DHT that nobody asks (``dht/contacts.py``), so a reply naming one costs us no dial."""
    proofs = [NodeIDProof.solve(Identity.generate().peer_id, DIFFICULTY) for _ in range(5)]
    relay = Identity.generate().peer_id
    relayed = [[p.peer_id.to_bytes(), f"192.0.2.9/{relay}", 4001, p.nonce] for p in proofs[3:]]
    named = [_named(proofs[0]), _named(proofs[1]), _named(proofs[2], port=7001), *relayed]
    parsed = parse_contacts(named, DIFFICULTY)
    assert [c.peer_id for c in parsed] == [proofs[0].peer_id, proofs[2].peer_id]


def test_a_contact_with_an_unsolved_or_foreign_nonce_is_not_admitted():
    honest = NodeIDProof.solve(Identity.generate().peer_id, DIFFICULTY)
    sybil = Identity.generate().peer_id
    foreign = [sybil.to_bytes(), "127.0.0.1", 7001, honest.nonce]  # someone else's solution
    unsolved = next(
        nonce
        for nonce in (n.to_bytes(NONCE_BYTES, "little") for n in range(1 << 16))
        if not NodeIDProof(sybil, nonce).satisfies(DIFFICULTY)
    )
    named = [_named(honest), foreign, [sybil.to_bytes(), "127.0.0.1", 7002, unsolved]]
    if NodeIDProof(sybil, honest.nonce).satisfies(DIFFICULTY):
        named.remove(foreign)  # a 2**-10 accident: the borrowed nonce solves the sybil's key too
    parsed = parse_contacts(named, DIFFICULTY)  # dropped quietly, never an exception
    assert [c.peer_id for c in parsed] == [honest.peer_id]
    assert parsed[0].id == honest.node_id
    # The same reply in a run of lower difficulty admits what meets that (the parse cache is shared).
    assert len(parse_contacts(named, 0)) == len(named)
    assert parse_contacts(named, DIFFICULTY) == parsed


def test_a_routing_position_comes_from_the_puzzle_not_the_peer_id():
    peer_id = Identity.generate().peer_id
    first = NodeIDProof.solve(peer_id, 4)
    second = NodeIDProof.solve(peer_id, 4, start=int.from_bytes(first.nonce, "little") + 1)
    [a] = parse_contacts([_named(first)], 4)
    [b] = parse_contacts([_named(second)], 4)
    assert a.peer_id == b.peer_id == peer_id
    assert a.long_id == int.from_bytes(first.node_id, "big") != peer_id.to_int()
    assert a.long_id != b.long_id  # same peer, another solution: another place
    table = RoutingTable(Contact.for_id(0), ksize=20)
    table.add_contact(a)
    nearest_to_node_id = table.find_neighbors(Contact.for_id(a.long_id ^ 1), 1)
    assert nearest_to_node_id == [a] and table.get(peer_id) is a
    # Grinding keys moves peer IDs, not node IDs: a peer ID right next to a target buys nothing.
    # (Placed by peer ID, ``a`` at distance 2 would be nearest; by its node ID it is far away.)
    target = peer_id.to_int() ^ 2
    other = placed_contact(target ^ 3, 7003)
    table.add_contact(other)
    assert table.find_neighbors(Contact.for_id(target), 1) == [other]


def test_nearest_leaves_out_the_caller_however_often_it_is_in_the_table():
    from types import SimpleNamespace

    from dht.background import Background
    from dht.contacts import Contacts
    from peer import Identity, NodeIDProof, PeerAddress

    table = RoutingTable(Contact.for_id(0), 20)
    peers = [Identity.generate().peer_id for _ in range(30)]
    for n, peer in enumerate(peers):
        table.add_contact(Contact(NodeIDProof.solve(peer, 0), PeerAddress("127.0.0.1", 1000 + n, peer)))
    caller = peers[0]  # twice in the table, under two nonces
    table.add_contact(Contact(NodeIDProof.solve(caller, 0, start=10**6), PeerAddress("127.0.0.1", 999, caller)))
    contacts = Contacts(SimpleNamespace(node_id_difficulty=0), table, Background(None), rpc_timeout=1.0)
    for target in [0, 2**159, 2**160 - 1, *(c.long_id for c in table.contacts())]:
        for k in (1, 5, 20, 40):
            expected = table.find_neighbors(Contact.for_id(target), k, exclude=lambda c: c.peer_id == caller)
            assert contacts.nearest(target, k, excluding=caller) == expected
