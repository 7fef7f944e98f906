"""``Later`` (``averaging/later.py``): one task's result, collected later, without a free-floating
future: its value once it returned, None once cancelled (even before the task started), and an
exception left to the nursery it ran in."""

from __future__ import annotations

import pytest
import trio

from averaging.later import Later


async def test_the_value_of_work_that_returned_is_collected_later():
    async with trio.open_nursery() as nursery:
        gate = trio.Event()

        async def work() -> int:
            await gate.wait()
            return 7

        later = Later(nursery, work)
        await trio.sleep(0)
        assert not later.ready and not later.over
        with pytest.raises(RuntimeError, match="not returned"):
            later.value()
        gate.set()
        assert await later.wait() == 7
        assert later.ready and later.over and later.value() == 7


async def test_a_cancel_before_the_task_started_still_takes_and_wait_returns_none():
    started = []

    async def work() -> int:
        started.append(True)
        await trio.sleep_forever()
        return 1

    async with trio.open_nursery() as nursery:
        later = Later(nursery, work)
        later.cancel()  # the task has not run yet
        assert await later.wait() is None
        assert later.over and not later.ready
    assert started == [True]  # it started, inside its own cancelled scope, and left at once


async def test_waiting_for_cancelled_work_waits_until_its_task_is_out():
    cleaned = trio.Event()

    async def work() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)  # e.g. handing a buffer back
            cleaned.set()

    async with trio.open_nursery() as nursery:
        later = Later(nursery, work)
        await trio.sleep(0)
        later.cancel()
        await later.wait()
        assert cleaned.is_set()


async def test_an_exception_goes_to_the_nursery_not_into_the_value():
    async def work() -> int:
        raise ValueError("round failed")

    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="round failed")):
        async with trio.open_nursery() as nursery:
            later = Later(nursery, work)
            assert await later.wait() is None
            assert later.over and not later.ready
