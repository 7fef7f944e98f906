"""Whom a key's records live on, remembered for a minute: a store to a key this node looked up
moments ago goes straight to the k nearest peers that lookup found, without walking to them again.

A peer of an averaging swarm stores the same few keys over and over (its matchmaking declaration
and then its withdrawal under the round's key every round, its state-donor entry every minute), and
each store's lookup asks ~k peers (20 requests, more with log N hops in a large swarm) before the k stores
themselves: half of a store's requests. The holders of a key change only as peers join and leave,
so a lookup's answer stays right for a while; ``HOLDERS_TTL`` bounds how stale it may be (a peer
that joined nearer the key in the meantime misses one store; readers still find every other copy,
and the next lookup, a minute later at most, includes it). A remembered holder that fails to
answer a store, or answers keeping nothing, is dropped (``lost``): in a churning swarm one of a key's
k holders leaves every few seconds, and dropping the whole set for each made most stores walk
again. The key's next-nearest peer lacks the record until the next lookup, as it would have until
a lookup found it; once fewer than ``REFRESH_BELOW`` of the looked-up holders are left, the key is
forgotten and the next store looks it up again.

Peers join too: our routing table may know a peer that belongs among the holders and is missing
(a newcomer: nearer the key than the farthest the lookup found, or any if the lookup found fewer
than k). A few such newcomers (at most ``ADMIT_AT_MOST``, a churning swarm's arrivals) are admitted
(``admit``): the store goes to them too, and the farthest holders beyond k are left, as a lookup
would have found; the table knows them from an authenticated exchange, as it knows a lookup's first
hops. More of them is a swarm that grows fast (a start-up wave), which moves a key's holders within
the minute beyond what one table knows: the store walks again. (In the 64-peer churning simulation
45% of stores with remembered holders walked again for a newcomer or two.)

The cache learns only from this node's own complete single-path store lookups, never from gets: a
get's k nearest are merged over disjoint paths, so a poisoned path's made-up nodes near the key
would be among them, and stores would go to those alone for a minute. It holds at most
``MAX_TARGETS`` keys of at most k contacts each. Sans I/O: the caller passes the time.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from .routing import Contact

__all__ = ["ADMIT_AT_MOST", "HOLDERS_TTL", "MAX_TARGETS", "REFRESH_BELOW", "HolderCache"]

HOLDERS_TTL = 60.0  # seconds a lookup's nearest peers are trusted to still be a key's holders
MAX_TARGETS = 256  # keys remembered (least recently used go first): 256 x 20 contacts
REFRESH_BELOW = 0.75  # fewer than this share of a lookup's holders still answering: look up again
ADMIT_AT_MOST = 4  # newcomers among a lookup's holders that our table met: admitted up to this in all


@dataclass
class _Holders:
    expires: float
    contacts: list[Contact]  # those of the lookup's holders still answering
    found: frozenset[bytes]  # the IDs of all the lookup found (a dropped one stays found)
    reach: int | None  # XOR distance of the farthest the lookup found, if it found k (None: fewer)
    floor: int  # fewer holders left than this: forgotten
    admitted: int = 0  # newcomers admitted since the lookup (at most ADMIT_AT_MOST in all)


class HolderCache:
    def __init__(self, *, ttl: float = HOLDERS_TTL, max_targets: int = MAX_TARGETS):
        if ttl < 0 or max_targets < 0:
            raise ValueError("a holder cache needs a non-negative lifetime and size")
        self.ttl = ttl
        self.max_targets = max_targets
        self._entries: OrderedDict[int, _Holders] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, target: int, nearest: list[Contact], now: float, k: int) -> None:
        """``nearest``: the (up to) k nearest live peers a complete lookup of ``target`` found,
        nearest first."""
        if not nearest or self.max_targets == 0:
            return
        reach = max(contact.long_id ^ target for contact in nearest) if len(nearest) >= k else None
        floor = math.ceil(REFRESH_BELOW * len(nearest))
        found = frozenset(contact.id for contact in nearest)
        self._entries[target] = _Holders(now + self.ttl, list(nearest), found, reach, floor)
        self._entries.move_to_end(target)
        while len(self._entries) > self.max_targets:
            self._entries.popitem(last=False)

    def holders(self, target: int, now: float) -> list[Contact] | None:
        """The remembered holders of ``target`` if still fresh, else None (and the entry goes)."""
        entry = self._entries.get(target)
        if entry is None:
            return None
        if now >= entry.expires:
            del self._entries[target]
            return None
        self._entries.move_to_end(target)
        return list(entry.contacts)

    def lost(self, target: int, gone: list[Contact]) -> None:
        """``gone`` did not answer a store of ``target`` or kept nothing of it: no longer holders."""
        entry = self._entries.get(target)
        if entry is None:
            return
        ids = {contact.id for contact in gone}
        entry.contacts = [contact for contact in entry.contacts if contact.id not in ids]
        if len(entry.contacts) < entry.floor:
            del self._entries[target]

    def admit(self, target: int, known: list[Contact], k: int) -> list[Contact] | None:
        """The remembered holders of ``target`` with the newcomers ``known`` names (peers nearer
        than the farthest the lookup found, or any if it found fewer than k, that it did not find)
        among them, the k nearest kept; None (and the entry goes) when more than
        ``ADMIT_AT_MOST`` would be new since the lookup, at once or over the entry's minute: then
        the key is looked up again."""
        entry = self._entries.get(target)
        if entry is None:
            return None
        newcomers = self._newcomers(target, known)
        if entry.admitted + len(newcomers) > ADMIT_AT_MOST:
            del self._entries[target]
            return None
        if newcomers:
            entry.admitted += len(newcomers)
            nearest = sorted([*entry.contacts, *newcomers], key=lambda contact: contact.long_id ^ target)[:k]
            entry.contacts = nearest
            entry.found = entry.found | {contact.id for contact in newcomers}
            if len(nearest) >= k:
                entry.reach = nearest[-1].long_id ^ target
        return list(entry.contacts)

    def _newcomers(self, target: int, known: list[Contact]) -> list[Contact]:
        """Those of ``known`` (the nearest contacts our table holds) that belong among
        ``target``'s holders and were not among those found (nor dropped since)."""
        entry = self._entries.get(target)
        if entry is None:
            return []
        return [
            contact
            for contact in known
            if contact.id not in entry.found and (entry.reach is None or contact.long_id ^ target < entry.reach)
        ]
