"""Signed parts (``averaging/commitments.py``): a signature holds for exactly the part, round,
reducer, sender and weight it was made for."""

from __future__ import annotations

import torch

from averaging.commitments import sign_part, verify_part
from averaging.compression import get_codec
from peer import Identity


def test_a_signature_binds_the_part_as_sent_and_its_context():
    sender, reducer, other = Identity.generate(), Identity.generate(), Identity.generate()
    meta, payload = get_codec("blockwise_8bit").encode(torch.randn(4096))
    payload = bytes(payload)
    group = b"g" * 16
    signature = sign_part(sender, group, reducer.peer_id, 3, 2.0, meta, payload)
    claim = (group, reducer.peer_id, 3, sender.peer_id, 2.0, meta, payload)
    assert verify_part(sender.public_key, signature, *claim)
    tampered = bytearray(payload)
    tampered[-1] ^= 1
    changed = [
        (group[:-1] + b"h", *claim[1:]),
        (group, other.peer_id, *claim[2:]),
        (*claim[:2], 4, *claim[3:]),
        (*claim[:3], other.peer_id, *claim[4:]),
        (*claim[:4], 2.5, *claim[5:]),
        (*claim[:5], {**meta, "codec": "none"}, payload),
        (*claim[:6], bytes(tampered)),
    ]
    for changed_claim in changed:
        assert not verify_part(sender.public_key, signature, *changed_claim)
    # a key that is not the sender's, and malformed keys or signatures, never verify (nor raise)
    assert not verify_part(other.public_key, sign_part(other, *claim[:3], 2.0, meta, payload), *claim)
    for key, sig in ((b"", signature), (sender.public_key, b"x" * 64), (None, signature), (sender.public_key, 7)):
        assert not verify_part(key, sig, *claim)
