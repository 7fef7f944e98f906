"""What both optimizers share: this peer's replica of the swarm's model, as the swarm sees it.

A replica has an epoch (swarm steps, or outer rounds, completed), a state that newcomers download
from it (parameters and optimizer state, or the shared start and outer momentum), a progress record
in the DHT, and a record of how its last averaging round went. ``CollaborativeOptimizer`` and
``LocalUpdatesOptimizer`` differ in what they average and when; each composes one ``Replica`` for
the rest, and ``ReplicaOptimizer`` gives both the same read-only face for the daemon's trainer.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from peer import PeerID

from .allreduce import AllReduceError, AllReduceResult
from .averager import FormedGroup, GroupAverager
from .group import is_counter
from .matchmaking import LeaderFailed, MatchmakingError, NoOtherPeers
from .progress import PeerProgress, ProgressTracker, SwarmProgress

__all__ = [
    "AveragingRecord",
    "FAILURE_REASONS",
    "EpochStateAverager",
    "Replica",
    "ReplicaOptimizer",
    "average_once",
    "average_state",
]

log = logging.getLogger("peerd.training")

# Averagers whose peer has been told it is alone: a lone peer (the first of a swarm, or the last)
# fails to find a group every round, and a warning each time (every few seconds) would bury the
# log; it is said once per lonely stretch, then at DEBUG until a round averages again.
_alone: weakref.WeakSet[GroupAverager] = weakref.WeakSet()


# Why a round did not average: no group formed in time, the group's leader vanished, the
# all-reduce failed, or something unexpected (a bug: it is logged with its traceback).
FAILURE_REASONS = ("no_group", "leader_failed", "allreduce", "error")


@dataclass(frozen=True)
class AveragingRecord:
    """How the averaging of one epoch went: with how many peers (this one included) and which of
    them failed; ``averaged`` False means the peer went on with its own tensors. ``epoch`` is the
    epoch the round belonged to: this peer's own, or a newer one its group had declared."""

    epoch: int
    averaged: bool = False
    group: int = 0
    failed: tuple[str, ...] = ()
    # the other members that took part without failing: they vouch for the epoch they reached
    peers: tuple[PeerID, ...] = ()
    # For operators (the daemon's metrics and dashboard): where the round's time went, what it
    # moved, and why it did not average (one of FAILURE_REASONS).
    seconds: float = 0.0  # the whole attempt, matchmaking included
    matchmaking_s: float | None = None  # None: no group formed
    allreduce_s: float | None = None  # None: no all-reduce finished
    # bytes this peer sent and received while the round ran: all its traffic, so also the DHT's
    # (a small share next to a round's tensors)
    bytes: int = 0
    failure: str | None = None
    alone: bool = False  # no other peer declared the round: this peer is the swarm, for now
    # what the all-reduce did (None: no round finished): error feedback reads where parts fell
    result: AllReduceResult | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the daemon's ``/status`` reports as ``last_averaging``."""
        return {"epoch": self.epoch, "averaged": self.averaged, "group": self.group, "failed": list(self.failed)}


class EpochStateAverager(GroupAverager):
    """A GroupAverager over model state that also tells newcomers the training epoch, read from
    ``epoch_of()`` (the replica that owns it) whenever a newcomer asks: the epoch its parameters
    belong to, and ``counted_of()``, the epochs it has counted (one more while a delayed round is
    in flight: ``update_schedules.DelayedUpdates``)."""

    def __init__(self, epoch_of: Callable[[], int], *args: Any, counted_of: Callable[[], int], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.epoch_of = epoch_of
        self.counted_of = counted_of

    def state_metadata(self) -> Any:
        return {**super().state_metadata(), "epoch": self.epoch_of(), "counted_epoch": self.counted_of()}


async def average_once(
    averager: GroupAverager,
    *,
    epoch: int,
    weight: float,
    fallback: str,
    group: FormedGroup | None = None,
    timeout: float | None = None,
) -> AveragingRecord:
    """Average the averager's tensors with a group, or leave them this peer's own and say so
    (``fallback``: what the peer does instead). Whatever went wrong with the others, this peer
    keeps training, so nothing raises out of here but cancellation.

    The round is declared at ``epoch``; matchmaking may move it to the newest epoch declared in
    the group, and the record says which epoch that was. ``group``: one formed ahead of the step
    for ``epoch`` (``match_ahead.py``), averaged with at once. ``timeout``: matchmaking's (default:
    the averager's)."""
    traffic = averager.host.traffic
    bytes_before = traffic.bytes_sent + traffic.bytes_received
    started = trio.current_time()
    try:
        averaged = await averager.step(weight=weight, group=group, round_number=epoch, timeout=timeout)
    except Exception as error:
        if isinstance(error, NoOtherPeers):
            if averager in _alone:
                log.debug("no other peer to average with at epoch %d; %s", epoch, fallback)
            else:
                _alone.add(averager)
                log.warning("no other peer to average with (%s); %s until one joins", error, fallback)
            reason = "no_group"
        elif isinstance(error, LeaderFailed):
            reason = "leader_failed"
        elif isinstance(error, MatchmakingError):
            reason = "no_group"
        elif isinstance(error, AllReduceError):
            reason = "allreduce"
        else:
            reason = "error"
            log.exception("unexpected failure while averaging")
        if not isinstance(error, NoOtherPeers):
            log.warning("averaging failed at epoch %d (%s); %s", epoch, error, fallback)
        return AveragingRecord(
            epoch,
            seconds=trio.current_time() - started,
            bytes=traffic.bytes_sent + traffic.bytes_received - bytes_before,
            failure=reason,
            alone=isinstance(error, NoOtherPeers),
        )
    _alone.discard(averager)
    result = averaged.result
    failed = tuple(sorted(str(peer) for peer in result.failed_peers))
    me = averager.host.peer_id
    peers = tuple(m.peer_id for m in averaged.group.members if m.peer_id != me and m.peer_id not in result.failed_peers)
    return AveragingRecord(
        averaged.round,
        averaged=True,
        group=len(averaged.group.members),
        failed=failed,
        peers=peers,
        seconds=trio.current_time() - started,
        matchmaking_s=averaged.timing.matchmaking_s,
        allreduce_s=averaged.timing.allreduce_s,
        bytes=traffic.bytes_sent + traffic.bytes_received - bytes_before,
        result=result,
    )


async def average_state(
    averager: GroupAverager, epoch: int, group: FormedGroup | None = None, timeout: float | None = None
) -> bool:
    """One periodic round of state averaging (in ``group`` if one formed ahead; ``timeout``:
    matchmaking's); False if no group formed or the round failed (it only pulls replicas together,
    so the next period will do)."""
    try:
        await averager.step(group=group, timeout=timeout)
    except (MatchmakingError, AllReduceError) as error:
        level = logging.DEBUG if isinstance(error, NoOtherPeers) else logging.INFO
        log.log(level, "state averaging skipped at epoch %d: %s", epoch, error)
        return False
    return True


class Replica:
    """This peer's epoch, the state newcomers download from it, and its progress records."""

    def __init__(
        self,
        dht,
        prefix: str,
        state: Sequence[torch.Tensor],
        averaging: dict[str, Any],
        *,
        samples_per_epoch: int | None = None,
        progress_interval: float,
        served_epoch: Callable[[int], int] | None = None,
        replicated: int | None = None,
    ):
        """``averaging``: the state averager's ``GroupAverager`` options; ``samples_per_epoch``:
        the fewest samples an epoch takes, which bounds how fast other peers' claimed epochs may
        advance (``epoch_evidence.py``; None: epochs are not counted in samples);
        ``progress_interval``: how often ``exchange_due`` says yes; ``served_epoch``: the epoch
        donors tell newcomers our state belongs to, given ours (default: ours); ``replicated``: how
        many of the leading state tensors every honest replica holds alike (``GroupAverager``)."""
        self.epoch = 0
        self.samples_per_s = 0.0
        self.swarm = SwarmProgress({}, 0)  # the last view fetched from the DHT
        self.others_seen_at: float | None = None  # when a fetched view last held another peer's record
        self.last_round: AveragingRecord | None = None
        self.tracker = ProgressTracker(dht, prefix, samples_per_epoch)
        self.progress_interval = progress_interval
        self._last_exchange = -math.inf  # (trio.current_time) when exchange_due last said yes
        self._exchanging = False  # a progress exchange runs in the background
        self._exchange_again = False  # ... and our record changed since it published
        served = served_epoch if served_epoch is not None else (lambda epoch: epoch)
        # Averaged now and then to pull replicas together, and what newcomers download.
        self.state = EpochStateAverager(
            lambda: served(self.epoch),
            state,
            dht,
            prefix=f"{prefix}.state",
            replicated=replicated,
            counted_of=lambda: self.epoch,
            **averaging,
        )

    def exchange_due(self) -> bool:
        """Whether ``progress_interval`` has passed since this last said yes (then the caller
        exchanges progress, in line or in the background, and the clock restarts)."""
        now = trio.current_time()
        if now - self._last_exchange < self.progress_interval:
            return False
        self._last_exchange = now
        return True

    def progress(self, samples: int) -> PeerProgress:
        return PeerProgress(self.epoch, samples, self.samples_per_s)

    def view(self, samples: int) -> SwarmProgress:
        """The last view fetched, with our own record as of now (``samples`` this epoch) and
        never an epoch below ours."""
        me = self.tracker.me
        peers = {**self.swarm.peers, me: self.progress(samples)}
        return SwarmProgress(peers, max(self.swarm.epoch, self.epoch), me, self.swarm.scale)

    async def publish(self, samples: int) -> None:
        await self.tracker.publish(self.progress(samples))

    async def fetch(self, samples: int) -> SwarmProgress:
        """The swarm's progress as the DHT has it, with this peer's own as of now."""
        self.swarm = await self.tracker.fetch(self.progress(samples))
        if any(peer != self.swarm.me for peer in self.swarm.peers):
            self.others_seen_at = trio.current_time()
        return self.swarm

    async def exchange(self, samples: int) -> None:
        """Publish our record and read the swarm's."""
        await self.publish(samples)
        await self.fetch(samples)

    def exchange_soon(self, nursery: trio.Nursery, samples: Callable[[], int]) -> None:
        """``exchange`` in ``nursery``, with the sample count as it is when it runs: the caller
        goes on training meanwhile. One exchange at a time, and one more after it if this is
        asked for again while it runs (our record changed)."""
        if self._exchanging:
            self._exchange_again = True
            return
        self._exchanging = True
        nursery.start_soon(self._exchange_in_background, samples)

    async def _exchange_in_background(self, samples: Callable[[], int]) -> None:
        try:
            while True:
                self._exchange_again = False
                await self.exchange(samples())
                if not self._exchange_again:
                    return
        except Exception as error:  # a background task: training goes on, the next refresh retries
            log.warning("exchanging progress failed (%s); retrying at the next refresh", error)
        finally:
            self._exchanging = False

    def announce_state_soon(self, nursery: trio.Nursery) -> None:
        """``announce_state`` in ``nursery`` (a failure is logged: the next round announces again)."""

        async def announce() -> None:
            try:
                await self.announce_state()
            except Exception as error:
                log.warning("announcing our state failed (%s)", error)

        nursery.start_soon(announce)

    def count_round(self, record: AveragingRecord | None, launched_at: int | None = None) -> int:
        """Count the round averaged in ``record`` as done (call as its step lands; None: the step
        of a round still in flight, counted for now as this epoch's own) and keep its record as
        ``last_round``; returns how many epochs that moved this replica. The one place an epoch
        advances after a round.

        ``launched_at``: the epoch the round was declared at, when the epoch already counted it
        (a delayed round counted at its launch, with None, lands later): only what the group adds
        to that moves the epoch now.

        A peer one epoch behind (it stepped a moment late as the swarm formed, or loaded a donor's
        state while the donor's next step was in flight) averages in its group's round for the
        next epoch, and then counts that epoch as done, as its group does. Counting on from its
        own epoch would keep it one behind for good, and every ``average_state_every`` epochs the
        two sides would look for each other in different rounds of state averaging, each losing a
        matchmaking deadline. One epoch at most per round: a larger jump is never taken on a
        group's word (a peer further behind closes the gap a round at a time, or loads state)."""
        if record is not None:
            self.last_round = record
        averaged = record is not None and record.averaged
        if averaged:
            self.tracker.evidence.vouch(record.peers)
        declared = self.epoch if launched_at is None else launched_at
        shared = record.epoch if averaged else declared
        counted = max(self.epoch, min(max(declared, shared), declared + 1) + 1)
        moved, self.epoch = counted - self.epoch, counted
        return moved

    async def announce_state(self) -> None:
        """Newcomers may load from us, at our epoch."""
        await self.state.state_sharing.announce(self.epoch)

    async def load_state_from_peers(
        self, timeout: float, catch_up: Callable[[int], Awaitable[None]] | None = None, evidenced: int = 0
    ) -> int:
        """Load a donor's state into ours and adopt its epoch, as far as the evidence goes: the
        donor's epoch is one peer's claim, so it is taken up to one past the swarm's evidenced
        epoch (or ``evidenced``, what the caller knows), the normal skew of a donor that stepped
        since. Returns the epochs the donor says it has counted, bounded alike: the epoch adopted,
        or one more (a delayed round of its in flight). Raises StateUnavailable if no donor
        answered within ``timeout``."""
        metadata = await self.state.load_state_from_peers(timeout=timeout)
        epoch, counted = (
            (metadata.get("epoch"), metadata.get("counted_epoch")) if isinstance(metadata, dict) else (None, None)
        )
        bound = max(self.swarm.epoch, evidenced, self.epoch) + 1
        if is_counter(epoch):
            if epoch > bound:
                log.warning("the donor claims epoch %d, the evidence backs %d; moving to %d", epoch, bound - 1, bound)
                epoch = bound
            await self.move_to_epoch(epoch, catch_up)
        return min(self.epoch + 1, bound, counted) if is_counter(counted) and counted > self.epoch else self.epoch

    async def move_to_epoch(self, epoch: int, catch_up: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Jump forward (never back) to ``epoch``; ``catch_up(skipped)`` first moves along whatever
        else counts epochs (a learning-rate schedule)."""
        if epoch <= self.epoch:
            return
        if catch_up is not None:
            await catch_up(epoch - self.epoch)
        self.epoch = epoch


class ReplicaOptimizer:
    """What the daemon's trainer, the status endpoint and scripts read from either optimizer."""

    replica: Replica
    # True: ``step(n)`` only accumulates gradients between swarm steps, so the trainer may hand it
    # several batches' gradients at once (``peerd/training.py``); False: it steps every call.
    accumulates_batches = False

    @property
    def epoch(self) -> int:
        return self.replica.epoch

    @property
    def samples_per_s(self) -> float:
        return self.replica.samples_per_s

    @property
    def swarm(self) -> SwarmProgress:
        return self.replica.swarm

    @property
    def tracker(self) -> ProgressTracker:
        return self.replica.tracker

    @property
    def last_round(self) -> AveragingRecord | None:
        """The last round's record (a new object per round), None before the first."""
        return self.replica.last_round

    @property
    def last_averaging(self) -> dict[str, Any] | None:
        """How the last round's averaging went (``AveragingRecord.to_dict``), None before the first."""
        record = self.replica.last_round
        return None if record is None else record.to_dict()
