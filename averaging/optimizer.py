"""The collaborative optimizer: many peers train one model toward a swarm-wide batch size.

Each peer accumulates gradients over its own batches and publishes its progress to the DHT. When
the swarm together has seen ``target_batch_size`` samples for the current epoch, every peer
averages its mean gradient with a group (weighted by its sample count, so the result is the
gradient of the whole swarm batch), steps the wrapped optimizer, and moves to the next epoch.
Every ``average_state_every`` epochs the parameters and the optimizer's state (Adam's moments,
momentum buffers, step counts: see ``optimizer_state.py``) are averaged too, which pulls back
together peers that stepped alone after a failed round. A peer more than one epoch behind (a late
joiner, or one that was stalled) loads parameters, optimizer state and epoch from a peer instead,
and moves its learning-rate scheduler forward to that epoch.

If averaging fails, the peer steps on its own gradients and says so: training never stops
because another peer misbehaved.

With ``delay_updates=nursery`` (Hivemind's delayed parameter updates) an epoch's gradients are
averaged in that nursery while the next epoch accumulates, and the step they make lands at the
first ``step()`` after the round is done: parameters are one epoch stale for a while, and
communication hides behind computation instead of stalling it. At most one round is in flight: if
the next epoch is ready first, it keeps accumulating until the round lands (the target batch size
is a minimum, so that epoch simply gets more samples) while its group forms ahead; the trainer
never waits for a round. The group formed ahead for a launched round is waited for in the
background as well. The epoch counts as done when the round starts, so the swarm's progress moves
on at once.

With a ``background`` nursery (or ``delay_updates``'s) a peer forms its group for the epoch's
round while it still accumulates, once the swarm is predicted to reach the target within the time
matchmaking takes (``match_ahead.py``): the step then costs the all-reduce alone. In that nursery
it also exchanges progress (publishes its record, reads the swarm's) and announces itself as a
donor, so no batch waits for a DHT round trip: ``step()`` decides on the view of the last
exchange, at most one refresh older than it would be otherwise. The first step still reads the
swarm before deciding, so a newcomer never starts an epoch the swarm has left.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from .averager import FormedGroup, GroupAverager
from .match_ahead import MatchAhead, matchmaking_due
from .optimizer_state import materialize_state, sanitize_state, state_tensors
from .progress import SwarmProgress
from .replica import (
    AveragingRecord,
    EpochStateAverager,
    Replica,
    ReplicaOptimizer,
    average_once,
    average_state,
    averaging_options,
)
from .state_sharing import StateUnavailable

__all__ = ["CollaborativeOptimizer"]

log = logging.getLogger("peerd.training")

# Below ~1M parameters, adding gradients into the accumulators takes well under a millisecond:
# doing it on the event loop beats a round trip through a worker thread (~0.1 ms) per batch.
INLINE_ACCUMULATE_NUMEL = 1 << 20
MAX_SCHEDULER_CATCH_UP = 100_000
# Epochs hold at least the target batch, and with delayed updates often many times more (an epoch
# ready while the last round averages keeps accumulating). The epoch evidence's bound on how fast
# claimed epochs may advance still divides by the target batch, the smallest epoch there can be:
# another peer's epochs are not ours (a peer whose rounds were slow counts large epochs of its own
# while a faster part of the swarm steps on small ones, as after a partition heals), and a bound
# from our own sizes would refuse that part's honest epoch.


@dataclass
class _DelayedRound:
    """A gradient round running in the background: the epoch it averages, and its record once done."""

    epoch: int
    weight: float
    group: Callable[[], Awaitable[FormedGroup | None]]  # waits for the group formed ahead, if one is
    record: AveragingRecord | None = None
    done: trio.Event = field(default_factory=trio.Event)  # averaged: its step may land
    exited: trio.Event = field(default_factory=trio.Event)  # the task is over, however it ended
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class CollaborativeOptimizer(ReplicaOptimizer):
    """Wraps any ``torch.optim`` optimizer. Call ``await opt.step(batch_size)`` after each
    ``loss.backward()``; it returns True when the swarm stepped (an epoch passed).

    Between swarm steps it only accumulates: ``step(n)`` after the gradients of the mean loss over
    several batches of ``n`` samples in all is the same as one ``step`` per batch."""

    accumulates_batches = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht,
        *,
        prefix: str,
        target_batch_size: int,
        scheduler: Any = None,
        clip_grad_norm: float | None = None,
        average_state_every: int = 5,
        target_group_size: int = 4,
        min_group_size: int = 2,
        matchmaking_timeout: float = 3.0,
        averaging_timeout: float = 15.0,
        settle_time: float | None = None,
        codec: str = "none",
        aggregation: str = "auto",
        uplink: float | None = None,
        progress_interval: float = 0.25,
        load_state_timeout: float = 30.0,
        delay_updates: trio.Nursery | None = None,
        background: trio.Nursery | None = None,
    ):
        self.optimizer = optimizer
        self.dht = dht
        self.prefix = prefix
        self.target_batch_size = target_batch_size
        self.scheduler = scheduler
        self._scheduler_done = False
        self.clip_grad_norm = clip_grad_norm
        self.average_state_every = average_state_every
        self.progress_interval = progress_interval
        self.load_state_timeout = load_state_timeout
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.gradients = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        self.delay_updates = delay_updates
        # What the averager averages: the accumulators themselves, or (delayed) a second set the
        # accumulators are copied into, so the next epoch can accumulate while the round runs.
        self._averaged = [g.clone() for g in self.gradients] if delay_updates is not None else self.gradients
        self._in_flight: _DelayedRound | None = None
        self._numel = sum(p.numel() for p in self.params)
        # Peers see the swarm reach the target within one progress refresh of each other, so
        # that is all the time declarations need to meet (matchmaking's own default would be a
        # fixed cost per epoch).
        averaging = averaging_options(
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            matchmaking_timeout=matchmaking_timeout,
            averaging_timeout=averaging_timeout,
            settle_time=settle_time if settle_time is not None else max(progress_interval, 0.05),
            aggregation=aggregation,
            uplink=uplink,  # bytes/s, if known: rounds pace their connections to share it
        )
        # Only gradients go through ``codec``: parameters and optimizer state are averaged exactly
        # (8-bit Adam moments or step counts would wreck the next steps).
        self.grad_averager = GroupAverager(
            self._averaged, dht, prefix=f"{prefix}.grads", allow_state_sharing=False, codec=codec, **averaging
        )
        # Created now (as a fresh optimizer's would be) so that peers list the same tensors from
        # the start and a newcomer has somewhere to load a donor's state into.
        self.optimizer_state = state_tensors(optimizer) if materialize_state(optimizer) else []
        self.replica = Replica(dht, prefix, self.params + self.optimizer_state, averaging, target_batch_size)
        # Groups formed while the epoch accumulates: the gradients' round, and the state's when the
        # step ends a state-averaging period.
        nursery = background if background is not None else delay_updates
        # Progress exchange and donor announcements leave the trainer's path only with delayed
        # updates, whose trainer never waits for a round; stepping in turn, a peer exchanges in line,
        # so its view of the swarm is fresh when it decides (a stale view after a partition healed
        # kept peers on old epochs in the lab).
        self._background = delay_updates
        self.match_ahead: MatchAhead | None = None
        self.state_ahead: MatchAhead | None = None
        if nursery is not None:
            self.match_ahead = MatchAhead(self.grad_averager, nursery, refresh_interval=progress_interval)
            self.state_ahead = MatchAhead(self.replica.state, nursery, refresh_interval=progress_interval)
        self.replica.state.epoch_of = self._served_epoch
        self.local_samples = 0
        self._last_fetch = -float("inf")
        self._epoch_started: float | None = None
        self._first_step = True

    @property
    def averaging_in_background(self) -> bool:
        """A delayed round is still running (its step has not landed yet)."""
        return self._in_flight is not None and not self._in_flight.done.is_set()

    @property
    def state_averager(self) -> EpochStateAverager:
        """Parameters and optimizer state: averaged every ``average_state_every`` epochs, and what
        newcomers download."""
        return self.replica.state

    async def step(self, batch_size: int) -> bool:
        if self._in_flight is not None and self._in_flight.done.is_set():
            await self._land_delayed()
        if self._numel <= INLINE_ACCUMULATE_NUMEL:
            self._accumulate(batch_size)  # a thread hop would cost more than the work
        else:
            await trio.to_thread.run_sync(self._accumulate, batch_size)
        self.local_samples += batch_size
        self._update_throughput(batch_size)
        replica = self.replica
        now = trio.current_time()
        if now - self._last_fetch >= self.progress_interval:
            self._last_fetch = now
            if self._background is None or self._first_step:
                await replica.exchange(self.local_samples)
            else:
                replica.exchange_soon(self._background, lambda: self.local_samples)
        view = replica.view(self.local_samples)
        # Behind by more than the normal skew of one epoch, or just joined a swarm that has made
        # progress (as the evidence says, not any one claim): our parameters are stale, take the
        # swarm's.
        if view.epoch > replica.epoch + 1 or (self._first_step and view.epoch > replica.epoch):
            self._first_step = False
            await self.load_state_from_peers(swarm_epoch=view.epoch)
            return False
        self._first_step = False
        if not view.ready_to_step(replica.epoch, self.target_batch_size):
            self._match_ahead(view)
            return False
        if self.delay_updates is not None and self._in_flight is not None:
            self._match_ahead(view)  # the last round still averages: this epoch gets more samples
            return False
        if self.delay_updates is not None:
            await self._launch_delayed()
        else:
            await self._averaged_step()
        return True

    async def load_state_from_peers(self, swarm_epoch: int | None = None) -> None:
        """Adopt a peer's parameters, optimizer state and epoch (we fell behind or just joined).
        ``swarm_epoch`` is the epoch the caller has evidence for; the donor's own claim is taken
        no further than one past it (``Replica.load_state_from_peers``).

        If no peer can send its state, move to the swarm's epoch with our own parameters: the
        next parameter averaging pulls them toward the swarm's, and training goes on."""
        replica = self.replica
        for ahead in (self.match_ahead, self.state_ahead):  # groups for an epoch we are leaving
            if ahead is not None:
                await ahead.cancel()
        if self._in_flight is not None:  # its step was computed for parameters we are replacing
            in_flight, self._in_flight = self._in_flight, None
            in_flight.scope.cancel()
            await in_flight.exited.wait()  # its buffers are ours again only once it is out
        try:
            await replica.load_state_from_peers(
                self.load_state_timeout, catch_up=self._catch_up_schedule, evidenced=swarm_epoch or 0
            )
        except StateUnavailable as error:
            if swarm_epoch is not None and swarm_epoch > replica.epoch:
                log.warning("%s; continuing from the swarm's epoch %d with local parameters", error, swarm_epoch)
                await replica.move_to_epoch(swarm_epoch, catch_up=self._catch_up_schedule)
                self._reset_accumulators()
            else:
                log.warning("%s", error)
            return
        await self._sanitize_state()
        self._reset_accumulators()
        log.info("joined the swarm at epoch %d with its parameters", replica.epoch)
        await replica.publish(self.local_samples)

    async def _catch_up_schedule(self, epochs: int) -> None:
        """Move the learning-rate schedule as far as the epoch jumps (the scheduler steps once per
        epoch, as in ``_apply_gradients``). The schedule jumps only as far as the epoch does, and
        the epoch only on evidence (``epoch_evidence.py``; a donor's claim is capped by it), so no
        single claim moves it further than one epoch past what the swarm's records back. The
        scheduler catches up at most MAX_SCHEDULER_CATCH_UP epochs (~0.3 s of work, in a thread),
        so an epoch given by a caller cannot hang this peer either."""
        if self.scheduler is None:
            return
        steps = min(epochs, MAX_SCHEDULER_CATCH_UP)
        if steps < epochs:
            log.warning("the swarm is %d epochs ahead; moving the scheduler %d only", epochs, steps)
        await trio.to_thread.run_sync(self._step_scheduler, steps)

    def _step_scheduler(self, steps: int = 1) -> None:
        """Step the LR scheduler; one that refuses (e.g. OneCycleLR past its total_steps, which an
        epoch from another peer can make it reach) keeps its last learning rate and is not asked
        again, rather than stopping training."""
        if self.scheduler is None or self._scheduler_done:
            return
        with warnings.catch_warnings():  # "scheduler stepped before optimizer": intended on catch-up
            warnings.simplefilter("ignore", UserWarning)
            try:
                for _ in range(steps):
                    self.scheduler.step()
            except Exception as error:
                self._scheduler_done = True
                log.warning("the LR scheduler refused to step (%s); keeping its last learning rate", error)

    async def _sanitize_state(self) -> None:
        """State that came from other peers is finite (the all-reduce refuses NaN) but may still
        be impossible, e.g. a negative second moment from a hostile peer, which would turn our
        parameters into NaN on the next step."""
        if self.optimizer_state:
            async with self.replica.state.locked_tensors():
                await trio.to_thread.run_sync(sanitize_state, self.optimizer)

    def _accumulate(self, batch_size: int) -> None:
        with torch.no_grad():
            for accumulator, param in zip(self.gradients, self.params, strict=True):
                if param.grad is not None:
                    accumulator.add_(param.grad.detach().to("cpu", torch.float32), alpha=batch_size)
                    param.grad = None

    def _update_throughput(self, batch_size: int) -> None:
        """Until the first epoch ends, the local rate; afterwards the rate over whole epochs."""
        now = trio.current_time()
        if self._epoch_started is None:
            self._epoch_started = now
        elif self.replica.epoch == 0 and now > self._epoch_started:
            self.replica.samples_per_s = self.local_samples / (now - self._epoch_started)

    def _reset_accumulators(self) -> None:
        for accumulator in self.gradients:
            accumulator.zero_()
        self.local_samples = 0

    async def _averaged_step(self) -> None:
        replica = self.replica
        samples = max(self.local_samples, 1)
        for accumulator in self.gradients:
            accumulator.div_(samples)
        record = await average_once(
            self.grad_averager,
            epoch=replica.epoch,
            weight=float(self.local_samples),
            fallback="stepping on local gradients",
            group=await self._group_formed_ahead(),
        )
        async with replica.state.locked_tensors():  # a donor never sends half a step
            await trio.to_thread.run_sync(self._apply_gradients)
        # A peer one epoch behind steps when it sees the swarm ahead, and so averages in the
        # swarm's round for the next epoch: it counts that epoch as done, as its group does, and
        # moves its schedule as far (``_apply_gradients`` stepped it for one epoch).
        counted = replica.epoch
        replica.count_round(record)
        self._step_scheduler(replica.epoch - counted - 1)
        self._reset_accumulators()
        self._update_epoch_throughput(samples)
        await self._after_step(record)

    async def _launch_delayed(self) -> None:
        """Hand this epoch's gradients to a round in the background and start the next epoch (only
        when no round is in flight: its buffers are the round's until it lands)."""
        assert self._in_flight is None
        replica = self.replica
        samples = max(self.local_samples, 1)
        for averaged, accumulator in zip(self._averaged, self.gradients, strict=True):
            torch.div(accumulator, samples, out=averaged)
        group = self.match_ahead.hand_over(replica.epoch) if self.match_ahead is not None else _no_group
        in_flight = _DelayedRound(replica.epoch, float(self.local_samples), group)
        self._in_flight = in_flight
        replica.count_round(None)  # provisional: a group one epoch ahead moves us once more on landing
        self._reset_accumulators()
        self._update_epoch_throughput(samples)
        assert self.delay_updates is not None
        self.delay_updates.start_soon(self._average_in_background, in_flight)
        replica.exchange_soon(self.delay_updates, lambda: self.local_samples)

    async def _average_in_background(self, in_flight: _DelayedRound) -> None:
        try:
            with in_flight.scope:
                in_flight.record = await average_once(
                    self.grad_averager,
                    epoch=in_flight.epoch,
                    weight=in_flight.weight,
                    fallback="stepping on local gradients",
                    group=await in_flight.group(),
                )
                in_flight.done.set()
        finally:
            in_flight.exited.set()

    async def _land_delayed(self) -> None:
        """Apply the step of the round that finished in the background."""
        in_flight = self._in_flight
        assert in_flight is not None and in_flight.record is not None
        replica = self.replica
        async with replica.state.locked_tensors():
            await trio.to_thread.run_sync(self._apply_gradients)
            self._in_flight = None  # with the step applied: donors serve these parameters as the epoch's
        record = in_flight.record
        if record.averaged and record.epoch > in_flight.epoch:  # as count_round: our group was ahead
            counted = replica.epoch
            replica.epoch = max(replica.epoch, in_flight.epoch + 2)
            self._step_scheduler(replica.epoch - counted)  # the schedule moves as far as the epoch
        await self._after_step(record)

    def _match_ahead(self, view: SwarmProgress) -> None:
        """Start forming this epoch's groups once the swarm is predicted to end it within the time
        that takes."""
        if self.match_ahead is None or self.state_ahead is None:
            return
        epoch = self.replica.epoch
        if not matchmaking_due(view, epoch, self.target_batch_size, self.match_ahead.lead):
            return
        self.match_ahead.start(epoch, round_number=epoch)
        if self.average_state_every and (epoch + 1) % self.average_state_every == 0:
            self.state_ahead.start(epoch + 1)  # _after_step averages the state at the next epoch

    async def _group_formed_ahead(self) -> FormedGroup | None:
        """The group formed for this epoch's round while it accumulated, if one was."""
        return None if self.match_ahead is None else await self.match_ahead.take(self.replica.epoch)

    def _served_epoch(self) -> int:
        """The epoch our parameters belong to, as donors tell newcomers: while a delayed round is in
        flight the epoch already counts as done but its step has not landed, so one less."""
        return self.replica.epoch - (1 if self._in_flight is not None else 0)

    def _update_epoch_throughput(self, samples: int) -> None:
        now = trio.current_time()
        if self._epoch_started is not None and now > self._epoch_started:
            self.replica.samples_per_s = samples / (now - self._epoch_started)  # including averaging time
        self._epoch_started = now

    async def _after_step(self, record: AveragingRecord) -> None:
        replica = self.replica
        replica.last_round = record
        if self._background is None:
            await replica.publish(self.local_samples)
            await replica.announce_state()
        else:
            replica.exchange_soon(self._background, lambda: self.local_samples)
            replica.announce_state_soon(self._background)
        if self.average_state_every and replica.epoch % self.average_state_every == 0:
            group = None if self.state_ahead is None else await self.state_ahead.take(replica.epoch)
            if await average_state(replica.state, replica.epoch, group=group):
                await self._sanitize_state()

    def _apply_gradients(self) -> None:
        for accumulator, param in zip(self._averaged, self.params, strict=True):
            param.grad = accumulator.to(param.device, param.dtype).clone()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step_scheduler()


async def _no_group() -> FormedGroup | None:
    return None
