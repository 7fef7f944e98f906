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

Two schedules, chosen by the caller, say what runs behind the trainer:

* ``updates``: ``ImmediateUpdates()`` (the default) steps on each epoch's round as it ends;
  ``DelayedUpdates(nursery)`` (Hivemind's delayed parameter updates) averages an epoch's
  gradients in that nursery while the next epoch accumulates, and the step lands at the first
  ``step()`` after the round is done; its progress exchanges and donor announcements go out in the
  nursery too, so no batch waits for a DHT round trip (``update_schedules.py``). The first step
  still reads the swarm before deciding, so a newcomer never starts an epoch the swarm has left.
* ``matching``: ``MatchAtStep()`` (the default) forms each round's group at the step;
  ``MatchAhead(nursery)`` forms it while the epoch still accumulates, once the swarm is predicted
  to reach the target within the time matchmaking takes (``match_ahead.py``): the step then costs
  the all-reduce alone.

Everything else about how it averages (group sizes, deadlines, codec, progress interval...) is one
``AveragingSettings`` (``settings.py``), given whole or as keyword arguments.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from peer.worker_threads import run_blocking

from .averager import FormedGroup, GroupAverager
from .compression import get_codec
from .contribution_scores import HeldOutGradient
from .match_ahead import GroupSource, MatchAtStep, Matching, matchmaking_due
from .optimizer_state import materialize_state, sanitize_state, state_tensors
from .progress import PROGRESS_TTL, SwarmProgress
from .replica import AveragingRecord, EpochStateAverager, Replica, ReplicaOptimizer, average_once, average_state
from .settings import COLLABORATIVE, AveragingSettings
from .state_sharing import StateUnavailable
from .update_schedules import ImmediateUpdates, UpdateSchedule

__all__ = ["CollaborativeOptimizer", "GradientSum", "LRSchedule"]

log = logging.getLogger("peerd.training")

# Below ~1M parameters, adding gradients into the accumulators takes well under a millisecond:
# doing it on the event loop beats a round trip through a worker thread (~0.1 ms) per batch.
INLINE_ACCUMULATE_NUMEL = 1 << 20
MAX_SCHEDULER_CATCH_UP = 100_000
# Matchmaking's deadline while no other peer's progress has been in view for a record's lifetime:
# a declaration whose store waits out a holder that left (the DHT's RPC timeout, 2 s), a settle
# and a read of the declarations, with room for a peer that started at the same moment.
ALONE_MATCHMAKING_S = 5.0


class LRSchedule:
    """A learning-rate scheduler stepped once per epoch, as far as the epoch moves."""

    def __init__(self, scheduler: Any = None):
        self.scheduler = scheduler
        self._refused = False

    def step(self, steps: int = 1) -> None:
        """Step the scheduler; one that refuses (e.g. OneCycleLR past its total_steps, which an
        epoch from another peer can make it reach) keeps its last learning rate and is not asked
        again, rather than stopping training."""
        if self.scheduler is None or self._refused:
            return
        with warnings.catch_warnings():  # "scheduler stepped before optimizer": intended on catch-up
            warnings.simplefilter("ignore", UserWarning)
            try:
                for _ in range(steps):
                    self.scheduler.step()
            except Exception as error:
                self._refused = True
                log.warning("the LR scheduler refused to step (%s); keeping its last learning rate", error)

    async def catch_up(self, epochs: int) -> None:
        """Move the schedule as far as the epoch jumps. The schedule jumps only as far as the epoch
        does, and the epoch only on evidence (``epoch_evidence.py``; a donor's claim is capped by
        it), so no single claim moves it further than one epoch past what the swarm's records
        back. The scheduler catches up at most MAX_SCHEDULER_CATCH_UP epochs (~0.3 s of work, in a
        thread), so an epoch given by a caller cannot hang this peer either."""
        if self.scheduler is None:
            return
        steps = min(epochs, MAX_SCHEDULER_CATCH_UP)
        if steps < epochs:
            log.warning("the swarm is %d epochs ahead; moving the scheduler %d only", epochs, steps)
        await run_blocking(self.step, steps)


class GradientSum:
    """An epoch's gradients so far: each batch's, weighted by its samples, and the samples."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.sums = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        self.samples = 0
        self.numel = sum(p.numel() for p in params)

    def add(self, batch_size: int) -> None:
        """Take the parameters' gradients (of the mean loss over ``batch_size`` samples) in."""
        with torch.no_grad():
            for total, param in zip(self.sums, self.params, strict=True):
                if param.grad is not None:
                    total.add_(param.grad.detach().to("cpu", torch.float32), alpha=batch_size)
                    param.grad = None
        self.samples += batch_size

    def mean_into(self, out: list[torch.Tensor]) -> None:
        """The mean gradient per sample so far, written to ``out`` (which may be ``sums``)."""
        samples = max(self.samples, 1)
        for target, total in zip(out, self.sums, strict=True):
            torch.div(total, samples, out=target)

    def reset(self) -> None:
        for total in self.sums:
            total.zero_()
        self.samples = 0


class CollaborativeOptimizer(ReplicaOptimizer):
    """Wraps any ``torch.optim`` optimizer. Call ``await opt.step(batch_size)`` after each
    ``loss.backward()``; it returns True when the swarm stepped (an epoch passed).

    Between swarm steps it only accumulates: ``step(n)`` after the gradients of the mean loss over
    several batches of ``n`` samples in all is the same as one ``step`` per batch.

    ``updates`` and ``matching``: the schedules above (defaults ``ImmediateUpdates()`` and
    ``MatchAtStep()``); ``settings``: how it averages (default ``settings.COLLABORATIVE``), with
    any of its fields given as keyword arguments instead (``matchmaking_timeout=2.0``).
    ``held_out``: the gradient of a held-out loss at given parameter values: each round, the
    shard this peer reduces scores the others' gradients against it at our parameters, and bans
    a sender whose gradients keep raising that loss (``contribution_scores.py``)."""

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
        updates: UpdateSchedule | None = None,
        matching: Matching | None = None,
        settings: AveragingSettings = COLLABORATIVE,
        held_out: HeldOutGradient | None = None,
        **setting_changes: Any,
    ):
        settings = settings.replace(**setting_changes)
        if settings.settle_time is None:
            # Peers see the swarm reach the target within one progress refresh of each other, so
            # that is all the time declarations need to meet (matchmaking's own default would be a
            # fixed cost per epoch).
            settings = settings.replace(settle_time=max(settings.progress_interval, 0.05))
        self.settings = settings
        self.optimizer = optimizer
        self.target_batch_size = target_batch_size
        self.lr_schedule = LRSchedule(scheduler)
        self.clip_grad_norm = clip_grad_norm
        self.updates: UpdateSchedule = updates if updates is not None else ImmediateUpdates()
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.accumulated = GradientSum(self.params)
        if get_codec(settings.codec).sparse:  # it would drop most of every gradient, for good
            raise ValueError(f"{settings.codec} is sparse: it needs error feedback, which local updates have")
        averaging = settings.averager_options()
        # Only gradients go through ``codec``: parameters and optimizer state are averaged exactly
        # (8-bit Adam moments or step counts would wreck the next steps). The averager averages
        # the accumulators themselves, or (delayed) a second set they are copied into, so the next
        # epoch can accumulate while the round runs.
        self.grad_averager = GroupAverager(
            self.updates.buffers(self.accumulated.sums),
            dht,
            prefix=f"{prefix}.grads",
            allow_state_sharing=False,
            codec=settings.codec,
            reference=None if held_out is None else lambda: held_out(self.params),
            **averaging,
        )
        # Created now (as a fresh optimizer's would be) so that peers list the same tensors from
        # the start and a newcomer has somewhere to load a donor's state into.
        self.optimizer_state = state_tensors(optimizer) if materialize_state(optimizer) else []
        self.replica = Replica(
            dht,
            prefix,
            self.params + self.optimizer_state,
            averaging,
            # Epochs hold at least the target batch (delayed, often more): the smallest epoch
            # there can be is what bounds how fast others' claimed epochs may advance, since a
            # faster part of the swarm may step on smaller epochs than ours.
            samples_per_epoch=target_batch_size,
            progress_interval=settings.progress_interval,
            served_epoch=self.updates.served_epoch,
        )
        # Groups formed while the epoch accumulates: the gradients' round, and the state's when the
        # step ends a state-averaging period.
        matching = matching if matching is not None else MatchAtStep()
        interval = settings.progress_interval
        self.grads_ahead: GroupSource = matching.for_averager(self.grad_averager, refresh_interval=interval)
        self.state_ahead: GroupSource = matching.for_averager(self.replica.state, refresh_interval=interval)
        self._epoch_started: float | None = None
        self._first_step = True

    @property
    def local_samples(self) -> int:
        """Samples accumulated in this epoch so far."""
        return self.accumulated.samples

    @property
    def scheduler(self) -> Any:
        return self.lr_schedule.scheduler

    @property
    def progress_interval(self) -> float:
        return self.settings.progress_interval

    @property
    def averaging_in_background(self) -> bool:
        """A delayed round is still running (its step has not landed yet)."""
        return self.updates.averaging

    @property
    def state_averager(self) -> EpochStateAverager:
        """Parameters and optimizer state: averaged every ``average_state_every`` epochs, and what
        newcomers download."""
        return self.replica.state

    async def step(self, batch_size: int) -> bool:
        await self.updates.land_finished(self)
        if self.accumulated.numel <= INLINE_ACCUMULATE_NUMEL:
            self.accumulated.add(batch_size)  # a thread hop would cost more than the work
        else:
            await run_blocking(self.accumulated.add, batch_size)
        self._update_throughput(batch_size)
        replica = self.replica
        if replica.exchange_due():
            if self._first_step:
                await replica.exchange(self.local_samples)
            else:
                await self.updates.exchange(replica, lambda: self.local_samples)
        view = replica.view(self.local_samples)
        # Behind by more than the normal skew of one epoch, or just joined a swarm that has made
        # progress (as the evidence says, not any one claim): our parameters are stale, take the
        # swarm's.
        if view.epoch > replica.epoch + 1 or (self._first_step and view.epoch > replica.epoch):
            self._first_step = False
            await self.load_state_from_peers(swarm_epoch=view.epoch)
            return False
        self._first_step = False
        if view.ready_to_step(replica.epoch, self.target_batch_size) and await self.updates.end_epoch(self):
            return True
        self._match_ahead(view)  # not ready, or the last round still averages: more samples
        return False

    async def load_state_from_peers(self, swarm_epoch: int | None = None) -> None:
        """Adopt a peer's parameters, optimizer state and epoch (we fell behind or just joined).
        ``swarm_epoch`` is the epoch the caller has evidence for; the donor's own claim is taken
        no further than one past it (``Replica.load_state_from_peers``).

        If no peer can send its state, move to the swarm's epoch with our own parameters: the
        next parameter averaging pulls them toward the swarm's, and training goes on."""
        replica = self.replica
        for ahead in (self.grads_ahead, self.state_ahead):  # groups for an epoch we are leaving
            await ahead.cancel()
        await self.updates.abandon()
        catch_up = self.lr_schedule.catch_up
        try:
            counted = await replica.load_state_from_peers(
                self.settings.load_state_timeout, catch_up=catch_up, evidenced=swarm_epoch or 0
            )
        except StateUnavailable as error:
            if swarm_epoch is not None and swarm_epoch > replica.epoch:
                log.warning("%s; continuing from the swarm's epoch %d with local parameters", error, swarm_epoch)
                await replica.move_to_epoch(swarm_epoch, catch_up=catch_up)
                self.accumulated.reset()
            else:
                log.warning("%s", error)
            return
        await self._sanitize_state()
        self.accumulated.reset()
        joining = await self.updates.joining_epoch(replica.epoch, counted, lambda: replica.fetch(self.local_samples))
        await replica.move_to_epoch(joining, catch_up=catch_up)
        log.info("joined the swarm at epoch %d with its parameters", replica.epoch)
        await replica.publish(self.local_samples)

    async def _sanitize_state(self) -> None:
        """State that came from other peers is finite (the all-reduce refuses NaN) but may still
        be impossible, e.g. a negative second moment from a hostile peer, which would turn our
        parameters into NaN on the next step."""
        if self.optimizer_state:
            async with self.replica.state.locked_tensors():
                await run_blocking(sanitize_state, self.optimizer)

    def _update_throughput(self, batch_size: int) -> None:
        """Until the first epoch ends, the local rate; afterwards the rate over whole epochs."""
        now = trio.current_time()
        if self._epoch_started is None:
            self._epoch_started = now
        elif self.replica.epoch == 0 and now > self._epoch_started:
            self.replica.samples_per_s = self.local_samples / (now - self._epoch_started)

    # What an update schedule (update_schedules.SwarmStep) drives:

    async def averaged_step(self) -> None:
        replica = self.replica
        samples = max(self.local_samples, 1)
        self.accumulated.mean_into(self.accumulated.sums)
        record = await average_once(
            self.grad_averager,
            epoch=replica.epoch,
            weight=float(self.local_samples),
            fallback="stepping on local gradients",
            group=await self.grads_ahead.take(replica.epoch),
            timeout=self._matchmaking_timeout(),
        )
        async with replica.state.locked_tensors():  # a donor never sends half a step
            await run_blocking(self._apply_gradients)
        # A peer one epoch behind steps when it sees the swarm ahead, and so averages in the
        # swarm's round for the next epoch: it counts that epoch as done, as its group does, and
        # moves its schedule as far (``_apply_gradients`` stepped it for one epoch).
        self.lr_schedule.step(replica.count_round(record) - 1)
        self.accumulated.reset()
        self._update_epoch_throughput(samples)
        await self._after_step(record)

    def close_epoch(self) -> float:
        replica = self.replica
        samples, weight = max(self.local_samples, 1), float(self.local_samples)
        self.accumulated.mean_into(self.grad_averager.tensors)
        replica.count_round(None)  # provisional: a group one epoch ahead moves us once more on landing
        self.accumulated.reset()
        self._update_epoch_throughput(samples)
        return weight

    async def average_gradients(
        self, epoch: int, weight: float, group: Callable[[], Awaitable[FormedGroup | None]]
    ) -> AveragingRecord:
        return await average_once(
            self.grad_averager,
            epoch=epoch,
            weight=weight,
            fallback="stepping on local gradients",
            group=await group(),
            timeout=self._matchmaking_timeout(),
        )

    async def land(self, record: AveragingRecord, launched_at: int, landed: Callable[[], None]) -> None:
        replica = self.replica
        async with replica.state.locked_tensors():
            await run_blocking(self._apply_gradients)
            landed()
        # counted at the launch; a group that was an epoch ahead moves us (and the schedule) once more
        self.lr_schedule.step(replica.count_round(record, launched_at=launched_at))
        await self._after_step(record)

    def _match_ahead(self, view: SwarmProgress) -> None:
        """Start forming this epoch's groups once the swarm is predicted to end it within the time
        that takes (not alone: a group that cannot form would hold the step for the deadline)."""
        epoch = self.replica.epoch
        if self._matchmaking_timeout() is not None:  # alone: the step matches, briefly
            return
        if not matchmaking_due(view, epoch, self.target_batch_size, self.grads_ahead.lead):
            return
        self.grads_ahead.start(epoch, round_number=epoch)
        every = self.settings.average_state_every
        if every and (epoch + 1) % every == 0:
            self.state_ahead.start(epoch + 1)  # _after_step averages the state at the next epoch

    def _matchmaking_timeout(self) -> float | None:
        """Matchmaking's deadline for this step: the settings' (None) while another peer's progress
        was in view within a record's lifetime (a read that failed, or found its cell empty, is no
        news that the others left); with none (the first peer of a swarm, or one training alone) at
        most ``ALONE_MATCHMAKING_S``, instead of the whole deadline every epoch: the deadline is set
        for groups on a WAN to form in."""
        seen = self.replica.others_seen_at
        if seen is not None and trio.current_time() - seen < PROGRESS_TTL:
            return None
        return min(self.settings.matchmaking_timeout, ALONE_MATCHMAKING_S)

    def _update_epoch_throughput(self, samples: int) -> None:
        now = trio.current_time()
        if self._epoch_started is not None and now > self._epoch_started:
            self.replica.samples_per_s = samples / (now - self._epoch_started)  # including averaging time
        self._epoch_started = now

    async def _after_step(self, record: AveragingRecord) -> None:
        replica = self.replica
        await self.updates.after_step(replica, lambda: self.local_samples)
        every = self.settings.average_state_every
        if every and replica.epoch % every == 0:
            group = await self.state_ahead.take(replica.epoch)
            if await average_state(replica.state, replica.epoch, group=group, timeout=self._matchmaking_timeout()):
                await self._sanitize_state()

    def _apply_gradients(self) -> None:
        for accumulator, param in zip(self.grad_averager.tensors, self.params, strict=True):
            param.grad = accumulator.to(param.device, param.dtype).clone()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_schedule.step()
