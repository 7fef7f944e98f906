"""The autograd graphs an expert server keeps between a forward and its backward, sans I/O.

A forward that asks for gradients may have its graph kept, so that its backward does not compute
the forward again (a third more compute than a local module pays). A graph holds the forward's
activations (a 4096-sample batch at width 256 through an FFN expert keeps about 40 MiB), and the
caller decides whether its backward ever comes: 32 such forwards whose backwards never came held
+1.3 GB. So kept graphs have budgets, in bytes per calling peer and over the server, and a
lifetime. A graph past a budget evicts the oldest of its own caller's graphs first, then the oldest
of anyone's (a graph whose backward has not come for longest is the least likely to be used), and
one larger than a budget is not kept at all; a graph older than its lifetime is dropped. Dropping
a graph is always safe: a backward carries its inputs, and without a graph it recomputes it.

No clock and no torch here: the server says when it is (``now``) and what a graph costs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

__all__ = ["SavedGraphs", "GRAPH_BYTES_PER_PEER", "GRAPH_BYTES", "GRAPH_LIFETIME", "MIN_GRAPH_CHARGE"]

# One caller's kept graphs: a 4096-sample batch at width 256 (~40 MiB) with room to spare, or many
# smaller ones. A caller keeps one graph per expert call until its training step's backward; past
# this its oldest are recomputed, which costs it time, not correctness.
GRAPH_BYTES_PER_PEER = 64 << 20
# Every caller's graphs together: four callers' worth, an eighth of the memory of a 2 GiB GPU.
GRAPH_BYTES = 256 << 20
# A backward follows its forward within one training step of its caller, and a caller gives up on
# a call after ``moe.client.DEFAULT_TIMEOUT`` (30 s): a graph kept twice that long is not coming back.
GRAPH_LIFETIME = 60.0
# What a graph is charged at least: the tensors and autograd nodes of even a one-sample graph cost
# some KiB of bookkeeping, and the floor bounds how many graphs a caller can make us track.
MIN_GRAPH_CHARGE = 64 << 10


class _Kept:
    __slots__ = ("peer", "expert", "graph", "nbytes", "expires")

    def __init__(self, peer: Hashable, expert: str, graph: Any, nbytes: int, expires: float):
        self.peer, self.expert, self.graph, self.nbytes, self.expires = peer, expert, graph, nbytes, expires


class SavedGraphs:
    """Kept graphs by key (the caller's token), with their budgets and lifetime."""

    def __init__(self, *, per_peer: int | None = None, total: int | None = None, lifetime: float | None = None):
        """Budgets in bytes and the lifetime in seconds; None: the module's constants."""
        self.per_peer = GRAPH_BYTES_PER_PEER if per_peer is None else per_peer
        self.total = GRAPH_BYTES if total is None else total
        self.lifetime = GRAPH_LIFETIME if lifetime is None else lifetime
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()  # oldest first
        self._by_peer: dict[Hashable, OrderedDict[Hashable, None]] = {}  # each peer's keys, oldest first
        self._held_by: dict[Hashable, int] = {}
        self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._kept)

    def held_by(self, peer: Hashable) -> int:
        """Bytes of graphs kept for ``peer``'s calls."""
        return self._held_by.get(peer, 0)

    def keep(self, key: Hashable, peer: Hashable, expert: str, graph: Any, nbytes: int, now: float) -> bool:
        """Keep ``graph`` (of ``nbytes``, for ``peer``'s call to ``expert``) under ``key``, evicting
        older graphs to fit the budgets; False if it is larger than a budget (nothing is kept)."""
        self.pop(key)
        nbytes = max(nbytes, MIN_GRAPH_CHARGE)
        if nbytes > self.per_peer or nbytes > self.total:
            return False
        while self.held_by(peer) + nbytes > self.per_peer:
            self.pop(next(iter(self._by_peer[peer])))
        while self.bytes_held + nbytes > self.total:
            self.pop(next(iter(self._kept)))
        self._kept[key] = _Kept(peer, expert, graph, nbytes, now + self.lifetime)
        self._by_peer.setdefault(peer, OrderedDict())[key] = None
        self._held_by[peer] = self.held_by(peer) + nbytes
        self.bytes_held += nbytes
        return True

    def pop(self, key: Hashable) -> Any | None:
        """Take the graph kept under ``key`` (None if there is none)."""
        kept = self._kept.pop(key, None)
        if kept is None:
            return None
        keys = self._by_peer[kept.peer]
        del keys[key]
        self._held_by[kept.peer] -= kept.nbytes
        if not keys:
            del self._by_peer[kept.peer], self._held_by[kept.peer]
        self.bytes_held -= kept.nbytes
        return kept.graph

    def drop_expert(self, expert: str) -> None:
        """Drop every graph of ``expert``: its parameters are about to change (or have changed) in
        place, and a graph of the old ones would give wrong gradients."""
        for key in [key for key, kept in self._kept.items() if kept.expert == expert]:
            self.pop(key)

    def expire(self, now: float) -> int:
        """Drop the graphs whose lifetime is over; how many."""
        dropped = 0
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self.pop(next(iter(self._kept)))
            dropped += 1
        return dropped

    def next_expiry(self) -> float | None:
        """When the oldest graph's lifetime ends (None if none is kept)."""
        return next(iter(self._kept.values())).expires if self._kept else None
