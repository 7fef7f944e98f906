"""The trio side of an iterative lookup: sends the ``dht.find`` requests that ``IterativeLookup``
asks for, feeds back answers and failures, and hedges value lookups.

A value lookup starts with one request to the nearest known peer, which holds the value almost
always; if it has not answered within a few smoothed round trips (``HedgeTimer``), the lookup opens up
to alpha requests (The Tail at Scale, Dean & Barroso 2013). Any request unanswered for longer
(``HedgeTimer.stall_delay``) is stalled (``IterativeLookup.stall``): the lookup asks another in its
place instead of waiting out the request's timeout.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from . import wire
from .config import DHTConfig
from .contacts import Contacts
from .local import LocalRecords
from .lookup import DisjointLookup
from .records import RecordError
from .routing import Contact
from .storage import Found, merge_found

__all__ = ["LookupDriver", "LookupResult", "HedgeTimer", "Stalls"]

log = logging.getLogger("peerd.dht")

# Before any measurement assume a LAN-ish 10 ms; never hedge sooner than 2 ms (below that, scheduling
# noise rather than a slow peer delays the answer).
INITIAL_RTT = 0.01
MIN_HEDGE_DELAY = 0.002
# A request is stalled after this many smoothed round trips of first answers, and never sooner than
# STALL_FLOOR: a first answer comes from the fastest of several peers, most often over a connection
# already open; below half a second a loaded machine's scheduling delays would stall live peers. A
# request that dials first waits DIAL_STALL times as long: TCP's and the Noise handshake's round
# trips come before the request's (in the simulated internet, with every connection retired, live
# holders stalled as often as not with one delay for all). Until its own deadline, a stalled
# peer's answer still counts.
STALL_RTTS = 8
STALL_FLOOR = 0.5
DIAL_STALL = 2


@dataclass
class LookupResult:
    nearest: list[Contact]  # nearest live peers that answered, nearest first (never ourselves)
    found: Found | None  # validated records for the key, if a key was searched
    hops: int
    rpcs: int
    timed_out: bool
    missing: list[Contact]  # answered without the value (for caching on the path)


class HedgeTimer:
    """How long a value lookup waits for its nearest peer alone: three smoothed round trips of a
    lookup's first answering request (timed from its own send); on a healthy path that answer is
    back well before. The smoothing is TCP's SRTT
    (RFC 6298) with a gain of 1/10 instead of 1/8."""

    def __init__(self, ceiling: float):
        self.rtt = INITIAL_RTT
        self.ceiling = ceiling  # never wait longer than one request may take

    def delay(self) -> float:
        return min(max(3 * self.rtt, MIN_HEDGE_DELAY), self.ceiling)

    def observe(self, seconds: float) -> None:
        self.rtt += 0.1 * (seconds - self.rtt)

    def stall_delay(self, dialling: bool = False) -> float:
        """How long a lookup waits for one request (``dialling``: to a peer it first connects to)
        before asking another in its place."""
        delay = max(STALL_RTTS * self.rtt, STALL_FLOOR) * (DIAL_STALL if dialling else 1)
        return min(delay, self.ceiling * (DIAL_STALL if dialling else 1))


class Stalls:
    """A lookup's requests in flight and when each is due to be stalled, unanswered by then. Sans
    I/O: the caller passes the times."""

    def __init__(self) -> None:
        self._due: dict[bytes, tuple[Contact, float, float]] = {}  # (contact, sent at, due at)
        self._sent_at: dict[bytes, float] = {}  # every request's, until it answers or fails

    def sent(self, contact: Contact, now: float, delay: float) -> None:
        self._due[contact.id] = (contact, now, now + delay)
        self._sent_at[contact.id] = now

    def settled(self, contact: Contact) -> float | None:
        """``contact`` answered or failed: when its request was sent (None: not one of ours)."""
        self._due.pop(contact.id, None)
        return self._sent_at.pop(contact.id, None)

    def next_at(self) -> float:
        """When the next request still watched is due (inf: none is)."""
        return min((due_at for _, _, due_at in self._due.values()), default=math.inf)

    def due(self, now: float) -> list[Contact]:
        """The requests due by ``now``; no longer watched."""
        due = [contact for contact, _, due_at in self._due.values() if due_at <= now]
        for contact in due:
            del self._due[contact.id]
        return due


class LookupDriver:
    def __init__(self, contacts: Contacts, records: LocalRecords, *, node_id: int, config: DHTConfig):
        self.contacts = contacts
        self.records = records
        self.node_id = node_id
        self.config = config
        self.hedging = HedgeTimer(config.rpc_timeout)

    async def run(
        self,
        target: int,
        key: bytes | None = None,
        *,
        stop_on_value: bool = False,
        on_answer: Callable[[Contact, DisjointLookup], None] | None = None,
        paths: int = 1,
        quorum: int | None = None,
    ) -> LookupResult:
        """Iterative lookup of the k nearest peers to ``target`` (and of ``key``'s records), along
        ``paths`` disjoint paths (see ``DisjointLookup``); done when ``quorum`` of the k nearest
        (default: all) have answered, a random draw of them for each lookup.

        ``on_answer(contact, search)`` runs after each answer (stores use it to pipeline)."""
        config, contacts = self.config, self.contacts
        search = self._search(target, paths, quorum)
        target_bytes = target.to_bytes(20, "big")
        found: Found | None = None
        missing: list[Contact] = []
        send, receive = trio.open_memory_channel(math.inf)
        # A value lookup starts with one request (``start_narrow``): for the first value found, the
        # nearest peer holds it almost always; for the latest, its answer names the entries that
        # every later holder then leaves out (``wire.known_entries``), instead of d * alpha holders
        # each sending all of them at once.
        narrow = key is not None
        if narrow:
            search.start_narrow()
        first_answer, stalls = True, Stalls()

        async def query(contact: Contact) -> None:
            # (the entries of a dictionary found so far are named, so that this holder sends only
            # what we lack: holders answer with nearly the same entries)
            known = wire.known_entries(found) if key is not None else b""
            body = [target_bytes, key, known] if known else [target_bytes, key]
            reply = await contacts.call(contact, "dht.find", body)
            parsed = None
            if reply is not None:
                try:
                    neighbours = contacts.parse(reply.body)
                    records = wire.parse_found(key, reply.payload, self.records.now()) if key is not None else []
                    # (a holder with nothing newer answers an empty dictionary: it holds the key)
                    parsed = neighbours, self.records.validated(records) if records else None, bool(reply.payload)
                except RecordError as error:
                    log.debug("bad find reply from %s: %s", contact.peer_id, error)
            send.send_nowait((contact, parsed))

        with trio.move_on_after(config.lookup_timeout) as scope:
            async with trio.open_nursery() as nursery:
                while not (stop_on_value and found is not None):
                    for contact in search.next_queries():
                        dialling = contacts.host.connection_to(contact.peer_id) is None
                        stalls.sent(contact, trio.current_time(), self.hedging.stall_delay(dialling))
                        nursery.start_soon(query, contact)
                    if search.done or search.in_flight == 0:
                        break
                    answer = await self._answer(search, receive, narrow, stalls)
                    narrow = False
                    if answer is None:
                        continue
                    contact, parsed = answer
                    sent_at = stalls.settled(contact)
                    if parsed is not None and first_answer and sent_at is not None:
                        # (timed from its own request, not the lookup's start: a hedge's or stall's
                        # wait before it would feed the estimate that sets them; a stalled request's
                        # answer counts too, or answers slower than the stall could never raise it)
                        first_answer = False
                        self.hedging.observe(trio.current_time() - sent_at)
                    if parsed is None:
                        search.on_failure(contact)
                        continue
                    search.on_response(contact, parsed[0])
                    if on_answer is not None:
                        on_answer(contact, search)
                    if parsed[1] is not None:
                        found = merge_found(found, parsed[1])
                    elif key is not None and not parsed[2]:
                        missing.append(contact)
                nursery.cancel_scope.cancel()
        return LookupResult(search.closest(), found, search.hops, search.rpcs, scope.cancelled_caught, missing)

    def _search(self, target: int, paths: int, quorum: int | None) -> DisjointLookup:
        """The bookkeeping of a lookup from the k nearest contacts we know; with a ``quorum`` below
        k, each lookup draws the holders it asks with a secret salt: nobody can tell which."""
        config = self.config
        initial = self.contacts.nearest(target, config.k)
        self.contacts.touch(target)
        salt = secrets.token_bytes(8) if quorum is not None else None
        return DisjointLookup(
            target,
            initial,
            paths=paths,
            k=config.k,
            alpha=config.alpha,
            self_id=self.node_id,
            quorum=quorum,
            salt=salt,
        )

    async def _answer(
        self, search: DisjointLookup, receive: trio.MemoryReceiveChannel, narrow: bool, stalls: Stalls
    ) -> tuple[Contact, Any] | None:
        """The next answer; None when the hedge delay passed first (``_hedged_answer``) or a request
        was due to stall (others are asked in its place: ``stall``)."""
        with trio.move_on_at(stalls.next_at()):
            return await self._hedged_answer(search, receive, narrow)
        try:  # (an answer already in hand counts before any stall)
            return receive.receive_nowait()
        except trio.WouldBlock:
            pass
        for contact in stalls.due(trio.current_time()):
            search.stall(contact)
        return None

    async def _hedged_answer(
        self, search: DisjointLookup, receive: trio.MemoryReceiveChannel, narrow: bool
    ) -> tuple[Contact, Any] | None:
        """The next answer; None when the hedge delay passed first: a narrow start's one peer is
        slow (the search opens up: ``hedge``), or a drawn holder is (it asks a spare: ``spare``)."""
        if not (narrow or search.draws):
            return await receive.receive()
        with trio.move_on_after(self.hedging.delay()):
            return await receive.receive()
        if narrow:
            search.hedge()
        else:
            search.spare()
        return None
