"""Reachability: whether other peers can dial us, and the address they see us at (as libp2p's AutoNAT).

A peer calls ``nat.dialback {port}`` on a few public peers. Each dials a fresh connection to the
address it sees the call coming from, at the port the caller names (its listen port), and runs the
handshake pinned to the caller's peer ID; it answers whether that worked and the observed
``[host, port]`` of the calling connection. One success proves we are reachable (nobody else can
complete a handshake with our key), once the caller has seen that peer's connection arrive (an
answer alone is a claim); failures from two distinct peers and no success mean a NAT or a
firewall is in the way.

The dial-back goes only to the caller's observed address, never to one it names, and is rate
limited per endpoint and in total (``DialBackLimiter``), so nobody can use us to dial third parties
or to hammer one host. A call over a relayed connection is refused: its observed address is the
relay's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from .address import PeerAddress
from .admission import address_group
from .host import ConnectError, PeerHost
from .identity import PeerID
from .nat_state import NAT, PUBLIC, UNKNOWN, DialBackLimiter, most_common, reachability_verdict
from .router import Request
from .rpc_errors import BadRequest, Busy, RPCError
from .secure_channel import secure_handshake

__all__ = ["DIALBACK", "Reachability", "ReachabilityService", "check_reachability", "PUBLIC", "NAT", "UNKNOWN"]

log = logging.getLogger("peerd.reachability")

DIALBACK = "nat.dialback"
DIALBACK_TIMEOUT = 5.0  # the dial and the handshake; the caller waits a little longer
# After "reachable": how long the caller waits for that peer's dial-back connection to show up
# (its handshake ends on the server before the answer is sent, but the two travel apart).
DIALBACK_EVIDENCE = 2.0


@dataclass(frozen=True)
class Reachability:
    status: str  # PUBLIC, NAT or UNKNOWN
    observed: tuple[str, int] | None  # how peers see our connections' source (host, port)
    answers: int  # how many peers answered
    reason: str  # in words, for logs and the status page

    def as_dict(self) -> dict[str, Any]:
        observed = f"{self.observed[0]}:{self.observed[1]}" if self.observed else None
        return {"status": self.status, "observed_address": observed, "answers": self.answers, "reason": self.reason}


class ReachabilityService:
    """Answers other peers' dial-back requests (``host.service(ReachabilityService)``)."""

    def __init__(self, host: PeerHost):
        self.host = host
        self.limiter = DialBackLimiter(trio.current_time())
        host.router.add_unary(DIALBACK, self._dialback)

    async def _dialback(self, request: Request) -> Any:
        connection = request.connection
        if connection is None or connection.relayed_via is not None:
            raise BadRequest("a dial-back needs a direct connection")
        if connection.seen_from is None:
            raise BadRequest("cannot tell this connection's remote address")
        observed_host, observed_port = connection.seen_from
        port = request.body.get("port") if isinstance(request.body, dict) else None
        if type(port) is not int or not 0 < port < 65536:
            raise BadRequest("expected {port: 1..65535}")
        endpoint = f"{observed_host}:{port}"
        why_not = self.limiter.start(endpoint, trio.current_time(), group=address_group(observed_host))
        if why_not is not None:
            raise Busy(why_not)
        try:
            reachable, reason = await self._probe(PeerAddress(observed_host, port, request.peer))
        finally:
            self.limiter.finished(endpoint)
        return {"reachable": reachable, "observed": [observed_host, observed_port], "reason": reason}

    async def _probe(self, address: PeerAddress) -> tuple[bool, str]:
        host = self.host
        with trio.move_on_after(DIALBACK_TIMEOUT):
            try:
                stream = await host.open_stream(address)
            except ConnectError as error:
                return False, str(error)
            try:
                channel = await secure_handshake(
                    stream,
                    host.identity,
                    host.hello(),
                    initiator=True,
                    expected_peer=address.peer_id,
                    timeout=DIALBACK_TIMEOUT,
                    access=host.access,
                )
            except Exception as error:
                await trio.aclose_forcefully(stream)
                return False, f"{address}: handshake failed ({error!r})"
            await channel.aclose()
            return True, "dialed back"
        return False, f"{address}: no answer within {DIALBACK_TIMEOUT} s"


async def check_reachability(
    host: PeerHost,
    servers: list[PeerAddress],
    *,
    port: int | None = None,
    max_servers: int = 3,
    max_batches: int = 3,
) -> Reachability:
    """Ask ``servers`` (public peers, not relayed), ``max_servers`` at once, to dial us back at
    ``port`` (default: our listen port); the next ones (up to ``max_batches`` batches) while the
    answers give no verdict. A peer named by several addresses answers once: the
    verdict's failures must come from distinct peers, so one liar cannot make it ``nat``."""
    if port is None:
        if host.listen_address is None:
            return Reachability(UNKNOWN, None, 0, "this peer does not listen")
        port = host.listen_address.port
    answers: list[bool] = []
    observed: list[tuple[str, int]] = []
    reasons: list[str] = []
    asked: set[PeerID] = {host.peer_id}  # one answer per peer, however many addresses name it
    dialed_back: dict[PeerID, trio.Event] = {}  # set when that peer's direct connection reaches us

    def arrived(connection: Any, incoming: bool) -> None:
        event = dialed_back.get(connection.remote_peer_id)
        if event is not None and incoming and connection.relayed_via is None:
            event.set()

    async def ask(server: PeerAddress) -> None:
        try:
            connection = await host.connect(server)
            peer = connection.remote_peer_id
            if peer in asked:
                return
            asked.add(peer)
            dialed_back[peer] = trio.Event()
            reply = await connection.call(DIALBACK, {"port": port}, timeout=DIALBACK_TIMEOUT + 5)
        except (ConnectError, RPCError, trio.TooSlowError) as error:
            log.debug("dial-back request to %s: %s", server, error)
            return
        body = reply.body if isinstance(reply.body, dict) else {}
        seen = body.get("observed")
        if not isinstance(body.get("reachable"), bool):
            return
        if body["reachable"]:
            # a claim until its connection shows up: a liar could otherwise keep us from relays
            with trio.move_on_after(DIALBACK_EVIDENCE):
                await dialed_back[peer].wait()
            if not dialed_back[peer].is_set():
                log.info("%s said it dialed us back, but no connection of its came", peer)
                return
        answers.append(body["reachable"])
        reason = body.get("reason")
        if isinstance(reason, str):
            reasons.append(reason[:200])
        if isinstance(seen, list) and len(seen) == 2 and isinstance(seen[0], str) and type(seen[1]) is int:
            observed.append((seen[0][:100], seen[1]))

    host.on_connection.append(arrived)
    try:
        # a batch at a time, until a verdict: servers that are gone or refuse (the first listed
        # are the initial peers) must not leave us unknown while others could answer
        for start in range(0, min(len(servers), max_servers * max_batches), max_servers):
            async with trio.open_nursery() as nursery:
                for server in servers[start : start + max_servers]:
                    nursery.start_soon(ask, server)
            if reachability_verdict(answers) != UNKNOWN:
                break
    finally:
        host.on_connection.remove(arrived)
    status = reachability_verdict(answers)
    if status == PUBLIC:
        reason = f"{sum(answers)} of {len(answers)} peers dialed us back"
    elif status == NAT:
        reason = f"none of {len(answers)} peers could dial us back at port {port} ({reasons[0] if reasons else '?'})"
    else:
        reason = f"only {len(answers)} peer(s) answered a dial-back request"
    return Reachability(status, most_common(observed), len(answers), reason)
