"""The NATs of a simulated internet: which hosts sit behind one, the public address each is seen
at, and which unsolicited connections a NAT lets in. Plain bookkeeping, no I/O: the network
(``network.py``) asks it where a SYN goes.

Each host behind NAT has a home router of its own with one public address (``198.18.x.y``),
and behaves as most do:
- **port preserving**: a connection from the host's port P leaves from the public port P, so the
  far end sees ``(public, P)``;
- **address-dependent filtering**: a SYN from outside to public port P gets in only if the host
  sent from P to that remote host within ``MAPPING_S`` (what hole punching's simultaneous open
  relies on); any other is dropped without an answer, as a home router drops an unsolicited SYN;
- a host's private address means nothing outside its home: a SYN to it from another host goes
  nowhere.
"""

from __future__ import annotations

__all__ = ["SimNats", "MAPPING_S"]

# How long a NAT keeps a mapping that an outgoing SYN opened (a home router's timeout for a
# connection attempt that was not answered yet; tens of seconds to minutes).
MAPPING_S = 60.0


class SimNats:
    """Hosts behind NAT, their public addresses and the mappings their outgoing SYNs opened."""

    def __init__(self) -> None:
        self.public_of: dict[str, str] = {}  # a host behind NAT -> its router's public address
        self.behind: dict[str, str] = {}  # a public address -> the host behind it
        # per host behind NAT: (its port, remote host) -> until when the mapping lets that remote in
        self._mappings: dict[str, dict[tuple[int, str], float]] = {}

    def add(self, host: str) -> str:
        """Put ``host`` behind a NAT of its own; returns the NAT's public address."""
        number = len(self.public_of) + 1
        public = f"198.{18 + (number >> 16)}.{(number >> 8) & 255}.{number & 255}"
        self.public_of[host] = public
        self.behind[public] = host
        self._mappings[host] = {}
        return public

    def seen_as(self, host: str) -> str:
        """The address others see ``host``'s connections come from."""
        return self.public_of.get(host, host)

    def machine(self, address: str, source: str) -> str | None:
        """The host a SYN from ``source`` to ``address`` reaches (for a NAT's public address, the
        host behind it), or None where it goes nowhere (a private address of another home)."""
        if address in self.behind:
            return self.behind[address]
        if address in self.public_of and address != source:
            return None
        return address

    def opened(self, host: str, port: int, remote: str, now: float) -> None:
        """``host`` sent a SYN from ``port`` to ``remote``: its NAT (if any) lets ``remote`` in at
        that port for ``MAPPING_S``."""
        mappings = self._mappings.get(host)
        if mappings is None:
            return
        for key in [key for key, until in mappings.items() if until <= now]:
            del mappings[key]  # (expired: the table holds what the last MAPPING_S opened)
        mappings[(port, remote)] = now + MAPPING_S

    def mappings(self, host: str) -> int:
        """How many mappings ``host``'s NAT holds (expired ones go at its next outgoing SYN)."""
        return len(self._mappings.get(host, ()))

    def admits(self, host: str, port: int, remote: str, now: float) -> bool:
        """Whether a SYN from ``remote`` to ``host``'s port gets through ``host``'s NAT (a host
        with none admits everything)."""
        mappings = self._mappings.get(host)
        if mappings is None:
            return True
        return mappings.get((port, remote), 0.0) > now
