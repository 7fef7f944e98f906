"""Backoff for unresponsive peers: one lost reply does not evict a peer; and for endpoints that
did not answer as the peer named there.

Keys are whatever the caller tracks (the DHT tracks a peer ID at an address: see ``contacts.py``).

Each consecutive failure puts the peer in backoff for ``base * 2**(failures - 1)`` seconds (capped),
during which lookups route around it; after ``evict_after`` consecutive failures it leaves the
routing table. Any success resets it. Plain object with an injectable clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = ["PeerHealth", "UnansweredEndpoints"]

# 1 s covers a dropped packet or a GC pause; three strikes (1 + 2 + 4 s of backoff) means a peer is
# evicted only after staying silent across several seconds of attempts.
FAILURE_BACKOFF = 1.0
FAILURE_BACKOFF_MAX = 60.0
EVICT_AFTER_FAILURES = 3
# Forget about peers we have not heard of in a long time (bounds memory under churn).
MAX_TRACKED = 10_000


class PeerHealth:
    def __init__(
        self,
        *,
        base: float = FAILURE_BACKOFF,
        maximum: float = FAILURE_BACKOFF_MAX,
        evict_after: int = EVICT_AFTER_FAILURES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base, self.maximum, self.evict_after, self.clock = base, maximum, evict_after, clock
        self._failures: dict[Hashable, tuple[int, float]] = {}  # peer -> (consecutive failures, retry at)

    def failed(self, peer: Hashable) -> bool:
        """Record a failure; True when the peer has now failed often enough to be evicted."""
        count = self._failures.get(peer, (0, 0.0))[0] + 1
        delay = min(self.base * 2 ** (count - 1), self.maximum)
        if len(self._failures) >= MAX_TRACKED and peer not in self._failures:
            self._failures.pop(next(iter(self._failures)))
        self._failures[peer] = (count, self.clock() + delay)
        return count >= self.evict_after

    def succeeded(self, peer: Hashable) -> None:
        self._failures.pop(peer, None)

    def __bool__(self) -> bool:
        """True while any peer has unforgiven failures (lets callers skip per-peer checks)."""
        return bool(self._failures)

    def backing_off(self, peer: Hashable) -> bool:
        state = self._failures.get(peer)
        return state is not None and state[1] > self.clock()

    def failures(self, peer: Hashable) -> int:
        return self._failures.get(peer, (0, 0.0))[0]


# An endpoint that did not answer as the peer a contact named there (nothing listens, another
# service, a peer of another run, or a peer with another identity) is not dialled again for this
# long, doubling while it keeps failing: contacts come from other peers, and a liar that names a
# foreign endpoint under ever new identities would otherwise have us dial it on every lookup.
# 10 s spans many lookups; the cap bounds how long an honest peer that was down stays undialled
# through contacts (a live connection from it is used regardless, and one answer clears it).
ENDPOINT_BACKOFF = 10.0
ENDPOINT_BACKOFF_MAX = 600.0
# Endpoints remembered; past this the oldest failure is forgotten (a liar can name many).
MAX_ENDPOINTS = 4096

Endpoint = tuple[str, int]


class UnansweredEndpoints:
    """Endpoints whose last dial was not answered by the peer expected there, and who answered
    instead (when a peer did, with another identity: contacts naming that peer stay dialable)."""

    def __init__(
        self,
        *,
        base: float = ENDPOINT_BACKOFF,
        maximum: float = ENDPOINT_BACKOFF_MAX,
        capacity: int = MAX_ENDPOINTS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base, self.maximum, self.capacity, self.clock = base, maximum, capacity, clock
        # endpoint -> (consecutive failures, retry at, the identity that answered or None); oldest first
        self._entries: OrderedDict[Endpoint, tuple[int, float, Hashable | None]] = OrderedDict()

    def failed(self, endpoint: Endpoint, answered_by: Hashable | None = None) -> None:
        count = self._entries.pop(endpoint, (0, 0.0, None))[0] + 1
        delay = min(self.base * 2 ** (count - 1), self.maximum)
        self._entries[endpoint] = (count, self.clock() + delay, answered_by)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def answered(self, endpoint: Endpoint) -> None:
        self._entries.pop(endpoint, None)

    def blocks(self, endpoint: Endpoint, peer: Hashable) -> bool:
        """Whether dialling ``peer`` at ``endpoint`` should wait: the endpoint failed recently, and
        not by answering as ``peer``."""
        entry = self._entries.get(endpoint)
        return entry is not None and entry[1] > self.clock() and entry[2] != peer

    def __len__(self) -> int:
        return len(self._entries)
