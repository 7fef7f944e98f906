"""Private swarms: who may connect at all, decided at the handshake.

A public swarm admits anyone (``README.md``, "Security model"). A run that wants only known
volunteers sets either or both of:

- an allowlist of peer IDs: after the Noise handshake has authenticated the other side, a peer not
  on the list is refused, and told so in one encrypted record instead of its hello, so the refused
  peer sees why (``secure_channel.py``);
- a shared swarm key: HMAC-SHA256(key, the protocol's prologue) is mixed into the Noise prologue.
  The prologue is hashed into the handshake transcript and never sent, so the key never crosses
  the wire, and a peer without it fails the handshake at the first authenticated message (the
  responder's identity payload), before either side has learned anything but ephemeral keys.
  Only an active peer can test a guess, one connection per guess; a key from ``os.urandom``
  (``peerd keygen --swarm-key``-style files of 32 random bytes) is beyond guessing.

The key gates the whole swarm with one secret (anyone who has it may join under any identity); the
allowlist names identities (each volunteer's peer ID must be added). Both together: only listed
identities, and only those that also hold the key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .identity import PeerID

__all__ = ["SwarmAccess", "MIN_SWARM_KEY_BYTES", "read_allowlist", "read_swarm_key"]

# 16 bytes (128 bits) is the least a key must hold to be beyond guessing, online or not.
MIN_SWARM_KEY_BYTES = 16
# An allowlist names volunteers, not the internet; a bound keeps a wrong file from eating memory.
MAX_ALLOWLIST = 100_000


@dataclass(frozen=True)
class SwarmAccess:
    """Who may connect: ``allowed`` peer IDs (None: anyone) holding ``swarm_key`` (None: none needed)."""

    allowed: frozenset[PeerID] | None = None
    swarm_key: bytes | None = None

    def __post_init__(self) -> None:
        if self.swarm_key is not None and len(self.swarm_key) < MIN_SWARM_KEY_BYTES:
            raise ValueError(f"a swarm key needs at least {MIN_SWARM_KEY_BYTES} bytes")

    @classmethod
    def of(cls, allowed: Iterable[PeerID] | None = None, swarm_key: bytes | None = None) -> SwarmAccess:
        return cls(None if allowed is None else frozenset(allowed), swarm_key)

    @property
    def private(self) -> bool:
        return self.allowed is not None or self.swarm_key is not None

    def prologue(self, base: bytes) -> bytes:
        """The Noise prologue: ``base``, with the key's HMAC over it when the swarm has a key."""
        if self.swarm_key is None:
            return base
        return base + b"/swarm-key/" + hmac.new(self.swarm_key, base, hashlib.sha256).digest()

    def refusal(self, peer: PeerID) -> str | None:
        """Why ``peer`` may not connect, or None if it may."""
        if self.allowed is not None and peer not in self.allowed:
            return f"peer {peer} is not on this private swarm's allowlist"
        return None


def read_allowlist(path: str | Path) -> frozenset[PeerID]:
    """Peer IDs, one per line; blank lines and ``#`` comments are skipped. Raises ValueError naming
    the line of anything that is not a peer ID."""
    allowed = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            allowed.add(PeerID.from_string(text))
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not a peer ID ({error})") from None
        if len(allowed) > MAX_ALLOWLIST:
            raise ValueError(f"{path}: more than {MAX_ALLOWLIST} peer IDs")
    if not allowed:
        raise ValueError(f"{path}: no peer IDs (a private swarm that admits nobody)")
    return frozenset(allowed)


def read_swarm_key(path: str | Path) -> bytes:
    """The key file's bytes (surrounding whitespace stripped, so a text key may end in a newline)."""
    key = Path(path).read_bytes().strip()
    if len(key) < MIN_SWARM_KEY_BYTES:
        raise ValueError(f"{path}: a swarm key needs at least {MIN_SWARM_KEY_BYTES} bytes, it has {len(key)}")
    return key
