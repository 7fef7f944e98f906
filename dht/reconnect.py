"""Finding the swarm again after a link outage: which evicted contacts to ping, and when, sans I/O.

A peer whose link goes down for longer than eviction takes (three unanswered requests, ~7 s)
evicts every contact, and the peers on the other side evict it. When the link comes back neither
side's routing table names the other and no lookup can cross: Kademlia repairs a table only when a
peer happens to call, so a healed partition stayed split until some unrelated call crossed it (in
the lab, 25 s after a 30 s cut).

So a node remembers the contacts it evicted for silence (``LostContacts``, the MAX_LOST most
recent) and pings them again, sooner while the loss is fresh and more rarely as it ages: a contact
lost for ``age`` seconds is retried every ``age / 8`` seconds, at least every PROBE_MIN and at most
every PROBE_MAX. One answer is enough: the contact is back in our table, we are back in its own
(it was called by us), and a lookup of our own ID through it refills the rest
(``TableMaintenance.reconnect_forever``). The initial peers are retried the same way whenever the
table is empty (``initial``).

Only contacts that were in the table (proof checked, reached over an authenticated connection) are
ever remembered, and at most MAX_LOST of them, so a flood of Sybils that join and vanish costs
pings to MAX_LOST addresses per PROBE_MIN at most. At most MAX_LOST_PER_HOST of them share one host
(an IPv4 address or IPv6 /64, ``peer.admission.address_group``; a host's newer losses push out its
older ones), so one machine running many identities, one per port, cannot take every slot and leave
the honest contacts of a real partition forgotten. A contact is given up GIVE_UP_AFTER its loss
(about 65 pings in all): the address in its entry is the one its hello announced, which nobody
checked, and a peer that announced someone else's address and left must not have every node that
met it dial that address for good. The initial peers, which the operator chose, are never given up.

The probes of all lost contacts together are held to a budget (a token bucket: PROBE_BURST at once,
then PROBE_RATE a second), the due ones taking turns, the most overdue first. Each departure of a
churning swarm is a lost contact nobody will hear from again, and without the budget a node pinged
~60 dead addresses a minute for one departure a minute from its table, ~250 a minute at 6 and ~840
at 30 (an averaging peer's rounds ask ~130 requests a minute of the DHT): a cost growing with the
churn and the table. With it a due contact waits at most MAX_LOST / PROBE_RATE seconds for its
turn, so an outage is still probed within ~64 s of its healing, and sooner whenever fewer
contacts are due than the budget allows (one answer heals it: see above).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "GIVE_UP_AFTER",
    "LostContacts",
    "MAX_LOST",
    "MAX_LOST_PER_HOST",
    "PROBE_BURST",
    "PROBE_MAX",
    "PROBE_MIN",
    "PROBE_RATE",
]

MAX_LOST = 64
# A few peers per machine is usual (one per GPU); more is one operator's Sybils.
MAX_LOST_PER_HOST = 4
PROBE_MIN = 1.0
PROBE_MAX = 60.0
AGE_FRACTION = 1 / 8  # a retry every eighth of the outage so far: ~4 s after a 30 s outage
# Longer than any partition worth healing this way (a longer one heals as peers rejoin through
# their initial peers): ~43 pings while the interval grows to PROBE_MAX, then one a minute.
GIVE_UP_AFTER = 1800.0
# All lost contacts' probes together: a burst of 16 (an outage's first seconds), then one a second.
PROBE_BURST = 16
PROBE_RATE = 1.0

T = TypeVar("T")


@dataclass
class _Lost(Generic[T]):
    target: T
    lost_at: float
    next_probe: float
    host: Hashable


class LostContacts(Generic[T]):
    """Targets (contacts, or initial peers' addresses) to ping again, keyed by who they are;
    each is given up ``give_up_after`` seconds after it was lost."""

    def __init__(self, limit: int = MAX_LOST, give_up_after: float = GIVE_UP_AFTER, per_host: int = MAX_LOST_PER_HOST):
        self.limit = limit
        self.per_host = per_host
        self.give_up_after = give_up_after
        self._lost: dict[Hashable, _Lost[T]] = {}
        self._tokens = float(PROBE_BURST)  # probes the budget allows now
        self._filled_at: float | None = None  # when the tokens were last counted

    def __len__(self) -> int:
        return len(self._lost)

    def lost(self, key: Hashable, target: T, now: float, host: Hashable = None) -> None:
        """``target`` (on ``host``: None, a host of its own) stopped answering at ``now``; a target
        already lost keeps its first loss time."""
        if key in self._lost:
            return
        if host is not None:
            same_host = [k for k, entry in self._lost.items() if entry.host == host]
            for k in same_host[: max(0, len(same_host) - self.per_host + 1)]:  # its oldest go first
                del self._lost[k]
        self._lost[key] = _Lost(target, now, now + PROBE_MIN, host)
        while len(self._lost) > self.limit:  # the oldest losses go first
            del self._lost[next(iter(self._lost))]

    def get(self, key: Hashable) -> T | None:
        """The target lost under ``key``, if it is still remembered."""
        entry = self._lost.get(key)
        return entry.target if entry is not None else None

    def found(self, key: Hashable) -> None:
        """``key`` answered (a probe, or any other exchange): nothing to retry."""
        self._lost.pop(key, None)

    def due(self, now: float) -> list[T]:
        """The targets to ping now, as many as the budget allows; each is scheduled for its next
        try as it is handed out, and a due one left out stays due for the next call."""
        for key in [k for k, entry in self._lost.items() if now - entry.lost_at >= self.give_up_after]:
            del self._lost[key]
        self._refill(now)
        waiting = sorted((e for e in self._lost.values() if e.next_probe <= now), key=lambda e: e.next_probe)
        # (a hair of slack: next_due()'s instant may refill to a hair under 1 by rounding)
        chosen = waiting[: int(self._tokens + 1e-6)]
        self._tokens = max(0.0, self._tokens - len(chosen))
        for entry in chosen:
            entry.next_probe = now + min(PROBE_MAX, max(PROBE_MIN, (now - entry.lost_at) * AGE_FRACTION))
        return [entry.target for entry in chosen]

    def next_due(self) -> float | None:
        """When the next target is due and the budget allows its probe (None: nothing is lost)."""
        earliest = min((entry.next_probe for entry in self._lost.values()), default=None)
        if earliest is None or self._tokens >= 1 or self._filled_at is None:
            return earliest
        return max(earliest, self._filled_at + (1 - self._tokens) / PROBE_RATE)

    def _refill(self, now: float) -> None:
        if self._filled_at is not None:
            self._tokens = min(float(PROBE_BURST), self._tokens + max(0.0, now - self._filled_at) * PROBE_RATE)
        self._filled_at = now
