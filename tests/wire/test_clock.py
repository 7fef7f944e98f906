"""The clock seam (``peer/clock.py``): the system's clocks by default, trio's under simulation."""

from __future__ import annotations

import time

import trio

from peer.clock import SIMULATED_EPOCH, SYSTEM_CLOCK, TrioClock


def test_the_system_clock_is_the_machines():
    before = time.time()
    assert before <= SYSTEM_CLOCK.time() <= time.time()
    before = time.monotonic()
    assert before <= SYSTEM_CLOCK.monotonic() <= time.monotonic()


async def test_the_trio_clock_follows_virtual_time_without_real_time(autojump_clock):
    clock = TrioClock()
    real_start = time.monotonic()
    day, start = clock.time(), clock.monotonic()
    assert day == SIMULATED_EPOCH + trio.current_time()
    await trio.sleep(86400)
    assert clock.time() - day == 86400
    assert clock.monotonic() - start == 86400
    assert time.monotonic() - real_start < 5  # a simulated day, no real one
    assert TrioClock(epoch=1000.0).time() == 1000.0 + trio.current_time()
