"""Whom a key's records live on, remembered for a minute: a store to a key this node looked up
moments ago goes straight to the k nearest peers that lookup found, without walking to them again.

A peer of an averaging swarm stores the same few keys over and over (its matchmaking declaration and
then its withdrawal under the round's key, its state-donor entry every round), and each store's
lookup asks ~k peers (20 requests, more with log N hops in a large swarm) before the k stores
themselves: half of a store's requests. The holders of a key change only as peers join and leave,
so a lookup's answer stays right for a while; ``HOLDERS_TTL`` bounds how stale it may be (a peer
that joined nearer the key in the meantime misses one store; readers still find every other copy,
and the next lookup, a minute later at most, includes it). A store that any remembered holder
failed to answer, or answered keeping nothing, forgets the key, so the next store looks it up again.

A swarm that grows fast (a start-up wave) moves a key's holders within the minute: so remembered
holders count only while this node's own routing table knows no peer that belongs among them and is
missing (``lacks_a_nearer``: nearer the key than the farthest remembered, or any while fewer than k
are remembered); the table learns of newcomers as they look themselves up, and a store then walks again.

The cache learns only from this node's own complete single-path store lookups, never from gets: a
get's k nearest are merged over disjoint paths, so a poisoned path's made-up nodes near the key
would be among them, and stores would go to those alone for a minute. It holds at most
``MAX_TARGETS`` keys of at most k contacts each. Sans I/O: the caller passes the time.
"""

from __future__ import annotations

from collections import OrderedDict

from .routing import Contact

__all__ = ["HOLDERS_TTL", "MAX_TARGETS", "HolderCache", "lacks_a_nearer"]

HOLDERS_TTL = 60.0  # seconds a lookup's nearest peers are trusted to still be a key's holders
MAX_TARGETS = 256  # keys remembered (least recently used go first): 256 x 20 contacts


class HolderCache:
    def __init__(self, *, ttl: float = HOLDERS_TTL, max_targets: int = MAX_TARGETS):
        if ttl < 0 or max_targets < 0:
            raise ValueError("a holder cache needs a non-negative lifetime and size")
        self.ttl = ttl
        self.max_targets = max_targets
        self._entries: OrderedDict[int, tuple[float, list[Contact]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, target: int, nearest: list[Contact], now: float) -> None:
        """``nearest``: the k nearest live peers a complete lookup of ``target`` found, nearest first."""
        if not nearest or self.max_targets == 0:
            return
        self._entries[target] = (now + self.ttl, list(nearest))
        self._entries.move_to_end(target)
        while len(self._entries) > self.max_targets:
            self._entries.popitem(last=False)

    def holders(self, target: int, now: float) -> list[Contact] | None:
        """The remembered holders of ``target`` if still fresh, else None (and the entry goes)."""
        entry = self._entries.get(target)
        if entry is None:
            return None
        expires, nearest = entry
        if now >= expires:
            del self._entries[target]
            return None
        self._entries.move_to_end(target)
        return list(nearest)

    def forget(self, target: int) -> None:
        self._entries.pop(target, None)


def lacks_a_nearer(target: int, holders: list[Contact], known: list[Contact], k: int) -> bool:
    """Whether ``known`` (the nearest contacts our table holds) names a peer missing from ``holders``
    that belongs among a key's k nearest: the remembered holders are out of date."""
    remembered = {contact.id for contact in holders}
    farthest = max((contact.long_id ^ target for contact in holders), default=0)
    return any(
        contact.id not in remembered and (len(holders) < k or contact.long_id ^ target < farthest) for contact in known
    )
