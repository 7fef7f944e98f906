"""When a collaborative epoch's step lands: at once, after its round (``ImmediateUpdates``, the
default), or one epoch late, its round averaging in the background while the next epoch
accumulates (``DelayedUpdates(nursery)``: Hivemind's delayed parameter updates).

Both drive a ``SwarmStep`` (the ``CollaborativeOptimizer``) through the same few moves, as
``local_rounds.py``'s schedules drive a local-updates optimizer; they differ in when the averaging
runs, which step lands, and whether progress records go out in line or in the background.

Delayed: parameters are one epoch stale for a while, and communication hides behind computation
instead of stalling it. At most one round is in flight: if the next epoch is ready first, it keeps
accumulating until the round lands (the target batch size is a minimum, so that epoch simply gets
more samples) while its group forms ahead; the trainer never waits for a round. The group formed
ahead for a launched round is waited for in the background as well. The epoch counts as done when
the round starts, so the swarm's progress moves on at once. Progress exchanges and donor
announcements go out in the same nursery, so no batch waits for a DHT round trip either.
Immediate: a peer exchanges in line, so its view of the swarm is fresh when it decides (a stale
view after a partition healed kept peers on old epochs in the lab).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import trio

from .averager import FormedGroup
from .later import Later
from .match_ahead import GroupSource
from .progress import SwarmProgress
from .replica import AveragingRecord, Replica

__all__ = ["DelayedUpdates", "ImmediateUpdates", "SwarmStep", "UpdateSchedule"]

log = logging.getLogger("peerd.training")


class SwarmStep(Protocol):
    """What a schedule needs from the optimizer whose epochs it ends."""

    @property
    def replica(self) -> Replica: ...

    @property
    def grads_ahead(self) -> GroupSource: ...

    @property
    def local_samples(self) -> int: ...

    async def averaged_step(self) -> None:
        """Average this epoch's gradients now, step on them, count the epoch."""
        ...

    def close_epoch(self) -> float:
        """Hand this epoch's mean gradients to the averager's tensors, count the epoch (for now as
        our own) and start the next; returns the epoch's weight (its samples)."""
        ...

    async def average_gradients(
        self, epoch: int, weight: float, group: Callable[[], Awaitable[FormedGroup | None]]
    ) -> AveragingRecord:
        """Average the averager's tensors for ``epoch`` (in the group ``group()`` gives, if any)."""
        ...

    async def land(self, record: AveragingRecord, launched_at: int, landed: Callable[[], None]) -> None:
        """Step on the averaged gradients of the round launched at ``launched_at``; ``landed()`` is
        called once the step is applied, before anyone may read the new parameters."""
        ...


class UpdateSchedule(Protocol):
    @property
    def in_flight(self) -> bool:
        """A round's step has not landed yet (its buffers are the round's)."""
        ...

    @property
    def averaging(self) -> bool:
        """A round still averages in the background."""
        ...

    def buffers(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the gradients' averager averages: the accumulators, or a set of their own."""
        ...

    def served_epoch(self, epoch: int) -> int:
        """The epoch our parameters belong to, at replica epoch ``epoch`` (what donors tell)."""
        ...

    async def joining_epoch(self, loaded: int, counted: int, swarm: Callable[[], Awaitable[SwarmProgress]]) -> int:
        """The epoch to take after loading the parameters of epoch ``loaded`` from a donor that
        has counted ``counted`` epochs (``loaded``, or one more: ``Replica.load_state_from_peers``);
        ``swarm()`` reads the swarm's progress now, where the schedule needs it."""
        ...

    async def land_finished(self, run: SwarmStep) -> None:
        """Land the step of a round that finished in the background, if one did."""
        ...

    async def end_epoch(self, run: SwarmStep) -> bool:
        """The swarm reached the target batch: average and step; False if the epoch goes on."""
        ...

    async def abandon(self) -> None:
        """The optimizer is loading a donor's state: drop the round in flight, if any."""
        ...

    async def exchange(self, replica: Replica, samples: Callable[[], int]) -> None:
        """Publish our progress record and read the swarm's (``samples()``: this epoch's so far)."""
        ...

    async def after_step(self, replica: Replica, samples: Callable[[], int]) -> None:
        """A step landed: tell the swarm our progress, and newcomers that we serve this state."""
        ...


class ImmediateUpdates:
    """Each epoch averages before its step: the step is never stale, and the trainer waits for
    the round (and for the progress exchange) in line."""

    in_flight = False
    averaging = False

    def buffers(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        return gradients

    def served_epoch(self, epoch: int) -> int:
        return epoch

    async def joining_epoch(self, loaded: int, counted: int, swarm: Callable[[], Awaitable[SwarmProgress]]) -> int:
        """The loaded epoch: an epoch of ours ends only once its round is done, so a round the
        swarm still gathers for that epoch can take us in. (A donor with delayed updates may serve
        the epoch before its own; a swarm that mixes the schedules is not what this is tuned for.)"""
        return loaded

    async def land_finished(self, run: SwarmStep) -> None:
        """Nothing is ever in flight between two steps."""

    async def end_epoch(self, run: SwarmStep) -> bool:
        await run.averaged_step()
        return True

    async def abandon(self) -> None:
        """Nothing is ever in flight between two steps."""

    async def exchange(self, replica: Replica, samples: Callable[[], int]) -> None:
        await replica.exchange(samples())

    async def after_step(self, replica: Replica, samples: Callable[[], int]) -> None:
        await replica.publish(samples())
        await replica.announce_state()


@dataclass(frozen=True)
class _DelayedRound:
    epoch: int  # the epoch it averages
    record: Later[AveragingRecord]


class DelayedUpdates:
    """An epoch's round averages in ``background`` while the next epoch accumulates; its step lands
    at the first step after the round is done. Holds the round in flight, so each optimizer needs
    its own. A caller that delays its updates usually forms the next group ahead too
    (``MatchAhead`` in ``match_ahead.py``, the optimizer's ``matching``): the daemon does."""

    def __init__(self, background: trio.Nursery):
        self.background = background
        self._in_flight: _DelayedRound | None = None
        self._run: SwarmStep | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def averaging(self) -> bool:
        return self._in_flight is not None and not self._in_flight.record.ready

    def buffers(self, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        """A set of the averager's own, so the next epoch can accumulate while the round runs."""
        return [g.clone() for g in gradients]

    def served_epoch(self, epoch: int) -> int:
        """While a round is in flight its epoch already counts as done but its step has not
        landed: our parameters are one epoch older."""
        return epoch - (1 if self._in_flight is not None else 0)

    async def joining_epoch(self, loaded: int, counted: int, swarm: Callable[[], Awaitable[SwarmProgress]]) -> int:
        """The donor's count, or one past the loaded epoch where the swarm's progress, read again
        now, backs it (the swarm moved on while the state downloaded). A donor whose round is in
        flight serves the parameters of the epoch before its own (``served_epoch``), whose round
        averages already, out of our reach: at that epoch we would match for a round that goes on
        without us, fail at the matchmaking deadline, find ourselves behind and load again, for as
        long as every load meets a round in flight. At the swarm's epoch we accumulate and match
        with it at once, claiming no further than an honest donor's count (``counted`` is bounded
        by the evidence, as the donor's epoch is: ``Replica.load_state_from_peers``); our
        parameters lack that round's step until a state averaging (``average_state_every``) gives
        the group's members the same."""
        if counted > loaded:
            return counted
        try:
            evidenced = (await swarm()).epoch
        except Exception as error:  # (exchanges run in the background here: none may stop the trainer)
            log.warning(
                "reading the swarm's progress after loading state failed (%s); staying at epoch %d", error, loaded
            )
            return loaded
        return max(loaded, min(loaded + 1, evidenced))

    async def land_finished(self, run: SwarmStep) -> None:
        in_flight = self._in_flight
        if in_flight is None or not in_flight.record.ready:
            return

        def landed() -> None:  # with the step applied: donors serve these parameters as the epoch's
            self._in_flight = None

        await run.land(in_flight.record.value(), in_flight.epoch, landed)

    async def end_epoch(self, run: SwarmStep) -> bool:
        """Hand this epoch's gradients to a round in the background and start the next epoch (only
        when no round is in flight: its buffers are the round's until it lands)."""
        if self._run is not None and self._run is not run:
            raise RuntimeError("a DelayedUpdates schedule holds one optimizer's round: make one per optimizer")
        self._run = run
        if self._in_flight is not None:
            return False  # the last round still averages: this epoch gets more samples
        epoch = run.replica.epoch
        group = run.grads_ahead.hand_over(epoch)
        weight = run.close_epoch()
        record = Later(self.background, functools.partial(run.average_gradients, epoch, weight, group))
        self._in_flight = _DelayedRound(epoch, record)
        await self.exchange(run.replica, lambda: run.local_samples)
        return True

    async def abandon(self) -> None:
        """Its step was computed for parameters we are replacing: cancel it, and wait until it is
        out (its buffers are ours again only then)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.record.cancel()
            await in_flight.record.wait()

    async def exchange(self, replica: Replica, samples: Callable[[], int]) -> None:
        replica.exchange_soon(self.background, samples)

    async def after_step(self, replica: Replica, samples: Callable[[], int]) -> None:
        replica.exchange_soon(self.background, samples)
        replica.announce_state_soon(self.background)
