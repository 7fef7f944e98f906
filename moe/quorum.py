"""Waiting for enough experts: the fault-tolerance rule shared by a mixture's forward and backward.

A mixture sends each sample to several experts; some of them will be slow or dead. The rule
(Hivemind's): wait until every sample has answers from at least ``k_min`` of its experts, then give
the stragglers ``timeout_after_k_min`` more seconds, and never wait longer than ``timeout`` in
all. Whatever has not answered by then is treated as failed and masked out by the caller.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

__all__ = ["QuorumTracker", "gather_with_quorum"]

log = logging.getLogger("peerd.moe")


class QuorumTracker:
    """Counts answers per sample (sans-I/O): ``satisfied`` once each sample has ``k_min`` answers
    or nothing left to wait for."""

    def __init__(self, samples_of_call: Sequence[Sequence[int]], batch_size: int, k_min: int):
        self.samples_of_call = samples_of_call
        self.k_min = k_min
        self.answers = [0] * batch_size
        self.outstanding = [0] * batch_size
        for samples in samples_of_call:
            for sample in samples:
                self.outstanding[sample] += 1
        self._short = sum(1 for a, o in zip(self.answers, self.outstanding, strict=True) if a < k_min and o > 0)

    def finished(self, call: int, ok: bool) -> None:
        for sample in self.samples_of_call[call]:
            was_short = self.answers[sample] < self.k_min and self.outstanding[sample] > 0
            self.outstanding[sample] -= 1
            if ok:
                self.answers[sample] += 1
            now_short = self.answers[sample] < self.k_min and self.outstanding[sample] > 0
            self._short += int(now_short) - int(was_short)

    @property
    def satisfied(self) -> bool:
        return self._short == 0

    def short_samples(self) -> list[int]:
        """Samples with fewer than ``k_min`` answers (after the wait: the ones that failed)."""
        return [sample for sample, answers in enumerate(self.answers) if answers < self.k_min]


async def gather_with_quorum(
    calls: Sequence[Callable[[], Awaitable[Any]]],
    samples_of_call: Sequence[Sequence[int]],
    batch_size: int,
    *,
    k_min: int,
    timeout: float,
    timeout_after_k_min: float,
) -> tuple[list[Any], QuorumTracker]:
    """Run ``calls`` concurrently under the quorum rule. Returns each call's result (None where it
    failed or was cut off) and the tracker, whose ``short_samples()`` the caller checks."""
    tracker = QuorumTracker(samples_of_call, batch_size, k_min)
    results: list[Any] = [None] * len(calls)
    quorum = trio.Event()
    remaining = len(calls)
    all_done = trio.Event()
    if tracker.satisfied:
        quorum.set()
    if not calls:
        all_done.set()

    async def run(index: int) -> None:
        nonlocal remaining
        ok = False
        try:
            results[index] = await calls[index]()
            ok = True
        except Exception as error:  # a failed expert is masked, not fatal
            log.info("expert call failed: %s", error)
        finally:
            tracker.finished(index, ok)
            remaining -= 1
            if tracker.satisfied:
                quorum.set()
            if not remaining:
                all_done.set()

    with trio.move_on_after(timeout if timeout is not None else math.inf):
        async with trio.open_nursery() as nursery:
            for index in range(len(calls)):
                nursery.start_soon(run, index)
            await quorum.wait()
            with trio.move_on_after(timeout_after_k_min):
                await all_done.wait()
            nursery.cancel_scope.cancel()
    return results, tracker
