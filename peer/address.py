"""Peer addresses: ``HOST:PORT``, ``HOST:PORT/PEERID`` (pinned identity), or a relayed address
``HOST:PORT/RELAYID/relay/PEERID``: the peer PEERID reached through the relay RELAYID listening at
HOST:PORT (``peer/relay.py``). A peer behind NAT announces ``HOST:PORT/RELAYID/relay`` in its hello
(its own ID is known from the handshake)."""

from __future__ import annotations

from dataclasses import dataclass

from .identity import PeerID

__all__ = ["PeerAddress", "Route"]


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int
    peer_id: PeerID | None = None
    relay: PeerID | None = None  # reached through this relay, which listens at host:port

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Parse ``HOST:PORT[/PEERID]`` or ``HOST:PORT/RELAYID/relay[/PEERID]``; IPv6 hosts go in
        brackets (``[::1]:31337``)."""
        original = text
        peer_id = relay = None
        if "/" in text:
            text, _, rest = text.partition("/")
            parts = rest.split("/")
            if len(parts) == 1:
                peer_id = PeerID.from_string(parts[0])
            elif len(parts) in (2, 3) and parts[1] == "relay":
                relay = PeerID.from_string(parts[0])
                peer_id = PeerID.from_string(parts[2]) if len(parts) == 3 else None
            else:
                raise ValueError(
                    f"bad peer address {original!r}: expected HOST:PORT[/PEERID] or HOST:PORT/RELAYID/relay/PEERID"
                )
        if text.startswith("["):
            host, sep, port_text = text[1:].partition("]:")
        else:
            host, sep, port_text = text.rpartition(":")
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"bad peer address {original!r}: expected HOST:PORT or HOST:PORT/PEERID")
        return cls(host, int(port_text), peer_id, relay)

    def with_peer_id(self, peer_id: PeerID) -> PeerAddress:
        return PeerAddress(self.host, self.port, peer_id, self.relay)

    @property
    def relay_address(self) -> PeerAddress:
        """The relay itself (pinned), for a relayed address."""
        assert self.relay is not None
        return PeerAddress(self.host, self.port, self.relay)

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        via = "" if self.relay is None else f"/{self.relay}/relay"
        return self.endpoint + via if self.peer_id is None else f"{self.endpoint}{via}/{self.peer_id}"


@dataclass(frozen=True)
class Route:
    """How a connection reaches its peer: ``relayed_via``, the relay it runs through (None: a
    direct connection), and ``seen_from``, the far end's ``(host, port)`` as our transport sees
    it (None when relayed: the stream ends at the relay)."""

    relayed_via: PeerID | None = None
    seen_from: tuple[str, int] | None = None
