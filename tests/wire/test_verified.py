"""The verified-signature cache answers only the very triple it verified, keeps only successes,
and stays within its bound however many records arrive and however large they are."""

from __future__ import annotations

import threading
import tracemalloc

from peer import Identity
from peer.verified import SIGNATURES_KEPT, VerifiedSignatureCache, default_signature_cache
from tests.support.signatures import CountingVerifier


def signed(identity: Identity, message: bytes) -> tuple[bytes, bytes, bytes]:
    return identity.public_key, identity.sign(message), message


def test_a_triple_is_verified_once_and_any_change_is_verified_afresh() -> None:
    counting = CountingVerifier()
    cache = VerifiedSignatureCache(verifier=counting)
    alice, mallory = Identity.generate(), Identity.generate()
    key, signature, message = signed(alice, b"progress 7")
    for _ in range(5):
        assert cache.verify(key, signature, message)
    assert counting.calls == 1

    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not cache.verify(key, flipped, message)
    assert not cache.verify(key, signature, b"progress 8")
    assert not cache.verify(mallory.public_key, signature, message)
    assert counting.calls == 4
    # Failures are not kept: the same forgery costs a verification each time, and is refused each time.
    assert not cache.verify(key, flipped, message)
    assert counting.calls == 5
    assert len(cache) == 1
    assert cache.verify(key, signature, message) and counting.calls == 5


def test_parts_of_a_triple_cannot_be_shifted_between_its_fields() -> None:
    """Key, signature and message are hashed with their lengths: moving bytes from the end of the
    signature to the start of the message makes another triple, which is verified (and fails)."""
    counting = CountingVerifier()
    cache = VerifiedSignatureCache(verifier=counting)
    key, signature, message = signed(Identity.generate(), b"declaration")
    assert cache.verify(key, signature, message)
    assert not cache.verify(key, signature[:-1], signature[-1:] + message)
    assert not cache.verify(key + signature[:1], signature[1:], message)
    assert counting.calls == 3


def test_a_flood_of_valid_records_stays_within_the_bound_and_evicts_the_least_recently_met() -> None:
    counting = CountingVerifier()
    capacity = 64
    cache = VerifiedSignatureCache(capacity, verifier=counting)
    signer = Identity.generate()
    flood = [signed(signer, b"%d" % i) for i in range(10 * capacity)]
    kept_early = flood[0]
    for number, triple in enumerate(flood):
        assert cache.verify(*triple)
        if number % 8 == 0:
            assert cache.verify(*kept_early)  # met again and again: never the least recent
        assert len(cache) <= capacity
    assert len(cache) == capacity
    assert counting.calls == len(flood)

    before = counting.calls
    assert all(cache.verify(*triple) for triple in flood[-(capacity - 1) :])
    assert cache.verify(*kept_early)
    assert counting.calls == before  # the newest and the one met often were all kept
    assert cache.verify(*flood[1]) and counting.calls == before + 1  # pushed out: verified again


def test_memory_is_bounded_by_entries_whatever_the_messages_size() -> None:
    """An entry is a digest, not the message: 16 KiB records fill a cache no more than empty ones."""
    capacity = 512
    cache = VerifiedSignatureCache(capacity, verifier=lambda key, signature, message: True)
    signature = bytes(64)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for i in range(4 * capacity):
            cache.verify(bytes(32), signature, i.to_bytes(4, "big") * 4096)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert len(cache) == capacity
    assert grown < capacity * 400  # ~150 bytes an entry; 16 KiB a message would be 8 MiB


def test_a_cache_of_capacity_zero_verifies_every_time() -> None:
    counting = CountingVerifier()
    cache = VerifiedSignatureCache(0, verifier=counting)
    triple = signed(Identity.generate(), b"x")
    assert cache.verify(*triple) and cache.verify(*triple)
    assert counting.calls == 2 and len(cache) == 0


def test_threads_share_one_cache_safely() -> None:
    counting = CountingVerifier()
    capacity = 32
    cache = VerifiedSignatureCache(capacity, verifier=counting)
    signers = [Identity.generate() for _ in range(4)]
    triples = [signed(signers[i % 4], b"%d" % i) for i in range(4 * capacity)]
    forged = [(key, bytes(64), message) for key, _signature, message in triples[:8]]
    answers: list[bool] = []
    failures: list[bool] = []

    def work(offset: int) -> None:
        for round_ in range(3):
            for triple in triples[offset::2]:
                answers.append(cache.verify(*triple))
            failures.extend(cache.verify(*triple) for triple in forged[round_::3])

    threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4 * 3 * len(triples) // 2 and all(answers)
    assert failures and not any(failures)
    assert len(cache) <= capacity


def test_the_process_default_is_one_cache_of_the_documented_size() -> None:
    assert default_signature_cache() is default_signature_cache()
    assert default_signature_cache().capacity == SIGNATURES_KEPT
