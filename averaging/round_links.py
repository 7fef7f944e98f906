"""The connections of one all-reduce round, watched: the thin trio driver of ``link_speed.py``.

Every ``POLL_INTERVAL`` a round reads the socket byte counts of its connections to the other
members (``Connection.link_progress``): the round's throughput meters get the totals, and every
watched peer's ``ProgressDeadline`` gets that peer's count; a watch whose deadline has passed is
given up (its ``expired`` callback runs). ``lost(peer)`` gives up every watch of a peer at once:
a connection to it died or was refused, so nothing more will come from it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from peer import PeerHost, PeerID

from .link_speed import ProgressDeadline, ThroughputMeter, link_rate

__all__ = ["ConnectionCaps", "POLL_INTERVAL", "RoundLinks", "Watch"]

# How often a round reads its connections' byte counts: a few ioctls per member, and precise
# enough for deadlines of seconds and rates measured over tenths of one.
POLL_INTERVAL = 0.05


class Watch:
    """One peer whose bytes must keep coming (``incoming``: only what it sends us counts; else
    both directions, as for a reducer that first takes our parts and then answers)."""

    def __init__(
        self,
        peer: PeerID,
        deadline: ProgressDeadline,
        expired: Callable[[str], Awaitable[None]],
        incoming: bool,
    ):
        self.peer = peer
        self.deadline = deadline
        self.expired = expired
        self.incoming = incoming


class ConnectionCaps:
    """Sending-rate caps (``uplink.py``) on connections that several rounds may use at once (a
    gradient round still averaging while the state's runs): a connection is capped at the highest
    cap of the rounds holding one on it, and uncapped once the last of them lets go, so one round's
    end neither lifts another's cap nor leaves its own in place."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Any, dict[object, float]]] = {}  # id(link) -> (link, owner -> cap)

    def hold(self, owner: object, link: Any, rate: float) -> None:
        caps = self._held.setdefault(id(link), (link, {}))[1]
        caps[owner] = rate
        link.set_pacing_rate(max(caps.values()))

    def release(self, owner: object) -> None:
        for key, (link, caps) in list(self._held.items()):
            if caps.pop(owner, None) is None:
                continue
            if caps:
                link.set_pacing_rate(max(caps.values()))
            else:
                link.set_pacing_rate(None)
                del self._held[key]

    def __len__(self) -> int:
        return len(self._held)


class RoundLinks:
    """The links (connections) of one round to ``peers``, their meters, and the watches on them."""

    def __init__(
        self,
        host: PeerHost,
        peers: list[PeerID],
        pacing: dict[tuple[PeerID, str], float] | None = None,
        caps: ConnectionCaps | None = None,
        crossing: set[PeerID] | frozenset[PeerID] = frozenset(),
    ):
        """``pacing``: sending rates for what the round sends each of these peers (``uplink.py``):
        a connection is capped at the sum for what it carries while the round uses it (held in
        ``caps``, shared by the rounds of one host), and the caps are lifted by ``lift_pacing``.
        ``crossing``: the peers our bytes reach through our uplink (not on our own machine), whose
        upload alone ``uplink`` meters."""
        self.host = host
        self.peers = peers
        self.pacing = pacing or {}
        self.caps = caps if caps is not None else ConnectionCaps()
        self._carries: dict[int, set[str]] = {}
        self._links: dict[PeerID, dict[int, Any]] = {peer: {} for peer in peers}
        self._base: dict[int, tuple[int, int]] = {}  # a link's counts when the round first saw it
        self._watches: list[Watch] = []
        self._lost: dict[PeerID, str] = {}
        self._wakeup = trio.Event()
        self.upload = ThroughputMeter()
        self.download = ThroughputMeter()
        self.crossing = crossing
        self.uplink = ThroughputMeter()

    def add(self, peer: PeerID, link: Any, carries: str | None = None) -> None:
        """A connection to ``peer`` that this round uses (anything with ``link_progress()``), to
        send what ``carries`` names (``uplink.PARTS`` or ``uplink.AVERAGES``), if anything."""
        links = self._links.get(peer)
        if links is None:
            return
        if id(link) not in links:
            links[id(link)] = link
            self._base[id(link)] = link.link_progress()
        if carries is not None and (peer, carries) in self.pacing:
            what = self._carries.setdefault(id(link), set())
            what.add(carries)
            self.caps.hold(self, link, sum(self.pacing.get((peer, kind), 0.0) for kind in what))

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Watch the round's links (``run``) while the block runs, and lift the round's pacing
        however it ends."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.run)
                yield
                nursery.cancel_scope.cancel()
        finally:
            self.lift_pacing()

    def lift_pacing(self) -> None:
        """The round is over: its caps go (a connection another round still paces keeps that
        round's cap; the others send as fast as TCP lets them again)."""
        self.caps.release(self)

    def watch(
        self, peer: PeerID, deadline: ProgressDeadline, expired: Callable[[str], Awaitable[None]], *, incoming: bool
    ) -> Watch:
        watch = Watch(peer, deadline, expired, incoming)
        if peer in self._lost:
            deadline.gone(self._lost[peer])
        self._watches.append(watch)
        self._wake()
        return watch

    def unwatch(self, watch: Watch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)

    def lost(self, peer: PeerID, reason: str) -> None:
        """``peer``'s connection died or was refused: give up every watch of it at once."""
        self._lost.setdefault(peer, reason)
        for watch in self._watches:
            if watch.peer == peer:
                watch.deadline.gone(reason)
        self._wake()

    def link_rate(self) -> float | None:
        """This peer's link rate in the round (bytes/s, the slower direction), if measurable."""
        self.measure(trio.current_time())  # the round's last bytes, however short it was
        return link_rate(self.upload, self.download)

    def _wake(self) -> None:
        self._wakeup.set()
        self._wakeup = trio.Event()

    def _counts(self) -> dict[PeerID, tuple[int, int]]:
        """Per peer: (delivered, arrived) bytes on its links since the round first saw them."""
        counts = {}
        for peer, links in self._links.items():
            pooled = self.host.connection_to(peer)
            if pooled is not None:
                self.add(peer, pooled)
            delivered = arrived = 0
            for key, link in links.items():
                now_delivered, now_arrived = link.link_progress()
                base_delivered, base_arrived = self._base[key]
                delivered += now_delivered - base_delivered
                arrived += now_arrived - base_arrived
            counts[peer] = delivered, arrived
        return counts

    def measure(self, now: float) -> dict[PeerID, tuple[int, int]]:
        """Read every link's counts and feed the meters; returns the counts per peer."""
        counts = self._counts()
        self.upload.observe(now, sum(delivered for delivered, _ in counts.values()))
        self.download.observe(now, sum(arrived for _, arrived in counts.values()))
        self.uplink.observe(now, sum(delivered for peer, (delivered, _) in counts.items() if peer in self.crossing))
        return counts

    async def run(self) -> None:
        """Poll until cancelled (the round cancels it when its roles are done)."""
        while True:
            now = trio.current_time()
            counts = self.measure(now)
            for watch in list(self._watches):
                delivered, arrived = counts.get(watch.peer, (0, 0))
                watch.deadline.observe(now, arrived if watch.incoming else delivered + arrived)
                if watch.deadline.expired(now):
                    self.unwatch(watch)
                    await watch.expired(watch.deadline.reason(now))
            wake_at = min([now + POLL_INTERVAL, *(w.deadline.deadline for w in self._watches)], default=math.inf)
            with trio.move_on_at(wake_at):
                await self._wakeup.wait()
