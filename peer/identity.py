"""Peer identity: an Ed25519 key pair on disk and the peer ID derived from it.

The peer ID is a hash of the public key, so nobody can choose it, and the DHT derives its 160-bit
node ID from the same digest: a peer cannot pick its place in the keyspace either.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = ["Identity", "IdentityError", "PeerID", "default_identity_path", "check_key_path"]

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {char: index for index, char in enumerate(_B58_ALPHABET)}
# 160 bits: the Kademlia keyspace size, and plenty against accidental collisions of volunteers.
PEER_ID_BYTES = 20
# 20 bytes in base58 take at most 28 characters; leading zero bytes add one '1' each.
MAX_PEER_ID_TEXT = 40


class IdentityError(Exception):
    """A key file that cannot be used (unsafe permissions, corrupt, wrong type)."""


def _b58encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    chars = []
    while number:
        number, remainder = divmod(number, 58)
        chars.append(_B58_ALPHABET[remainder])
    leading_zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * leading_zeros + "".join(reversed(chars))


def _b58decode(text: str) -> bytes:
    number = 0
    for char in text:
        if char not in _B58_INDEX:
            raise ValueError(f"invalid character {char!r} in peer ID {text!r}")
        number = number * 58 + _B58_INDEX[char]
    leading_zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return b"\0" * leading_zeros + body


class PeerID:
    """A peer's stable name: the first 160 bits of SHA-256 over its Ed25519 public key."""

    __slots__ = ("_digest", "_text")

    def __init__(self, digest: bytes):
        if len(digest) != PEER_ID_BYTES:
            raise ValueError(f"a peer ID has {PEER_ID_BYTES} bytes, got {len(digest)}")
        self._digest = bytes(digest)
        self._text: str | None = None  # base58 on first use: the DHT makes many IDs it never prints

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        return cls(hashlib.sha256(b"peerd-peer-id\0" + public_key).digest()[:PEER_ID_BYTES])

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        # Base58 decoding is quadratic in the text's length and peer IDs arrive in records and
        # addresses from other peers: a 60 KB "ID" would stop the event loop for seconds.
        if len(text) > MAX_PEER_ID_TEXT:
            raise ValueError(f"not a peer ID: {len(text)} characters is longer than any ({MAX_PEER_ID_TEXT})")
        try:
            return cls(_b58decode(text))
        except ValueError as error:
            raise ValueError(f"not a peer ID: {text!r} ({error})") from None

    def to_bytes(self) -> bytes:
        return self._digest

    def to_int(self) -> int:
        return int.from_bytes(self._digest, "big")

    def __str__(self) -> str:
        if self._text is None:
            self._text = _b58encode(self._digest)
        return self._text

    def __repr__(self) -> str:
        return f"PeerID({self})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerID) and other._digest == self._digest

    def __hash__(self) -> int:
        return hash(self._digest)


def default_identity_path() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(data_home) / "peerd" / "identity.key"


def check_key_path(path: str | os.PathLike[str]) -> None:
    """Raise IdentityError for a key path that names a folder: the path is the key file itself."""
    path = Path(path)
    if path.is_dir():
        raise IdentityError(
            f"identity path {path} is a directory, not a key file; name the file itself,"
            f" e.g. --identity {path / 'identity.key'}"
        )


class Identity:
    """An Ed25519 key pair that signs for one peer."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at ``path``, creating it (mode 0600) on first use.

        A key that other users can read is refused rather than silently fixed: the user should
        know their identity may have leaked.
        """
        path = Path(path)
        check_key_path(path)
        if not path.exists():
            identity = cls.generate()
            identity.save(path)
            return identity
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"identity key {path} is accessible by other users (mode {mode:04o}); "
                f"run `chmod 600 {path}` to fix it, or use a new --identity path"
            )
        try:
            private_key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as error:
            raise IdentityError(f"identity key {path} is not a valid PEM private key: {error}") from None
        if not isinstance(private_key, Ed25519PrivateKey):
            raise IdentityError(f"identity key {path} is not an Ed25519 key")
        return cls(private_key)

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # O_EXCL + mode at creation: the key is never readable by others, not even for an instant.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(pem)

    def sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)


# Ed25519's points of small order, as public keys (sign bit cleared, so each point's other
# encoding too; and 0 and 1 written as p and p + 1, which OpenSSL also decodes): a key among them
# has no private key behind it, and its signatures verify for many statements at once (the neutral
# point's one signature, R = the neutral point and s = 0, for every statement), so anyone could
# sign as its peer ID, and a signature would not name one statement. libsodium refuses the same.
_FIELD_PRIME = 2**255 - 19
SMALL_ORDER_KEYS = frozenset(
    [
        (0).to_bytes(32, "little"),  # order 4
        (1).to_bytes(32, "little"),  # the neutral point
        bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),  # order 8
        bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),  # order 8
        (_FIELD_PRIME - 1).to_bytes(32, "little"),  # order 2
        _FIELD_PRIME.to_bytes(32, "little"),  # 0, not reduced
        (_FIELD_PRIME + 1).to_bytes(32, "little"),  # 1, not reduced
    ]
)


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True if ``signature`` is ``public_key``'s Ed25519 signature of ``message``; never raises.
    A small-order key (``SMALL_ORDER_KEYS``) verifies nothing."""
    if isinstance(public_key, bytes) and len(public_key) == 32:
        if public_key[:31] + bytes([public_key[31] & 0x7F]) in SMALL_ORDER_KEYS:
            return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
