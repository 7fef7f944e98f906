"""Blocking work and trio's virtual clock (``peer/worker_threads.py``): in a worker thread the
clock moves on while the work runs; inside ``inline_blocking_work`` it cannot."""

from __future__ import annotations

import hashlib
import threading

import trio

from peer.worker_threads import inline_blocking_work, run_blocking, runs_inline


async def test_a_worker_thread_lets_virtual_time_pass_while_it_works(autojump_clock):
    released = threading.Event()
    woke_at: list[float] = []

    async def sleeper() -> None:
        await trio.sleep(5.0)
        woke_at.append(trio.current_time())
        released.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        await run_blocking(lambda: released.wait(30))
        finished_at = trio.current_time()
    # the thread's work ended only after 5 simulated seconds of timers had fired
    assert woke_at == [5.0] and finished_at >= 5.0


def cpu_work() -> float:
    digest = b""
    for _ in range(20_000):
        digest = hashlib.sha256(digest).digest()
    return trio.current_time()


async def test_inline_work_costs_no_virtual_time(autojump_clock):
    events: list[tuple[str, float]] = []

    async def sleeper() -> None:
        await trio.sleep(0.001)
        events.append(("timer", trio.current_time()))

    with inline_blocking_work():
        assert runs_inline()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleeper)
            started = trio.current_time()
            events.append(("work", await run_blocking(cpu_work)))
    assert events[0] == ("work", started) and events[1][0] == "timer"
    assert not runs_inline()


async def test_tasks_started_inside_the_block_inherit_it_and_others_do_not(autojump_clock):
    seen: dict[str, bool] = {}

    async def report(name: str) -> None:
        seen[name] = runs_inline()

    async with trio.open_nursery() as outside:
        with inline_blocking_work():
            async with trio.open_nursery() as inside:
                inside.start_soon(report, "inside")
            outside.start_soon(report, "started from the block")
        outside.start_soon(report, "after the block")
    assert seen == {"inside": True, "started from the block": True, "after the block": False}
