"""Garbage collection for many simulated peers in one process.

A real peer runs in its own process, where Python's cyclic collector walks that peer's objects
only. The simulation runs N peers in one heap: a full collection walks every peer's objects, and
comes about as often as the garbage of all of them calls for one, so each peer's share of the
collector's work grows with N (at 64 peers 30% of the scenario's CPU went to it, two thirds of
that to full collections; a peer in its own process pays a fixed share). Inside
``one_heap_for_many_peers`` young collections come less often (each takes more garbage at once),
and ``settle()``, called between rounds, collects once and freezes what survived
(``gc.freeze``): later collections walk only what was allocated since, as a lone peer's collector
walks only its own heap. What was frozen and later becomes cyclic garbage (a departed peer's
objects, a retired connection's) waits for every SWEEP_EVERY-th settle, which unfreezes and walks
everything once, and for the block's end.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["one_heap_for_many_peers", "settle", "settle_every"]

# Allocations between young collections (Python's default: 700), and the young collections that
# each older generation waits for (its defaults: 10 and 10).
YOUNG_THRESHOLD = 20_000
# One settle in this many collects the whole heap, frozen objects too: each walks O(N) objects, so
# it comes rarely enough that its share per peer stays small, and often enough that memory freed by
# departures and retired connections is freed.
SWEEP_EVERY = 4
_settles = itertools.count(1)


@contextmanager
def one_heap_for_many_peers() -> Iterator[None]:
    """Collect garbage in this block as N separate peer processes would, in proportion to each
    peer's own heap (see the module)."""
    before = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
        gc.collect()


def settle() -> None:
    """Collect the garbage made so far (every SWEEP_EVERY-th time, the frozen objects' too) and
    leave what survives out of later collections."""
    if next(_settles) % SWEEP_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


def settle_every(count: int) -> Callable[[int], None]:
    """For ``open_sim_swarm(joined=...)``: settle after every ``count`` nodes joined (a join
    walks the new node's buckets: a swarm's garbage grows with every one)."""

    def joined(index: int) -> None:
        if index % count == count - 1:
            settle()

    return joined
