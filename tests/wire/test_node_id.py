"""Node-ID puzzles: solving costs 2**difficulty hashes on average, checking costs one."""

from __future__ import annotations

import time

import pytest

from peer import Identity
from peer.node_id import NONCE_BYTES, NodeIDProof, load_or_solve, proof_path


def test_a_solution_satisfies_its_difficulty_and_is_checked_from_the_nonce_alone() -> None:
    peer_id = Identity.generate().peer_id
    proof = NodeIDProof.solve(peer_id, 12)
    again = NodeIDProof(peer_id, proof.nonce)
    assert again.satisfies(12) and again.node_id == proof.node_id
    assert again.node_id != peer_id.to_bytes() and len(again.node_id) == 20
    other = NodeIDProof(Identity.generate().peer_id, proof.nonce)  # someone else's nonce
    assert other.node_id != proof.node_id


def test_an_unsolved_nonce_is_refused_at_a_real_difficulty() -> None:
    peer_id = Identity.generate().peer_id
    # 2**-16 of random nonces pass 16 bits: among 64 consecutive ones, almost surely none does.
    passing = [n for n in range(64) if NodeIDProof(peer_id, n.to_bytes(NONCE_BYTES, "little")).satisfies(16)]
    assert len(passing) <= 1
    with pytest.raises(ValueError):
        NodeIDProof(peer_id, b"short")


def test_solving_costs_work_that_grows_with_difficulty_and_checking_is_cheap() -> None:
    """What the price is made of: 2**d tries on average, so the mean nonce index over many solves
    tracks 2**d; a check is one hash."""
    identities = [Identity.generate().peer_id for _ in range(40)]
    mean_tries = {}
    for bits in (4, 10):
        tries = [int.from_bytes(NodeIDProof.solve(p, bits).nonce, "little") + 1 for p in identities]
        mean_tries[bits] = sum(tries) / len(tries)
    assert 2**4 / 3 < mean_tries[4] < 2**4 * 3
    assert 2**10 / 3 < mean_tries[10] < 2**10 * 3
    proof = NodeIDProof.solve(identities[0], 10)
    started = time.perf_counter()
    for _ in range(1000):
        NodeIDProof(identities[0], proof.nonce).satisfies(10)
    assert (time.perf_counter() - started) / 1000 < 1e-3  # far below a millisecond per check (~2 us)


def test_the_solution_is_stored_beside_the_key_and_reused(tmp_path) -> None:
    key = tmp_path / "id.key"
    identity = Identity.load_or_create(key)
    first = load_or_solve(key, identity.peer_id, 10)
    assert proof_path(key).exists()
    assert load_or_solve(key, identity.peer_id, 10).nonce == first.nonce  # read back, not re-solved
    assert load_or_solve(key, identity.peer_id, 2).nonce == first.nonce  # more work than needed is fine
    stronger = load_or_solve(key, identity.peer_id, first.work_bits + 1)  # not enough: solved again
    assert stronger.satisfies(first.work_bits + 1)
    proof_path(key).write_text("{not json")
    assert load_or_solve(key, identity.peer_id, 4).satisfies(4)  # a damaged file is replaced
    stranger = Identity.generate().peer_id
    assert load_or_solve(key, stranger, 4).peer_id == stranger  # another key's file is not trusted
