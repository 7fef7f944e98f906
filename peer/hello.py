"""The hello each side sends once the Noise handshake has authenticated it, and the errors a
handshake ends with. A hello names the protocol version, the run, the advertised addresses and the
node-ID proof; ``check_hello`` refuses a peer whose version, run or node-ID difficulty differs from
ours, or whose nonce does not solve the node-ID puzzle for its authenticated peer ID. In a private
swarm a refused peer gets ``{"refused": reason}`` in place of the hello.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .address import PeerAddress
from .identity import PeerID
from .node_id import LOCAL_DIFFICULTY, MAX_DIFFICULTY, NONCE_BYTES, NodeIDProof
from .packing import packb, unpackb

__all__ = [
    "AccessRefused",
    "HandshakeError",
    "Hello",
    "HelloMismatch",
    "NodeIDRefused",
    "PeerIDMismatch",
    "check_hello",
    "MAX_HANDSHAKE_MESSAGE",
]

# Noise handshake messages here are < 200 bytes; anything much larger is not a peerd peer.
MAX_HANDSHAKE_MESSAGE = 4096


class HandshakeError(Exception):
    """The peer could not be authenticated or does not speak our protocol/run."""


class PeerIDMismatch(HandshakeError):
    """The peer proved an identity other than the one the address pins: ``actual``."""

    def __init__(self, message: str, actual: PeerID):
        super().__init__(message)
        self.actual = actual


class HelloMismatch(HandshakeError):
    pass


class AccessRefused(HandshakeError):
    """A private swarm's allowlist does not admit the peer (ours, or the other side's for us)."""


class NodeIDRefused(HandshakeError):
    """The peer's node-ID nonce does not solve the puzzle at this run's difficulty."""


@dataclass(frozen=True)
class Hello:
    protocol: int
    run_id: str
    client_mode: bool = False
    listen_addresses: tuple[str, ...] = field(default_factory=tuple)
    # Required: a hand-made hello without a solved nonce would be refused by every peer anyway.
    node_id_nonce: bytes = field(kw_only=True)
    node_id_difficulty: int = field(default=LOCAL_DIFFICULTY, kw_only=True)

    def listen_address(self, peer_id: PeerID, seen_host: Callable[[], str | None]) -> PeerAddress | None:
        """Where ``peer_id``, which sent this hello, accepts connections (None for a client-mode
        peer or an unreadable address). An advertised wildcard host (0.0.0.0, ::) is replaced by
        ``seen_host()``, the address we see the peer connecting from."""
        if self.client_mode or not self.listen_addresses:
            return None
        try:
            advertised = PeerAddress.parse(self.listen_addresses[0])
        except ValueError:
            return None
        host = advertised.host if advertised.host not in ("0.0.0.0", "::", "") else seen_host()
        return None if host is None else PeerAddress(host, advertised.port, peer_id, advertised.relay)

    def encode(self) -> bytes:
        return packb(
            {
                "protocol": self.protocol,
                "run_id": self.run_id,
                "client_mode": self.client_mode,
                "listen": list(self.listen_addresses),
                "node_nonce": self.node_id_nonce,
                "node_difficulty": self.node_id_difficulty,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Hello:
        """The peer's hello; raises AccessRefused if it sent a private swarm's refusal instead."""
        try:
            fields = unpackb(data, max_size=MAX_HANDSHAKE_MESSAGE)
            refused = fields.get("refused") if isinstance(fields, dict) else None
        except Exception:
            refused = None
        if isinstance(refused, str):
            raise AccessRefused(f"the peer refused this connection: {refused[:300]}")
        try:
            protocol, run_id = fields["protocol"], fields["run_id"]
            client_mode = fields.get("client_mode", False)
            listen = fields.get("listen", [])
            # Absent in a version-1 hello: the version check then reports what differs.
            nonce = fields.get("node_nonce", bytes(NONCE_BYTES))
            difficulty = fields.get("node_difficulty", 0)
            valid = (
                type(protocol) is int
                and isinstance(run_id, str)
                and isinstance(client_mode, bool)
                and isinstance(listen, list)
                and len(listen) <= 8
                and all(isinstance(a, str) and len(a) < 300 for a in listen)
                and isinstance(nonce, bytes)
                and len(nonce) == NONCE_BYTES
                and type(difficulty) is int
                and 0 <= difficulty <= MAX_DIFFICULTY
            )
        except Exception:
            valid = False
        if not valid:
            raise HandshakeError("malformed hello from peer")
        return cls(protocol, run_id, client_mode, tuple(listen), node_id_nonce=nonce, node_id_difficulty=difficulty)


def check_hello(ours: Hello, theirs: Hello, remote: PeerID) -> None:
    if theirs.protocol != ours.protocol:
        raise HelloMismatch(
            f"protocol version mismatch with peer {remote}: we speak version {ours.protocol}, "
            f"it speaks version {theirs.protocol}"
        )
    if theirs.run_id != ours.run_id:
        raise HelloMismatch(
            f"run ID mismatch with peer {remote}: we are in run {ours.run_id!r}, it is in run {theirs.run_id!r}"
        )
    if theirs.node_id_difficulty != ours.node_id_difficulty:
        raise HelloMismatch(
            f"node-ID difficulty mismatch with peer {remote}: this run requires difficulty "
            f"{ours.node_id_difficulty}, the peer requires {theirs.node_id_difficulty} "
            "(every peer of a run must use the same --node-id-difficulty)"
        )
    proof = NodeIDProof(remote, theirs.node_id_nonce)
    if not proof.satisfies(ours.node_id_difficulty):
        raise NodeIDRefused(
            f"peer {remote} sent a node-ID proof with {proof.work_bits} bits of work; "
            f"this run requires {ours.node_id_difficulty}"
        )
