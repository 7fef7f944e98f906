"""Backoff for unresponsive peers: one lost reply does not evict a peer.

Keys are whatever the caller tracks (the DHT tracks a peer ID at an address: see ``contacts.py``).

Each consecutive failure puts the peer in backoff for ``base * 2**(failures - 1)`` seconds (capped),
during which lookups route around it; after ``evict_after`` consecutive failures it leaves the
routing table. Any success resets it. Plain object with an injectable clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

__all__ = ["PeerHealth"]

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
