"""A peer's NAT traversal as one component: it answers dial-back requests, relays for others
(unless told not to), checks its own reachability, and behind NAT keeps relay reservations and
announces relayed addresses; with no relay to be had it falls back to client mode, saying why.
Every relayed connection it dials is then upgraded to a direct one by hole punching if it can be.

Pieces: ``peer/reachability.py`` (dial-back), ``peer/relay.py`` (relays and reservations),
``peer/holepunch.py`` (simultaneous open).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from .address import PeerAddress
from .holepunch import HolePuncher
from .host import ConnectError, PeerHost
from .nat_state import NAT, PUBLIC, UNKNOWN, RelayLimits
from .reachability import Reachability, ReachabilityService, check_reachability
from .relay import Relay, RelayClient
from .router import Request
from .rpc_errors import BadRequest, RPCError

__all__ = ["NatTraversal", "ADDRESSES", "relay_limits"]

log = logging.getLogger("peerd.nat")

ADDRESSES = "nat.addresses"  # a peer tells its connections where it is reached now
RECHECK_UNKNOWN = 5.0
RECHECK_KNOWN = 300.0
RELAY_GRACE = 15.0  # behind NAT: how long to look for a relay before falling back to client mode
MAX_ANNOUNCED = 4
MAX_LISTED_PEERS = 64  # connections named on the status page


def relay_limits(total_mib_per_s: float) -> RelayLimits:
    """The relay's default limits with all circuits together held to ``total_mib_per_s``; one
    circuit never gets more than the total."""
    total = total_mib_per_s * 2**20
    defaults = RelayLimits()
    return RelayLimits(
        circuit_bytes_per_s=min(defaults.circuit_bytes_per_s, total),
        circuit_burst_bytes=min(defaults.circuit_burst_bytes, total / 4),
        total_bytes_per_s=total,
        total_burst_bytes=min(defaults.total_burst_bytes, total / 4),
    )


class NatTraversal:
    """Run with ``await nat.run()`` in the host's lifetime; ``status()`` for the status page."""

    def __init__(
        self,
        host: PeerHost,
        *,
        relay: bool = True,
        limits: RelayLimits | None = None,
        initial_peers: list[PeerAddress] | None = None,
    ):
        self.host = host
        host.service(ReachabilityService)
        self.relay = Relay(host, limits) if relay and not host.client_mode else None

        self.client = RelayClient(
            host,
            reachable=lambda: self.reachability.status == PUBLIC,
            observed_host=lambda: self.reachability.observed[0] if self.reachability.observed else None,
        )
        self.puncher = HolePuncher(host, lambda: self.reachability.observed[0] if self.reachability.observed else None)
        self.initial_peers = list(initial_peers or [])
        self.reachability = Reachability(UNKNOWN, None, 0, "not checked yet")
        self.fallback_client_mode = False
        host.router.add_unary(ADDRESSES, self._addresses)

    async def _addresses(self, request: Request) -> Any:
        """The caller's new announced addresses replace those of its hello on this connection."""
        connection = request.connection
        listen = request.body
        if (
            connection is None
            or not isinstance(listen, list)
            or len(listen) > MAX_ANNOUNCED
            or not all(isinstance(a, str) and len(a) < 300 for a in listen)
        ):
            raise BadRequest("expected a list of at most 4 address strings")
        for text in listen:
            try:
                PeerAddress.parse(text)
            except ValueError as error:
                raise BadRequest(str(error)) from None
        connection.remote_moved(tuple(listen))
        # and on the connection our pool hands out for the caller, if another: what we read of the
        # caller (its DHT contact, our dial-back servers) comes from that one
        pooled = self.host.connection_to(request.peer)
        if pooled is not None and pooled is not connection:
            pooled.remote_moved(tuple(listen))
        return None

    def servers(self) -> list[PeerAddress]:
        """Peers that may dial us back or relay for us: the initial peers and every connected peer
        that announced a direct address."""
        found: dict[str, PeerAddress] = {str(a): a for a in self.initial_peers}
        for peer in self.host.connected_peers:
            connection = self.host.connection_to(peer)
            address = connection.remote_listen_address if connection is not None else None
            if address is not None and address.relay is None and connection.relayed_via is None:
                found.setdefault(address.endpoint, address)
        return list(found.values())

    def status(self) -> dict[str, Any]:
        status = self.reachability.as_dict()
        status["relayed_addresses"] = [str(a) for a in self.host.presence.announced]
        status["client_mode_fallback"] = self.fallback_client_mode
        if self.relay is not None:
            status["relaying"] = {
                "reservations": len(self.relay.book.reservations),
                "circuits": self.relay.book.circuits,
                "bytes": self.relay.bytes_relayed,
            }
        relayed = direct = 0
        peers = []
        for peer in self.host.connected_peers:
            connection = self.host.connection_to(peer)
            if connection is None:
                continue
            relayed += connection.relayed_via is not None
            direct += connection.relayed_via is None
            if len(peers) < MAX_LISTED_PEERS:
                peers.append({"peer": str(peer), "via": _via(connection)})
        status["connections"] = {"direct": direct, "relayed": relayed, "peers": peers}
        status["hole_punching"] = self.puncher.status()
        return status

    async def run(self) -> None:
        if self.host.listen_address is None:
            self.reachability = Reachability(UNKNOWN, None, 0, "client mode: not listening")
            return
        async with trio.open_nursery() as nursery:
            reserving = False
            while True:
                result = await check_reachability(self.host, self.servers())
                if result.status != self.reachability.status or result.observed != self.reachability.observed:
                    log.info("reachability: %s (%s); seen as %s", result.status, result.reason, result.observed)
                # one verdict of "unknown" (too few answers) does not undo an earlier definite one
                if result.status != UNKNOWN or self.reachability.status == UNKNOWN:
                    self.reachability = result
                if self.relay is not None:
                    # behind NAT we are no use as a relay: take no reservations and forget those
                    # taken while our reachability was unknown (their holders move on at renewal)
                    self.relay.accept_reservations(self.reachability.status != NAT)
                if self.reachability.status == NAT and not reserving:
                    reserving = True
                    nursery.start_soon(self.client.run, self.servers)
                    nursery.start_soon(self._push_addresses)
                    nursery.start_soon(self._fall_back_without_relay)
                await trio.sleep(RECHECK_UNKNOWN if self.reachability.status == UNKNOWN else RECHECK_KNOWN)

    async def _fall_back_without_relay(self) -> None:
        """Behind NAT with no reservation: client mode (nobody could reach our address anyway)."""
        await trio.sleep(RELAY_GRACE)
        while True:
            announced = self.host.presence.announced
            if not announced and not self.fallback_client_mode:
                self.fallback_client_mode = self.host.client_mode = True
                log.warning(
                    "this peer cannot be reached (%s) and no relay accepted a reservation: "
                    "running in client mode (it sends requests but serves none) until a relay is found",
                    self.reachability.reason,
                )
            elif announced and self.fallback_client_mode:
                self.fallback_client_mode = self.host.client_mode = False
                log.info("reachable through relays again: %s", ", ".join(map(str, announced)))
            await self.client.changed.wait()

    async def _push_addresses(self) -> None:
        """Tell every connected peer our announced addresses whenever they change."""
        limiter = trio.CapacityLimiter(16)
        while True:
            await self.client.changed.wait()
            listen = [str(address) for address in self.host.presence.announced[:MAX_ANNOUNCED]]
            with trio.move_on_after(30):
                async with trio.open_nursery() as nursery:
                    for peer in self.host.connected_peers:
                        nursery.start_soon(self._tell, peer, listen, limiter)

    async def _tell(self, peer, listen: list[str], limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            connection = self.host.connection_to(peer)
            if connection is None:
                return
            try:
                await connection.call(ADDRESSES, listen, timeout=5)
            except (RPCError, ConnectError, trio.TooSlowError) as error:
                log.debug("could not tell %s our addresses: %s", peer, error)


def _via(connection) -> str:
    """``relay RELAYID`` or the remote endpoint of a direct connection."""
    if connection.relayed_via is not None:
        return f"relay {connection.relayed_via}"
    if connection.seen_from is None:
        return "?"
    host, port = connection.seen_from
    return f"{host}:{port}"


__all__ += ["PUBLIC", "NAT", "UNKNOWN"]
