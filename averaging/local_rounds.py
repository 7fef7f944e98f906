"""How a local-updates round ends: average, then step (``SequentialRounds``), or step on the
previous round's average while this round's averages in the background (``OverlappedRounds``).

Both drive a ``LocalRound`` (the optimizer) through the same few moves; they differ in when the
averaging runs, which outer step lands, and whether progress records go out in line or, between
overlapped rounds, in the background (so the inner steps never wait for the DHT).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
import trio

from peer.worker_threads import run_blocking

from .later import Later
from .replica import AveragingRecord, Replica

__all__ = ["LocalRound", "OuterMoves", "RoundSchedule", "SequentialRounds", "OverlappedRounds"]


class OuterMoves(Protocol):
    """The outer step of what a round averages (the whole model, or a fragment of it:
    ``outer_fragments.RoundFragment``)."""

    def compute_deltas(self) -> None: ...

    def compute_deltas_and_anchor(self) -> list[torch.Tensor]: ...

    def apply(self) -> None: ...

    def apply_delayed(self, anchor: list[torch.Tensor]) -> None: ...


class LocalRound(Protocol):
    """What a schedule needs from the optimizer whose rounds it ends."""

    @property
    def epoch(self) -> int: ...

    @property
    def outer_step(self) -> OuterMoves:
        """What the current round (``epoch``) averages and steps."""
        ...

    async def average_deltas(self, epoch: int, weight: float) -> AveragingRecord:
        """Average the deltas of the round of ``epoch`` with the swarm (on failure they stay this
        peer's own)."""
        ...

    async def advance(self, apply: Callable[[], None], record: AveragingRecord | None) -> None:
        """Run ``apply`` (an outer step) in a thread and count the round that ``record`` (its
        averaging) belonged to, as one change."""
        ...

    async def finish_round(self) -> None:
        """Start the next round's local steps; publish progress; average the start if it is time."""
        ...

    def restart_round(self) -> None:
        """Start the next round's local steps without an outer step."""
        ...


class RoundSchedule(Protocol):
    async def end_round(self, run: LocalRound, weight: float) -> bool:
        """End the round whose local steps just finished; True if an outer step landed."""
        ...

    async def abandon(self) -> None:
        """The optimizer is loading a donor's state: drop the round in flight, if any (its outer
        step would land on a start we no longer hold)."""
        ...

    async def exchange(self, replica: Replica, samples: Callable[[], int]) -> None:
        """Publish our progress record and read the swarm's (``samples()``: this round's so far)."""
        ...

    async def after_round(self, replica: Replica, samples: Callable[[], int]) -> None:
        """A round finished: tell the swarm our progress, and newcomers that we serve this state."""
        ...


class SequentialRounds:
    """Each round averages before the next begins: the outer step is never stale, and the swarm's
    communication stalls local training for as long as it takes."""

    async def end_round(self, run: LocalRound, weight: float) -> bool:
        await run_blocking(run.outer_step.compute_deltas)
        record = await run.average_deltas(run.epoch, weight)
        await run.advance(run.outer_step.apply, record)
        await run.finish_round()
        return True

    async def abandon(self) -> None:
        """Nothing is ever in flight between two of our rounds."""

    async def exchange(self, replica: Replica, samples: Callable[[], int]) -> None:
        await replica.exchange(samples())

    async def after_round(self, replica: Replica, samples: Callable[[], int]) -> None:
        await replica.publish(samples())
        await replica.announce_state()
        await replica.fetch(samples())


class OverlappedRounds:
    """The averaging of round t runs in ``background`` while round t+1's local steps proceed; round
    t's outer step lands at the end of round t+1, carrying the local progress made meanwhile
    (``params = outer_step(start_t, avg delta_t) + (params_now - params_at_end_of_t)``): the swarm's
    communication hides behind computation, at the price of outer steps one round stale (the
    "delayed" variant of overlapped DiLoCo). When training stops, the averaging in flight is
    cancelled with the nursery and its outer step never lands.

    Holds the round in flight, so each optimizer needs its own."""

    def __init__(self, background: trio.Nursery):
        self.background = background
        self._record: Later[AveragingRecord] | None = None  # the averaging in flight
        self._anchor: list[torch.Tensor] = []  # our parameters when the delta in flight was taken
        self._moves: OuterMoves | None = None  # what the round in flight steps (a fragment may be the next one's)
        self._run: LocalRound | None = None

    async def end_round(self, run: LocalRound, weight: float) -> bool:
        if self._run is not None and self._run is not run:
            raise RuntimeError("an OverlappedRounds schedule holds one optimizer's round: make one per optimizer")
        self._run = run
        stepped = False
        if self._record is not None:
            record = await self._record.wait()  # bounded by the averager's own deadlines
            moves, anchor = self._moves, self._anchor
            await run.advance(lambda: moves.apply_delayed(anchor), record)
            await run.finish_round()
            stepped = True
        else:
            run.restart_round()
        self._moves = run.outer_step
        self._anchor = await run_blocking(self._moves.compute_deltas_and_anchor)
        self._record = Later(self.background, functools.partial(run.average_deltas, run.epoch, weight))
        return stepped

    async def abandon(self) -> None:
        """Cancel the averaging in flight and forget its round: its outer step never lands."""
        record, self._record, self._anchor, self._moves = self._record, None, [], None
        if record is not None:
            record.cancel()
            await record.wait()

    async def exchange(self, replica: Replica, samples: Callable[[], int]) -> None:
        replica.exchange_soon(self.background, samples)

    async def after_round(self, replica: Replica, samples: Callable[[], int]) -> None:
        replica.exchange_soon(self.background, samples)
        replica.announce_state_soon(self.background)
