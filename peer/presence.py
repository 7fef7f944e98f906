"""How others reach a host beyond its listen address: the relayed addresses it announces while it
cannot be reached directly, the dialer for relayed addresses, and the relay that takes the circuit
ends arriving at its listener.

The host reads this state (its hello and ``public_address`` name the announced addresses; its
listener hands circuit ends to the relay; its dials of relayed addresses go to the dialer); NAT
traversal writes it, through the methods here: ``Relay`` (``peer/relay.py``) registers with
``serve_circuits``, ``RelayClient`` registers its dialer with ``dial_relayed_with`` and keeps the
announced addresses up to date with ``announce``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import trio

from .address import PeerAddress
from .connection_pool import ConnectError

if TYPE_CHECKING:
    from .rpc import Connection

__all__ = ["CircuitRelay", "Presence", "RelayDialer"]

# A stream to run the handshake on, or the connection the peer dialed back (connection reversal).
RelayDialer = Callable[[PeerAddress], Awaitable["trio.abc.Stream | Connection"]]


class CircuitRelay(Protocol):
    """What a host hands the incoming streams that open a relayed circuit's end (``peer/relay.py``)."""

    async def accept_circuit_end(self, stream: trio.SocketStream, token: bytes) -> None: ...


class Presence:
    """A host's announced addresses and relay roles (see the module docstring)."""

    def __init__(self) -> None:
        self._announced: tuple[PeerAddress, ...] = ()
        self._relay: CircuitRelay | None = None
        self._dialer: RelayDialer | None = None

    # ------------------------------------------------------------------ announced addresses
    @property
    def announced(self) -> tuple[PeerAddress, ...]:
        """The relayed addresses announced in place of the listen address (empty: none, the host
        is reached at its listen address, if any)."""
        return self._announced

    def announce(self, addresses: Iterable[PeerAddress]) -> None:
        """Announce ``addresses`` from now on (in hellos and ``public_address``); empty: none."""
        self._announced = tuple(addresses)

    # ------------------------------------------------------------------ relaying for others
    def serve_circuits(self, relay: CircuitRelay) -> None:
        """Hand every incoming circuit end to ``relay`` (once per host)."""
        if self._relay is not None:
            raise ValueError("this host already relays circuits")
        self._relay = relay

    @property
    def relays_circuits(self) -> bool:
        return self._relay is not None

    async def accept_circuit_end(self, stream: trio.SocketStream, token: bytes) -> None:
        """Give an incoming circuit end (its token read) to the relay; only while one is registered."""
        assert self._relay is not None, "the host checks relays_circuits before reading a token"
        await self._relay.accept_circuit_end(stream, token)

    # ------------------------------------------------------------------ dialing relayed addresses
    def dial_relayed_with(self, dialer: RelayDialer) -> None:
        """Dial every relayed address with ``dialer`` (once per host)."""
        if self._dialer is not None:
            raise ValueError("this host already has a relay dialer")
        self._dialer = dialer

    async def dial_relayed(self, address: PeerAddress) -> trio.abc.Stream | Connection:
        """A stream to the peer of the relayed ``address``, ready for the handshake, or the
        connection the peer dialed back."""
        if self._dialer is None:
            raise ConnectError(f"{address}: this peer does not dial through relays")
        return await self._dialer(address)
