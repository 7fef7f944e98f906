import os
import stat

import pytest

from peer import Identity, IdentityError, PeerAddress, PeerID


def test_key_created_with_owner_only_mode_and_reloaded(tmp_path):
    path = tmp_path / "sub" / "id.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert again.public_key == first.public_key


def test_key_readable_by_others_is_refused_with_fix(tmp_path):
    path = tmp_path / "id.key"
    Identity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match=r"chmod 600"):
        Identity.load_or_create(path)


def test_corrupt_key_is_refused(tmp_path):
    path = tmp_path / "id.key"
    path.write_bytes(b"not a key")
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not a valid"):
        Identity.load_or_create(path)


def test_peer_id_text_round_trip_and_derivation():
    identity = Identity.generate()
    text = str(identity.peer_id)
    assert 20 <= len(text) <= 28
    assert PeerID.from_string(text) == identity.peer_id
    assert PeerID.from_public_key(identity.public_key) == identity.peer_id
    assert identity.peer_id != Identity.generate().peer_id
    with pytest.raises(ValueError):
        PeerID.from_string("0OIl")  # not base58


def test_addresses_parse_with_and_without_pin():
    identity = Identity.generate()
    plain = PeerAddress.parse("127.0.0.1:31337")
    assert (plain.host, plain.port, plain.peer_id) == ("127.0.0.1", 31337, None)
    pinned = PeerAddress.parse(f"example.org:1/{identity.peer_id}")
    assert pinned.peer_id == identity.peer_id
    assert str(pinned) == f"example.org:1/{identity.peer_id}"
    assert PeerAddress.parse("[::1]:5").host == "::1"
    for bad in ("nohost", "host:", "host:99999", ":80", "h:1/notbase58!"):
        with pytest.raises(ValueError):
            PeerAddress.parse(bad)


def test_a_small_order_key_verifies_no_signature():
    """Such a key has no private key behind it: the neutral point's one signature (R = the neutral
    point, s = 0) verified for every statement under it, and for a share of statements under each
    other small-order key, so anyone could sign as its peer ID; OpenSSL accepts them all, also
    with the sign bit set and 0 and 1 not reduced."""
    from peer.identity import SMALL_ORDER_KEYS, verify_signature

    signature = (1).to_bytes(32, "little") + bytes(32)
    assert len(SMALL_ORDER_KEYS) == 7
    for key in SMALL_ORDER_KEYS:
        for encoding in (key, key[:31] + bytes([key[31] | 0x80])):
            assert not any(verify_signature(encoding, signature, os.urandom(16)) for _ in range(64))
    identity = Identity.generate()
    assert verify_signature(identity.public_key, identity.sign(b"statement"), b"statement")
    assert not verify_signature(identity.public_key, signature, b"statement")
