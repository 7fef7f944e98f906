"""Peer addresses: ``HOST:PORT`` or ``HOST:PORT/PEERID`` (pinned identity)."""

from __future__ import annotations

from dataclasses import dataclass

from .identity import PeerID

__all__ = ["PeerAddress"]


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int
    peer_id: PeerID | None = None

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Parse ``HOST:PORT[/PEERID]``; IPv6 hosts go in brackets (``[::1]:31337``)."""
        original = text
        peer_id = None
        if "/" in text:
            text, _, peer_text = text.partition("/")
            peer_id = PeerID.from_string(peer_text)
        if text.startswith("["):
            host, sep, port_text = text[1:].partition("]:")
        else:
            host, sep, port_text = text.rpartition(":")
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"bad peer address {original!r}: expected HOST:PORT or HOST:PORT/PEERID")
        return cls(host, int(port_text), peer_id)

    def with_peer_id(self, peer_id: PeerID) -> PeerAddress:
        return PeerAddress(self.host, self.port, peer_id)

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.endpoint if self.peer_id is None else f"{self.endpoint}/{self.peer_id}"
