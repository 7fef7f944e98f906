"""Iterative Kademlia lookup bookkeeping, sans I/O.

``IterativeLookup`` decides whom to ask next and when a lookup is done; the trio driver in
``dht/lookup_driver.py`` sends the requests and feeds back responses and failures. Tests drive it
with plain objects and no sockets.

The rules (Maymounkov & Mazieres, section 2.3):
- Keep the candidates ordered by XOR distance to the target; ask the nearest ones not yet asked,
  with at most ``alpha`` requests in flight.
- "If a round of FIND_NODEs fails to return a node any closer than the closest already seen, the
  initiator resends the FIND_NODE to all of the k closest nodes it has not already queried": after
  a response that does not improve the closest node, up to ``k`` requests may be in flight.
- A peer that fails (timeout, refused, bad reply) drops out of the candidates.
- Done when each of the k nearest live candidates has answered (or each of the ``quorum``
  nearest, for a path of a disjoint lookup: see below).

A request unanswered for a few round trips is *stalled* (``stall``, which the driver calls): it
frees its place among the alpha and among the k nearest asked and waited for (the next candidate
is asked in its place; the lookup's result keeps it in its place), and the lookup no longer waits
for it once the answers it needs outnumber the stalled requests; its answer still counts if it
comes while the lookup runs. A peer that left the swarm stays in the tables of
every node that has not called it since, and they name it in their answers: without the rule each
lookup that met one waited out a dial's or a request's whole timeout (2-4 s), and in the simulated
churning swarm of 64 peers lookups took a median 4 s and each round's matchmaking most of its
deadline. While answers are fewer than stalled requests (a small swarm, a slow machine) the lookup
waits as before: it ends with answers, not with none.

``DisjointLookup`` runs d of these along disjoint paths (S/Kademlia, Baumgart & Mies 2007, section
4.4): the initial candidates are dealt out among d sub-lookups, a node queried by one path is never
queried by another, and a value is found if any path finds it. A hostile node can then poison only
the path that asked it: its fake contacts stay on that path, and the others still reach the honest
nodes that hold the record. The k nearest are dealt out among the paths too: each path is done when
its ceil(k / d) nearest live candidates have answered, so a lookup hears about k nodes near the
target in all, as one path does, instead of k per path. Waiting for k answers on every path cost
d times the requests at the key's holders, and more the larger the swarm (a swarm of 64 nodes
holds fewer than d * k near any key; one of 1,000 holds them all).

A lookup that needs only ``quorum`` answers of the k nearest (a read of a popular dictionary:
``DHTConfig.latest_read_holders``) draws them: each path asks its share in an order a secret salt
fixes (``spread_order``), from its share of the k nearest it knows, so that many readers of one
key spread over all its holders instead of all asking the nearest few. Answers in hand count
first; when answers are slow, the driver has it ask spares (``spare``) rather than wait out a
dead node's timeout.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from itertools import islice
from operator import itemgetter

from .candidates import CandidateHeap, spread_order
from .routing import ALPHA, Contact, K

__all__ = ["IterativeLookup", "DisjointLookup", "DISJOINT_PATHS"]

# S/Kademlia's simulations: d = 3 disjoint paths of k = 20 keep lookups ~99% successful with a
# fifth of the nodes hostile, at about d times the messages of one path when the value is missing.
DISJOINT_PATHS = 3

_distance = itemgetter(0)


class _Draw:
    """How a lookup that needs only some of the nearest draws them: from its ``window`` nearest
    (less the nearer nodes other paths took: ``taken``, their distances), in ``salt``'s order,
    with ``spares`` asked beyond those needed once answers are slow."""

    def __init__(self, salt: bytes, window: int, target: int, taken: Iterable[bytes]):
        self.salt, self.window = salt, window
        self.taken = sorted(int.from_bytes(node, "big") ^ target for node in taken)
        self.spares = 0
        self._ranks: dict[bytes, bytes] = {}

    def rank(self, node: bytes) -> bytes:
        rank = self._ranks.get(node)
        if rank is None:
            rank = self._ranks[node] = spread_order(self.salt, node)
        return rank


class IterativeLookup:
    """One lookup toward ``target``. Feed it ``on_response``/``on_failure``; ask ``next_queries``."""

    def __init__(
        self,
        target: int,
        initial: Iterable[Contact],
        *,
        k: int = K,
        alpha: int = ALPHA,
        self_id: int | None = None,
        excluded: Iterable[bytes] = (),
        quorum: int | None = None,
        window: int | None = None,
        salt: bytes | None = None,
    ):
        """``excluded``: node IDs never to consider (for a disjoint path, those other paths took);
        ``quorum``: how many of the nearest live candidates must answer (default k); ``window``
        and ``salt``: the quorum is drawn from the ``window`` nearest (default: the quorum itself),
        in an order that ``salt`` fixes for this lookup (see ``spread_order``)."""
        if quorum is not None and not 1 <= quorum <= k:
            raise ValueError(f"need 1 <= quorum <= k, got {quorum}")
        self.target = target
        self.k, self.alpha = k, alpha
        self.quorum = quorum or k
        excluded = frozenset(excluded)
        window = max(self.quorum, min(window or self.quorum, k))
        self._draw = _Draw(salt, window, target, excluded) if salt is not None and window > self.quorum else None
        self._heap = CandidateHeap(Contact.for_id(target), k)
        self._self_id = self_id
        self._hops: dict[bytes, int] = {}
        self._in_flight: set[bytes] = set()
        self._responded: set[bytes] = set()
        self._stalled: set[bytes] = set()  # asked, unanswered for long: waited for only if answers are few
        self._dropped: set[bytes] = set(excluded)  # failed, or taken by another path of a disjoint lookup
        self._widened = False
        self._narrow = False
        self.rpcs = 0
        self._add(initial, hop=1)
        self._closest_distance = self._best_distance()

    # ------------------------------------------------------------------ driving
    def start_narrow(self) -> None:
        """Hedged start for value lookups: one request in flight until it answers, fails, or the
        driver calls ``hedge()`` after a delay. The nearest peer holds the value almost always, and
        the other alpha - 1 requests would only add load (The Tail at Scale, Dean & Barroso 2013)."""
        self._narrow = True

    def hedge(self) -> None:
        """Lift the narrow start: up to alpha requests in flight from now on."""
        self._narrow = False

    def next_queries(self) -> list[Contact]:
        """Contacts to query now (marked in flight); empty while enough requests are pending."""
        if self._narrow:
            limit = 1 - len(self._in_flight)
        elif self._draw is not None:  # (those drawn, and the spares: see ``_asking_order``)
            limit = self.quorum + self._draw.spares - len(self._in_flight)
        else:
            limit = (self.quorum if self._widened else self.alpha) - len(self._in_flight)
        chosen: list[Contact] = []
        if limit <= 0:
            return chosen
        in_flight, responded, stalled = self._in_flight, self._responded, self._stalled
        for contact in self._asking_order():
            if contact.id not in in_flight and contact.id not in responded and contact.id not in stalled:
                chosen.append(contact)
                in_flight.add(contact.id)
                if len(chosen) == limit:
                    break
        self.rpcs += len(chosen)
        return chosen

    def on_response(self, contact: Contact, neighbours: Iterable[Contact]) -> None:
        if contact.id not in self._in_flight and contact.id not in self._stalled:
            return  # not ours, or already failed
        self._in_flight.discard(contact.id)
        self._stalled.discard(contact.id)
        self._responded.add(contact.id)
        self._narrow = False
        self._add(neighbours, hop=self._hops.get(contact.id, 1) + 1)
        best = self._best_distance()
        self._widened = best >= self._closest_distance  # no closer node: widen to the k nearest
        self._closest_distance = min(best, self._closest_distance)

    def on_failure(self, contact: Contact) -> None:
        self._in_flight.discard(contact.id)
        self._stalled.discard(contact.id)
        self._narrow = False
        self.drop(contact)

    def stall(self, contact: Contact) -> None:
        """``contact``'s request has gone unanswered for a few round trips: ask another in its
        place, and finish without it once the answers outnumber the stalled requests. A lookup
        that draws its holders asks a spare instead (``spare``)."""
        if self._draw is not None:
            self.spare()
        elif contact.id in self._in_flight:
            self._in_flight.discard(contact.id)
            self._stalled.add(contact.id)

    def drop(self, contact: Contact) -> None:
        """Never consider ``contact`` again (it failed, or another path queries it)."""
        self._dropped.add(contact.id)
        self._heap.remove([contact.id])

    def taken(self, contact: Contact) -> None:
        """Another path of a disjoint lookup queries ``contact``: never consider it, and if it is
        among the nearest, draw from one candidate fewer (the k nearest are shared by the paths)."""
        if contact.id not in self._dropped and self._draw is not None:
            bisect.insort(self._draw.taken, contact.long_id ^ self.target)
        self.drop(contact)

    def spare(self) -> None:
        """With a salt: the answers are slow (a drawn node may be dead), so ask one more, the next
        in the salt's order (``alpha`` more at most); the first ``quorum`` answers finish it."""
        if self._draw is not None:
            self._draw.spares = min(self._draw.spares + 1, self.alpha)

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        """Every one of the ``quorum`` live candidates it needs has answered (or there are none):
        the nearest, or with a salt the first in its order among the ``window`` nearest; stalled
        requests aside, once those answers outnumber them."""
        responded, needed = self._responded, self._needed()
        if not all(contact.id in responded for contact in needed):
            return False
        return len(needed) > len(self._stalled) or not self._stalled

    @property
    def in_flight(self) -> int:
        """Requests not yet answered, the stalled ones included."""
        return len(self._in_flight) + len(self._stalled)

    def closest(self, k: int | None = None) -> list[Contact]:
        """The nearest contacts that answered, nearest first."""
        return [entry[1] for entry in self.closest_entries(k)]

    def closest_entries(self, k: int | None = None) -> list[tuple[int, Contact]]:
        """``closest`` as (distance to the target, contact) pairs."""
        # Of the k nearest candidates, stalled ones keeping their places: a slow peer is still among
        # the nearest, and a census counts the swarm by how far the k nearest are (with farther
        # peers in the places of slow ones, peers counted fewer cells than the swarm: at 128
        # simulated peers groups of 2 formed and rounds ran out their deadlines). The peers asked
        # in stalled places still get a store's record as they answer (``among_nearest``).
        responded = self._responded
        return [entry for entry in self._heap.nearest_entries() if entry[1].id in responded][: k or self.k]

    def among_nearest(self, contact: Contact) -> bool:
        """Whether ``contact`` is currently one of the k nearest live candidates."""
        node_id = contact.id
        return any(candidate.id == node_id for candidate in self._live_nearest())

    def responded(self, contact: Contact) -> bool:
        return contact.id in self._responded

    def hop_of(self, contact: Contact) -> int:
        """How many hops away ``contact`` was found (1: our routing table knew it; 0: unknown)."""
        return self._hops.get(contact.id, 0)

    @property
    def hops(self) -> int:
        """Hop depth of the nearest answering node: 1 if our routing table already knew it."""
        closest = self.closest(1)
        return self._hops.get(closest[0].id, 0) if closest else 0

    # ------------------------------------------------------------------ internals
    def _needed(self) -> list[Contact]:
        """The candidates whose answers finish the lookup: the ``quorum`` nearest live ones, or
        with a salt the first ``quorum`` of ``_drawn``."""
        if self._draw is None:
            return list(islice(self._live_nearest(), self.quorum))
        return self._drawn(self._draw)[: self.quorum]

    def _live_nearest(self) -> Iterator[Contact]:
        """The k nearest candidates, stalled ones aside: a stalled request's place among the k goes
        to the next candidate, as a failed one's does (or a peer naming k/2 unreachable contacts
        nearer the target would leave a store with half its holders)."""
        stalled = self._stalled
        return islice((entry[1] for entry in self._heap.heap if entry[1].id not in stalled), self.k)

    def _asking_order(self) -> Iterable[Contact]:
        """Whom to ask, in order: the k nearest live candidates, nearest first (the nearer they
        are, the more they know of the target's neighbourhood); with a salt, only those needed
        and any spares. (A needed one that fails drops out; the next in ``_drawn`` takes its place.)"""
        draw = self._draw
        return self._live_nearest() if draw is None else self._drawn(draw)[: self.quorum + draw.spares]

    def _drawn(self, draw: _Draw) -> list[Contact]:
        """This path's share of the window nearest it knows of (its candidates among them and the
        nodes other paths took), those that answered or are being asked first (an answer counts
        while its node stays among them), then in the salt's order."""
        taken, window, nearer = draw.taken, [], 0
        for distance, contact in self._heap.nearest_entries():
            nearer = bisect.bisect_left(taken, distance, nearer)  # taken nodes nearer than this one
            if len(window) + nearer >= draw.window and len(window) >= self.quorum:
                break
            window.append(contact)
        responded, in_flight = self._responded, self._in_flight
        window.sort(key=lambda c: (c.id not in responded, c.id not in in_flight, draw.rank(c.id)))
        return window

    def _add(self, contacts: Iterable[Contact], hop: int) -> None:
        dropped, self_id = self._dropped, self._self_id
        fresh = [contact for contact in contacts if contact.id not in dropped and contact.long_id != self_id]
        hops = self._hops
        for contact in self._heap.push(fresh):
            hops[contact.id] = hop

    def _best_distance(self) -> int:
        return self._heap.best_distance


class DisjointLookup:
    """``paths`` lookups toward ``target`` along disjoint paths, driven like one ``IterativeLookup``.

    A path other than the first is built when it is first needed (hedging, opening up, asking
    whether the lookup is done), from its share of the initial candidates minus the nodes other
    paths have queried by then: what it would hold had it been built at the start and told of
    each of those queries. A value lookup answered by its first request never builds them."""

    def __init__(
        self,
        target: int,
        initial: Iterable[Contact],
        *,
        paths: int = DISJOINT_PATHS,
        k: int = K,
        alpha: int = ALPHA,
        self_id: int | None = None,
        quorum: int | None = None,
        salt: bytes | None = None,
    ):
        """``quorum`` (default k) and ``salt``: a lookup that needs only ``quorum`` of the k nearest
        to answer, dealt out among the paths; each path asks its share in the order the salt draws
        from the k nearest it knows (those the other paths asked aside: see ``spread_order``)."""
        if paths < 1:
            raise ValueError("a lookup needs at least one path")
        self.target = target
        self._k, self._alpha, self._self_id = k, alpha, self_id
        share = -(-k // paths)  # the k nearest, dealt out among the paths
        self._quorum = min(share, -(-(quorum or k) // paths))
        self._salt = salt if quorum is not None and quorum < k else None  # (all k: none to draw)
        self._window = k if self._salt is not None else share
        ordered = [entry[1] for entry in sorted(((c.long_id ^ target, c) for c in initial), key=_distance)]
        # Dealt out nearest first, so every path starts with some of the best candidates.
        self._shares = [ordered[index::paths] for index in range(paths)]
        self._paths: list[IterativeLookup | None] = [None] * paths
        self._owner: dict[bytes, IterativeLookup] = {}  # node -> the one path that queried it
        self._narrow = False
        self._hedged = False  # hedged, and the first path still waits for its slow peer

    def _path(self, index: int) -> IterativeLookup:
        path = self._paths[index]
        if path is None:
            taken = self._owner  # every node queried so far was queried by another path
            path = self._paths[index] = IterativeLookup(
                self.target,
                self._shares[index],
                k=self._k,
                alpha=self._alpha,
                self_id=self._self_id,
                excluded=taken,
                quorum=self._quorum,
                window=self._window,
                salt=self._salt,
            )
        return path

    @property
    def paths(self) -> list[IterativeLookup]:
        """Every path (built now if not yet)."""
        return [self._path(index) for index in range(len(self._paths))]

    def _built(self) -> Iterator[IterativeLookup]:
        return (path for path in self._paths if path is not None)

    def start_narrow(self) -> None:
        """One request in flight (to the nearest path's nearest candidate) until it answers or fails
        or ``hedge()``; then every path opens. See ``IterativeLookup.start_narrow``."""
        self._narrow = True
        self._path(0).start_narrow()

    def hedge(self) -> None:
        """The nearest peer is slow: ask the next nearest, one per other path (alpha requests in
        all when d = alpha, as one path's hedge sends). Each path opens fully once one of its own
        requests answers or fails; opening all of them at once would send d * alpha requests for
        a value that the first answer usually brings. The first path, still waiting on its slow
        peer, opens as soon as any request returns."""
        self._narrow = False
        paths = self.paths
        for path in paths[1:]:
            path.start_narrow()
        if len(paths) == 1:
            paths[0].hedge()
        else:
            self._hedged = True

    @property
    def draws(self) -> bool:
        """Whether it draws the holders it asks (a salt and a quorum below k), rather than asking
        the nearest."""
        return self._salt is not None and self._window > self._quorum

    def spare(self) -> None:
        """Answers are slow: every path that draws its share asks one more (``IterativeLookup.spare``)."""
        for path in self._built():
            path.spare()

    def next_queries(self) -> list[Contact]:
        chosen: list[Contact] = []
        for path in [self._path(0)] if self._narrow else self.paths:
            for contact in path.next_queries():
                self._owner[contact.id] = path
                for other in self._built():
                    if other is not path:
                        other.taken(contact)
                chosen.append(contact)
        return chosen

    def on_response(self, contact: Contact, neighbours: Iterable[Contact]) -> None:
        path = self._owner.get(contact.id)
        if path is not None:
            self._narrow = False
            self._open_first_path()
            path.on_response(contact, neighbours)

    def stall(self, contact: Contact) -> None:
        """``contact``'s request is slow: its path goes on without it (``IterativeLookup.stall``)."""
        path = self._owner.get(contact.id)
        if path is not None:
            path.stall(contact)

    def on_failure(self, contact: Contact) -> None:
        path = self._owner.get(contact.id)
        if path is not None:
            self._narrow = False
            self._open_first_path()
            path.on_failure(contact)

    def _open_first_path(self) -> None:
        if self._hedged:
            self._hedged = False
            self._path(0).hedge()

    @property
    def done(self) -> bool:
        return all(self._path(index).done for index in range(len(self._paths)))

    @property
    def in_flight(self) -> int:
        return sum(path.in_flight for path in self._built())

    @property
    def rpcs(self) -> int:
        return sum(path.rpcs for path in self._built())

    def closest(self, k: int | None = None) -> list[Contact]:
        """The nearest contacts that answered on any path, nearest first."""
        k = k or self._k
        merged = [entry for path in self._built() for entry in path.closest_entries(k)]
        merged.sort(key=_distance)
        return [entry[1] for entry in merged[:k]]

    def among_nearest(self, contact: Contact) -> bool:
        path = self._owner.get(contact.id)
        return path is not None and path.among_nearest(contact)

    def responded(self, contact: Contact) -> bool:
        path = self._owner.get(contact.id)
        return path is not None and path.responded(contact)

    @property
    def hops(self) -> int:
        """Hop depth of the nearest node that answered on any path."""
        best = min((entry for path in self._built() for entry in path.closest_entries(1)), key=_distance, default=None)
        if best is None:
            return 0
        path = self._owner.get(best[1].id)
        return path.hop_of(best[1]) if path is not None else 0
