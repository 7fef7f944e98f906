"""A signature verifier that counts its calls: handed to a ``VerifiedSignatureCache``, it tells a
test how many real Ed25519 verifications the code under test made."""

from __future__ import annotations

import threading

from peer.identity import verify_signature


class CountingVerifier:
    """``verify_signature`` that counts its calls (thread-safe: caches may verify in threads)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, public_key: bytes, signature: bytes, message: bytes) -> bool:
        with self._lock:
            self.calls += 1
        return verify_signature(public_key, signature, message)
