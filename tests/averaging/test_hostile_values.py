"""Numbers other peers claim (bandwidths, epochs, rounds, versions) are bounded where they are
parsed: the largest values msgpack can carry used to overflow our own arithmetic and packing."""

from __future__ import annotations

import pytest

from averaging.group import MAX_BANDWIDTH, MAX_COUNTER, GroupMember
from averaging.matchmaking import Declaration
from averaging.partition import split_by_bandwidth
from averaging.progress import PeerProgress
from averaging.state_sharing import DonorOffer
from peer import LOCAL_DIFFICULTY, Identity, NodeIDProof, PeerAddress

HUGE = 2**64 - 1  # a valid msgpack uint64: what a hostile peer sends


def member_wire(peer_id, bandwidth) -> list:
    return [peer_id.to_bytes(), str(PeerAddress("127.0.0.1", 1, peer_id)), bandwidth, "node"]


def test_a_bandwidth_that_overflows_the_shard_arithmetic_is_refused() -> None:
    peer_id = Identity.generate().peer_id
    assert GroupMember.from_wire(member_wire(peer_id, MAX_BANDWIDTH)).bandwidth == MAX_BANDWIDTH
    with pytest.raises(ValueError, match="bandwidth"):
        GroupMember.from_wire(member_wire(peer_id, 1e308))


def test_shard_sizes_survive_extreme_bandwidth_ratios() -> None:
    """total * bandwidth overflowed to inf (then int(inf) raised) before the split normalised."""
    assert split_by_bandwidth(1000, [1.0, 1e308]) == [0, 1000]
    assert sum(split_by_bandwidth(10**9, [MAX_BANDWIDTH, 1.0, 3.0])) == 10**9


def test_counters_past_the_bound_are_malformed_records() -> None:
    peer_id = Identity.generate().peer_id
    address = str(PeerAddress("127.0.0.1", 1, peer_id))
    declaration = {"address": address, "bandwidth": 1.0, "mode": "node", "schema": "s", "round": MAX_COUNTER}
    assert Declaration.from_wire(peer_id, declaration).round == MAX_COUNTER
    with pytest.raises(ValueError):
        Declaration.from_wire(peer_id, {**declaration, "round": HUGE})
    assert PeerProgress.from_wire({"epoch": MAX_COUNTER, "samples": 1, "sps": 1.0}).epoch == MAX_COUNTER
    for field in ("epoch", "samples"):
        with pytest.raises(ValueError):
            PeerProgress.from_wire({"epoch": 1, "samples": 1, "sps": 1.0, field: HUGE})
    nonce = NodeIDProof.solve(peer_id, LOCAL_DIFFICULTY).nonce
    with pytest.raises(ValueError):
        DonorOffer.from_wire(peer_id, {"address": address, "version": HUGE, "nonce": nonce}, LOCAL_DIFFICULTY)
    assert (
        DonorOffer.from_wire(peer_id, {"address": address, "version": 3, "nonce": nonce}, LOCAL_DIFFICULTY).version == 3
    )
