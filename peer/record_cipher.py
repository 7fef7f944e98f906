"""The AEAD of a secure channel's transport records, one instance per direction.

The keys and nonce format are those Noise's ``Split()`` produces (AES-GCM, nonce = 4 zero bytes +
64-bit big-endian counter, no associated data); the channel (``peer/secure_channel.py``) holds one
per direction and is the only one to call it, so records are sealed and opened in the order they
travel, and a replayed, dropped or reordered record fails authentication.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .framing import AEAD_TAG_SIZE, HEADER, ProtocolError

__all__ = ["TransportCipher"]

_NONCE_PREFIX = b"\0\0\0\0"
_COUNTER = struct.Struct(">Q")


class TransportCipher:
    """AES-GCM with Noise's counter nonces, one instance per direction."""

    __slots__ = ("_aead", "_counter")

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._counter = 0

    # Each method makes its nonce inline (the counter, then one step on) rather than calling a
    # helper: these run once per record, and ``SecureChannel`` calls them through its own methods.
    def seal_into(self, plaintext, out: memoryview) -> int:
        """Write one record (length header + ciphertext) to ``out``; return its size."""
        size = len(plaintext) + AEAD_TAG_SIZE
        HEADER.pack_into(out, 0, size)
        nonce = _NONCE_PREFIX + _COUNTER.pack(self._counter)
        self._counter += 1
        self._aead.encrypt_into(nonce, plaintext, None, out[HEADER.size : HEADER.size + size])
        return HEADER.size + size

    def open(self, record) -> bytes:
        nonce = _NONCE_PREFIX + _COUNTER.pack(self._counter)
        self._counter += 1
        try:
            return self._aead.decrypt(nonce, record, None)
        except InvalidTag:
            raise ProtocolError("record failed authentication (tampered or out of order)") from None

    def open_into(self, record, out: memoryview) -> int:
        size = len(record) - AEAD_TAG_SIZE
        if size < 0 or size > len(out):
            raise ProtocolError("record does not fit the announced payload")
        nonce = _NONCE_PREFIX + _COUNTER.pack(self._counter)
        self._counter += 1
        try:
            self._aead.decrypt_into(nonce, record, None, out[:size])
        except InvalidTag:
            raise ProtocolError("record failed authentication (tampered or out of order)") from None
        return size
