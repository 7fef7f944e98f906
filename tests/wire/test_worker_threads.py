"""Blocking work and trio's virtual clock (``peer/worker_threads.py``): in a worker thread the
clock moves on while the work runs; inside ``inline_blocking_work`` it cannot. A ``ComputeThread``
runs every piece of its work on one thread, in turn."""

from __future__ import annotations

import hashlib
import threading

import pytest
import trio

from peer.worker_threads import ComputeThread, inline_blocking_work, run_blocking, runs_inline


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


async def test_a_compute_thread_runs_every_piece_of_work_on_one_thread_in_order():
    compute = ComputeThread("test-compute")
    handed_over: list[int] = []
    seen: list[tuple[int, int]] = []

    def work(index: int) -> int:
        seen.append((index, threading.get_ident()))
        return index * 10

    async def submit(index: int) -> None:
        handed_over.append(index)  # (``run`` queues the work before it first yields)
        assert await compute.run(work, index) == index * 10

    async with trio.open_nursery() as nursery:
        for index in range(8):
            nursery.start_soon(submit, index)
    assert [index for index, _ in seen] == handed_over and sorted(handed_over) == list(range(8))
    threads = {thread for _, thread in seen}
    assert len(threads) == 1 and threads != {threading.get_ident()}  # one thread, not the loop's


async def test_a_compute_threads_error_reaches_its_caller_and_the_thread_works_on():
    compute = ComputeThread("test-compute")

    def fail() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await compute.run(fail)
    assert await compute.run(lambda: "still here") == "still here"


async def test_a_cancelled_caller_gets_its_work_done_and_is_cancelled_at_its_next_checkpoint():
    compute = ComputeThread("test-compute")
    started, release = threading.Event(), threading.Event()
    outcome: list[str] = []

    def work() -> str:
        started.set()
        release.wait(10)
        return "done"

    async def caller(scope: trio.CancelScope) -> None:
        with scope:
            outcome.append(await compute.run(work))
            await trio.lowlevel.checkpoint()
            outcome.append("not cancelled")
        outcome.append("cancelled" if scope.cancelled_caught else "scope left")

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller, scope)
        await trio.to_thread.run_sync(started.wait, 10)
        scope.cancel()
        await trio.sleep(0.05)
        assert outcome == []  # the caller still waits for its work
        release.set()
    assert outcome == ["done", "cancelled"]


async def test_work_of_a_caller_cancelled_before_it_is_handed_over_never_runs():
    compute = ComputeThread("test-compute")
    ran: list[bool] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await compute.run(ran.append, True)
    assert scope.cancelled_caught and ran == [] and not compute.alive


async def test_a_thread_that_cannot_start_fails_its_caller_and_the_next_work_starts_one(monkeypatch):
    compute = ComputeThread("test-compute")
    real_start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    ran: list[str] = []
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start"):
        await compute.run(ran.append, "refused")
    monkeypatch.setattr(threading.Thread, "start", real_start)
    with trio.fail_after(5):
        await compute.run(ran.append, "next")
    assert ran == ["next"]  # the refused caller's work was taken back, not run later


async def test_an_idle_compute_thread_ends_and_the_next_work_starts_another():
    compute = ComputeThread("test-compute", idle_s=0.05)
    first = await compute.run(threading.get_ident)
    assert compute.alive
    while compute.alive:  # (the thread's own timeout ends it)
        await trio.sleep(0.01)
    second = await compute.run(threading.get_ident)
    assert second != threading.get_ident() and first != threading.get_ident()
    assert compute.alive


async def test_inside_inline_blocking_work_a_compute_thread_runs_on_the_loop(autojump_clock):
    compute = ComputeThread("test-compute")
    with inline_blocking_work():
        assert await compute.run(threading.get_ident) == threading.get_ident()
    assert not compute.alive
