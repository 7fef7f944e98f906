"""``averaging/retry_pause.py``: a failed matchmaking attempt's pause doubles, is capped, and never
runs past the deadline."""

from __future__ import annotations

import pytest
import trio

from averaging.retry_pause import FIRST_RETRY_PAUSE, MAX_RETRY_PAUSE, back_off


async def test_pauses_double_up_to_the_cap_and_stop_at_the_deadline(autojump_clock):
    start = trio.current_time()
    pause, waited = FIRST_RETRY_PAUSE, []
    for _ in range(8):
        before = trio.current_time()
        pause = await back_off(pause, deadline=start + 100.0)
        waited.append(trio.current_time() - before)
    assert waited[:2] == pytest.approx([FIRST_RETRY_PAUSE, 2 * FIRST_RETRY_PAUSE])
    assert max(waited) == pytest.approx(MAX_RETRY_PAUSE) and pause == MAX_RETRY_PAUSE
    before = trio.current_time()
    await back_off(MAX_RETRY_PAUSE, deadline=before + 0.1, least=0.5)  # the deadline comes first
    assert trio.current_time() - before == pytest.approx(0.1)
    before = trio.current_time()
    await back_off(FIRST_RETRY_PAUSE, deadline=before + 10.0, least=0.5)  # at least ``least``
    assert trio.current_time() - before == pytest.approx(0.5)
