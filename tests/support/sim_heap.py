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
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["one_heap_for_many_peers", "settle", "settle_every", "sweep"]

# Allocations between young collections (Python's default: 700), and the young collections that
# each older generation waits for (its defaults: 10 and 10).
YOUNG_THRESHOLD = 20_000
# One settle in this many collects the whole heap, frozen objects too (``sweep``): each walks O(N)
# objects, so it comes rarely enough that its share per peer stays small, and often enough that
# memory freed by departures and retired connections is freed.
SWEEP_EVERY = 4


class _Blocks:
    """How deep in ``one_heap_for_many_peers`` we are, and the settles of the outermost block."""

    depth = 0
    settles = 0


@contextmanager
def one_heap_for_many_peers() -> Iterator[None]:
    """Collect garbage in this block as N separate peer processes would, in proportion to each
    peer's own heap (see the module). What was frozen before the block (a test session freezes
    its start-up heap) is frozen again after it."""
    before, was_frozen = gc.get_threshold(), gc.get_freeze_count() > 0
    if _Blocks.depth == 0:
        _Blocks.settles = 0
    _Blocks.depth += 1
    gc.set_threshold(YOUNG_THRESHOLD, 10, 10)
    try:
        yield
    finally:
        _Blocks.depth -= 1
        if _Blocks.depth == 0:
            gc.set_threshold(*before)
            gc.unfreeze()
            gc.collect()
            if was_frozen:
                gc.freeze()


def settle() -> None:
    """Collect the garbage made so far (every SWEEP_EVERY-th time, the frozen objects' too:
    ``sweep``) and leave what survives out of later collections."""
    _Blocks.settles += 1
    _freeze_survivors(everything=_Blocks.settles % SWEEP_EVERY == 0)


def sweep() -> None:
    """Collect all garbage, frozen or not (before a memory reading), and freeze what survives."""
    _freeze_survivors(everything=True)


def _freeze_survivors(everything: bool) -> None:
    if _Blocks.depth == 0:
        raise RuntimeError("settling the heap outside one_heap_for_many_peers() would keep it frozen for good")
    if everything:
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
