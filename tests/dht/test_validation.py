"""A dictionary record is verified once: N writers under one key cost N signature verifications at
the node that stores them and N at a reader, however often the key is read; a record altered in
any signed field, or in its signature, is verified afresh and refused even after the genuine one
was remembered.

Verifications are counted by giving the validators (``SignatureValidator``, ``DHTNode.open``) a
``VerifiedSignatureCache`` of their own whose verifier counts its calls.
"""

from __future__ import annotations

import time

import msgpack
import trio

from dht.local import LocalRecords
from dht.node import DHTNode
from dht.peer_dictionary import peer_entries, peer_subkey
from dht.records import DHTRecord, pack, unpack
from dht.validation import CompositeValidator, SchemaValidator, SignatureValidator
from dht.wire import MAX_RECORDS_PER_STORE
from peer import Identity, open_peer_host
from peer.verified import VerifiedSignatureCache, default_signature_cache
from tests.support.signatures import CountingVerifier

KEY = "run.matchmaking"
WRITERS = 16
READS = 10


def writer_records(writers: list[Identity], expiration: float) -> list[DHTRecord]:
    """Each writer's own entry under ``KEY``, in wire form, signed as its node signs it."""
    records = []
    for number, writer in enumerate(writers):
        record = DHTRecord(pack(KEY), pack(peer_subkey(writer.public_key)), pack({"n": number}), expiration)
        records.append(DHTRecord(record.key, record.subkey, SignatureValidator(writer).sign(record), expiration))
    return records


def wire_form(record: DHTRecord) -> list:
    return [record.key, record.subkey, record.value, record.expiration_time]


def counted_records() -> tuple[LocalRecords, CountingVerifier]:
    counting = CountingVerifier()
    validator = CompositeValidator([SignatureValidator(signatures=VerifiedSignatureCache(verifier=counting))])
    return LocalRecords(validator), counting


def test_reading_a_dictionary_again_verifies_nothing_again() -> None:
    records, counting = counted_records()
    writers = [Identity.generate() for _ in range(WRITERS)]
    for record in writer_records(writers, time.time() + 60):
        assert records.store(record)
    assert counting.calls == WRITERS
    for _ in range(READS):
        found = records.found(pack(KEY))
        assert found is not None and len(found) == WRITERS
        value = records.decode(pack(KEY), found)
        assert sorted(entry.value["n"] for entry in value.value.values()) == list(range(WRITERS))
    assert counting.calls == WRITERS  # not WRITERS * (READS + 1)


def tampered(record: DHTRecord, other: Identity) -> dict[str, DHTRecord]:
    """``record`` changed in one signed field, or in its signature, with everything else kept."""
    inner, version, signature = unpack(record.value)
    flipped = bytes([signature[0] ^ 0x40]) + signature[1:]

    def enveloped(*envelope: object) -> DHTRecord:
        return DHTRecord(record.key, record.subkey, msgpack.packb(list(envelope)), record.expiration_time)

    return {
        "value": enveloped(pack({"n": 99}), version, signature),
        "version": enveloped(inner, version + 1, signature),
        "signature": enveloped(inner, version, flipped),
        "expiration": DHTRecord(record.key, record.subkey, record.value, record.expiration_time + 30),
        "key": DHTRecord(pack("run.progress"), record.subkey, record.value, record.expiration_time),
        "another owner's subkey": DHTRecord(
            record.key, pack(peer_subkey(other.public_key)), record.value, record.expiration_time
        ),
    }


def test_a_tampered_record_is_refused_after_the_genuine_one_was_remembered() -> None:
    records, counting = counted_records()
    owner, other = Identity.generate(), Identity.generate()
    genuine = writer_records([owner], time.time() + 60)[0]
    assert records.store(genuine) and records.found(pack(KEY)) is not None
    assert counting.calls == 1
    validator = records.validator
    for name, record in tampered(genuine, other).items():
        before = counting.calls
        assert validator.inner_if_valid(record) is None, name
        assert not validator.validate(record), name
        assert not records.store(record), name
        # Not answered from the cache: every check of it was a real verification, or (another
        # owner's subkey, whose marked key is not the signer's) the signature check itself failed.
        assert counting.calls - before == 3, name
    assert validator.validate(genuine) and counting.calls == 1 + 3 * 6
    found = records.found(pack(KEY))
    assert found is not None and list(found) == [genuine.subkey]
    assert found[genuine.subkey].value == genuine.value
    assert found[genuine.subkey].expiration_time == genuine.expiration_time


def test_a_flood_of_valid_records_only_pushes_older_ones_out(monkeypatch) -> None:
    """Anyone may sign as many records of their own as they like: the signature cache and the
    node's remembered verdicts stay within their bounds, and an entry pushed out of both costs
    its verification again the next time it is read."""
    counting = CountingVerifier()
    capacity = 32
    monkeypatch.setattr("dht.local.VERDICTS", capacity)
    cache = VerifiedSignatureCache(capacity, verifier=counting)
    records = LocalRecords(CompositeValidator([SignatureValidator(signatures=cache)]))
    genuine = writer_records([Identity.generate()], time.time() + 60)[0]
    assert records.store(genuine)
    flooder, expiration = Identity.generate(), time.time() + 60
    for number in range(10 * capacity):
        record = DHTRecord(
            pack(f"flood{number}.matchmaking"), pack(peer_subkey(flooder.public_key)), pack(1), expiration
        )
        assert records.store(DHTRecord(record.key, record.subkey, SignatureValidator(flooder).sign(record), expiration))
        assert len(cache) <= capacity
    before = counting.calls
    for _ in range(READS):
        found = records.found(pack(KEY))
        assert found is not None and found[genuine.subkey].value == genuine.value
    assert counting.calls == before + 1


def test_validators_share_the_process_cache_unless_given_their_own() -> None:
    assert SignatureValidator().signatures is default_signature_cache()
    own = VerifiedSignatureCache(4)
    assert SignatureValidator(Identity.generate(), signatures=own).signatures is own


async def test_a_storing_node_and_a_reader_verify_each_writer_once_over_many_reads() -> None:
    """Through real nodes on 127.0.0.1: the writers' entries reach the storing node in a store
    request; the reader reads the key many times; each node verifies each writer once in all."""
    at_storage, at_reader = CountingVerifier(), CountingVerifier()
    writers = [Identity.generate() for _ in range(WRITERS)]
    expiration = time.time() + 60
    records = writer_records(writers, expiration)
    storage_cache = VerifiedSignatureCache(verifier=at_storage)
    async with DHTNode.open(signatures=storage_cache) as storage:
        reader_cache = VerifiedSignatureCache(verifier=at_reader)
        async with DHTNode.open(initial_peers=[storage.address], client_mode=True, signatures=reader_cache) as reader:
            async with open_peer_host(Identity.generate(), listen=None) as sender:
                connection = await sender.connect(storage.address)
                for first in range(0, WRITERS, MAX_RECORDS_PER_STORE):
                    batch = [wire_form(record) for record in records[first : first + MAX_RECORDS_PER_STORE]]
                    with trio.fail_after(10):
                        reply = await connection.call("dht.store", batch, timeout=10)
                    assert reply.body == [True] * len(batch)
                for _ in range(READS):
                    with trio.fail_after(10):
                        found = await reader.get(KEY, latest=True)
                    entries = dict(peer_entries(found, lambda peer, value: value["n"]))
                    assert sorted(entries.values()) == list(range(WRITERS))
                assert at_storage.calls == WRITERS
                assert at_reader.calls == WRITERS

                # A copy of a remembered entry with a later expiration is refused by the storing
                # node, and readers keep seeing the entry as its owner signed it.
                stretched = tampered(records[0], writers[1])["expiration"]
                with trio.fail_after(10):
                    reply = await connection.call("dht.store", [wire_form(stretched)], timeout=10)
                assert reply.body == [False]
                with trio.fail_after(10):
                    found = await reader.get(KEY, latest=True)
                assert found is not None
                assert found.value[peer_subkey(writers[0].public_key)].expiration_time == expiration


class CountingValidator(SchemaValidator):
    """A schema check on ``run.`` keys that counts the records it is asked about."""

    def __init__(self, refuse: bool = False):
        super().__init__("run.", lambda value: not refuse)
        self.calls = 0

    def inner_if_valid(self, record: DHTRecord) -> bytes | None:
        self.calls += 1
        return super().inner_if_valid(record)


def test_a_record_read_again_is_not_validated_again_until_a_validator_is_added() -> None:
    counting = CountingValidator()
    validator = CompositeValidator([SignatureValidator(), counting])
    records = LocalRecords(validator)
    for record in writer_records([Identity.generate() for _ in range(WRITERS)], time.time() + 60):
        assert records.store(record)
    for _ in range(READS):
        found = records.found(pack(KEY))
        assert found is not None and len(found) == WRITERS
    assert counting.calls == WRITERS  # once each, when stored
    refusing = CountingValidator(refuse=True)
    validator.add(refusing)  # what was accepted before is judged again
    assert records.found(pack(KEY)) is None
    assert refusing.calls == WRITERS


def test_a_remembered_record_still_expires_and_its_lifetime_is_still_checked() -> None:
    records = LocalRecords(CompositeValidator([SignatureValidator()]))
    now = time.time()
    (record,) = writer_records([Identity.generate()], now + 60)
    assert records.store(record)
    assert records.found(pack(KEY)) is not None
    records.storage.clock = lambda: now + 61  # read after it expired: nothing, though remembered
    assert records.found(pack(KEY)) is None
    records.storage.clock = lambda: now - 10 * 3600  # a clock far behind: the record asks too much of it
    assert records.validated([record]) is None
