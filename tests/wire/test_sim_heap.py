"""Many simulated peers in one heap collect garbage as separate processes would (``sim_heap.py``)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.support.sim_heap import SWEEP_EVERY, YOUNG_THRESHOLD, one_heap_for_many_peers, settle, sweep


class Node:
    """A thing that refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_settled_objects_are_left_out_of_collections_until_the_block_ends():
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count() > 0
    with one_heap_for_many_peers():
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        old = Node()
        gone_old = weakref.ref(old)
        settle()
        del old
        gc.collect()
        assert gone_old() is not None  # frozen: no collection walks it
        young = Node()
        gone_young = weakref.ref(young)
        del young
        gc.collect()
        assert gone_young() is None  # made after the freeze: collected as usual
    assert gone_old() is None  # the block's end collects what the freeze kept
    assert (gc.get_freeze_count() > 0) == frozen_before  # a test session's start-up freeze stays
    assert gc.get_threshold() == before


def test_the_block_keeps_a_freeze_made_before_it():
    gc.freeze()
    try:
        with one_heap_for_many_peers():
            settle()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.collect()
        gc.freeze()  # (as the test session's start leaves it: ``tests/conftest.py``)


def test_settle_outside_the_block_is_refused():
    with pytest.raises(RuntimeError):
        settle()


def test_every_few_settles_collect_what_died_after_it_was_frozen():
    """A long run (thousands of joins, connections retired all along) must not keep every
    retired object until its end."""
    with one_heap_for_many_peers():
        old = Node()
        gone = weakref.ref(old)
        settle()
        del old
        for _ in range(SWEEP_EVERY):
            settle()
        assert gone() is None
        again = Node()
        gone_again = weakref.ref(again)
        settle()
        del again
        sweep()
        assert gone_again() is None
