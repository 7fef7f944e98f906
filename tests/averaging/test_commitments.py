"""Committed parts (``averaging/commitments.py``): a commitment holds for exactly the round, sender
and weight it was signed for, names each reducer's parts by digest as sent, and is verified once."""

from __future__ import annotations

import sys
import threading
import tracemalloc

import pytest
import torch

import averaging.commitments as commitments
from averaging.commitments import Commitment, VerifiedSignatures, commit, part_digest
from averaging.compression import get_codec
from peer import Identity


def test_a_commitment_binds_the_parts_as_sent_and_their_context():
    sender, reducer, other = Identity.generate(), Identity.generate(), Identity.generate()
    codec = get_codec("blockwise_8bit")
    encoded = [codec.encode(torch.randn(4096)) for _ in range(3)]
    digests = [part_digest(meta, bytes(payload)) for meta, payload in encoded]
    group = b"g" * 16
    commitment = commit(sender, group, 2.0, [(reducer.peer_id, digests[:2]), (other.peer_id, digests[2:])])
    assert commitment.verify(group, sender.peer_id, 2.0)
    assert commitment.digest(reducer.peer_id, 1) == digests[1] and commitment.digest(other.peer_id, 0) == digests[2]
    assert commitment.digest(reducer.peer_id, 2) is None and commitment.digest(sender.peer_id, 0) is None
    # the digest covers meta and payload as sent
    meta, payload = encoded[0]
    tampered = bytearray(payload)
    tampered[-1] ^= 1
    assert part_digest(meta, bytes(tampered)) != digests[0]
    assert part_digest({**meta, "codec": "none"}, bytes(payload)) != digests[0]
    # another round, sender or weight, or other digests under the same signature: no
    assert not commitment.verify(group[:-1] + b"h", sender.peer_id, 2.0)
    assert not commitment.verify(group, other.peer_id, 2.0)
    assert not commitment.verify(group, sender.peer_id, 2.5)
    swapped = ((commitment.digests[0][0], digests[1] + digests[0]), commitment.digests[1])
    assert not Commitment(commitment.public_key, commitment.signature, swapped).verify(group, sender.peer_id, 2.0)
    # a key that is not the sender's, and a bad signature
    theirs = commit(other, group, 2.0, [(reducer.peer_id, digests[:2])])
    assert not Commitment(theirs.public_key, theirs.signature, theirs.digests).verify(group, sender.peer_id, 2.0)
    assert not Commitment(sender.public_key, b"x" * 64, commitment.digests).verify(group, sender.peer_id, 2.0)
    # the wire form round-trips
    assert Commitment.from_wire(commitment.to_wire()) == commitment


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        [b"k" * 31, b"s" * 64, []],
        [b"k" * 32, b"s" * 63, []],
        [b"k" * 32, b"s" * 64, [[b"r", b"d" * 31]]],
        [b"k" * 32, b"s" * 64, [[b"r"]]],
        [b"k" * 32, b"s" * 64, [[b"r", 7]]],
        [b"k" * 32, b"s" * 64, [[b"r", b"d" * 32 * (commitments.MAX_PARTS + 1)]]],
        [b"k" * 32, b"s" * 64, [[b"r", b""]] * (commitments.MAX_REDUCERS + 1)],
    ],
)
def test_malformed_commitments_are_refused(raw):
    with pytest.raises(ValueError):
        Commitment.from_wire(raw)


def test_a_commitment_is_verified_once_and_only_successes_are_kept(monkeypatch):
    sender = Identity.generate()
    calls = []
    real = commitments.verify_signature

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(commitments, "verify_signature", counted)
    verified = VerifiedSignatures(kept=2)
    good = commit(sender, b"g" * 16, 1.0, [(sender.peer_id, [b"d" * 32])])
    bad = Commitment(good.public_key, b"x" * 64, good.digests)
    for _ in range(3):
        assert good.verify(b"g" * 16, sender.peer_id, 1.0, verified)
        assert not bad.verify(b"g" * 16, sender.peer_id, 1.0, verified)
    assert len(calls) == 1 + 3  # the good one once, the bad one every time
    for group in (b"a" * 16, b"b" * 16):  # two more successes push the first out
        commit(sender, group, 1.0, [(sender.peer_id, [b"d" * 32])]).verify(group, sender.peer_id, 1.0, verified)
    assert good.verify(b"g" * 16, sender.peer_id, 1.0, verified) and len(calls) == 4 + 2 + 1


def test_verified_commitments_hold_a_bounded_share_of_memory():
    """A sender may pad its commitment with shards of reducers that do not exist (a reducer
    checks only its own): the commitments remembered as verified stay within a byte budget, not
    ``VERIFIED_KEPT`` times the largest a header can carry, and the latest are still remembered."""
    sender = Identity.generate()

    def padded(round_number: int) -> tuple[Commitment, bytes]:
        group = round_number.to_bytes(16, "big")
        digests = tuple((bytes([i]) * 34, bytes(1 << 20)) for i in range(4))  # 4 MiB, fresh as received
        signature = sender.sign(commitments.commitment_statement(group, sender.peer_id, 1.0, digests))
        return Commitment(sender.public_key, signature, digests), group

    verified = VerifiedSignatures()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for round_number in range(40):
            commitment, group = padded(round_number)
            assert commitment.verify(group, sender.peer_id, 1.0, verified)
            del commitment
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= commitments.VERIFIED_BYTES + (5 << 20)
    latest, group = padded(39)
    claim = (latest.public_key, latest.signature, group, sender.peer_id.to_bytes(), 1.0, latest.digests)
    assert claim in verified


def test_verified_commitments_count_their_bytes_exactly_across_threads():
    """Checks of large parts verify in worker threads while the reducer verifies on the event
    loop: the byte count that bounds the remembered claims stays exact."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        verified = VerifiedSignatures(kept=64, kept_bytes=1 << 40)

        def add(thread: int) -> None:
            for i in range(20000):
                verified.add((thread, i, ((b"p", b"d" * 32),)))

        threads = [threading.Thread(target=add, args=(thread,)) for thread in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)
    assert verified.bytes == 64 * 33
