"""Local updates with an outer optimizer (DiLoCo), for slow links.

Each peer takes ``local_steps`` steps of its own (inner) optimizer on its own data, then the peers
average their parameter deltas since the last round ("pseudo-gradients": only a direction, so
they travel as blockwise int8 by default, a quarter of float32, with error feedback carrying what
rounding drops into the next round; ``error_feedback.py``) and every peer applies the same outer Nesterov-momentum step
from the shared starting point. Peers exchange one model-sized message per ``local_steps``
batches instead of one per swarm batch, which is what makes training across continents work
(DiLoCo: ~500x less communication at equal quality; INTELLECT-1: 83-96% compute utilisation).

A round ends when the swarm has taken ``local_steps`` batches per peer for it, counted from the
peers' progress records (``round_length.py``), so that peers of different speeds end their rounds
together and meet in one group. What happens then is a schedule (``local_rounds.py``): by default
each round averages before the next begins (``SequentialRounds``); with
``OverlappedRounds(nursery)`` the averaging of round t runs in the
nursery while round t+1's inner steps proceed, and round t's outer step lands one round late,
keeping the local progress made meanwhile, so communication hides behind computation instead of
stalling it. The arithmetic is in ``outer_step.py``.

Averaging deltas keeps replicas together only while every peer applies the same average from the
same start. Groups smaller than the swarm and failed rounds break that, and nothing in delta
averaging pulls replicas back: their differences add up round after round. So every
``average_state_every`` rounds the peers also average a piece of the shared start itself (in
float32, the next piece each time: ``start_pieces``) and move their parameters by the same
correction.
The outer momentum is each peer's own (worker momentum: folded into the delta before it is
averaged, which with the mean is the same step and under robust aggregation narrows the honest
spread that an attacker may pull by; ``outer_step.py``). Newcomers load both the start and a
donor's momentum.

With a sparse codec (``topk_2bit``, ``topk_4bit``: ``sparse_codec.py``) a round applies only the
largest values of each chunk of the average, ~136x fewer bytes than float32. Falling back to the
shared start would throw away all the rest of a peer's progress every round, so each peer keeps
in its parameters what the swarm has not applied yet (``params = start - residual``,
``ErrorFeedback.move_into``) and the next delta carries it; that is the peer's own unsent progress
only at outer learning rate 1 without outer momentum, which a sparse codec therefore takes. In the
in-process simulation (``benchmarks/diloco_sim.py``, ``textlm`` small) this trains as well as int8
deltas; falling back to the start, or momentum 0.9, did not train. The start is then averaged a
fragment at a time (``start_pieces``), so that its float32 does not outweigh the rounds.

With ``fragments=P`` the model is averaged in P fragments that take turns (streaming DiLoCo,
``outer_fragments.py``): a round of ``local_steps / P`` inner steps averages and steps one of
them, so each is still averaged every ``local_steps`` and at most 1/P of the model is in flight.

With overlapped rounds, progress records and donor announcements go out in the background nursery
between rounds. The start's averaging stays in line: besides pulling replicas together, its
matchmaking holds a peer whose rounds run ahead until the others arrive (up to the matchmaking
deadline), which keeps the swarm's round boundaries close enough for the deltas' groups to form.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import trio

from peer.worker_threads import run_blocking

from .averager import GroupAverager
from .compression import get_codec
from .contribution_scores import HeldOutGradient
from .error_feedback import ErrorFeedback
from .local_rounds import RoundSchedule, SequentialRounds
from .outer_fragments import OuterFragments, RoundFragment, fragment_reference
from .progress import SwarmProgress
from .replica import AveragingRecord, EpochStateAverager, Replica, ReplicaOptimizer, average_state
from .round_length import round_over
from .settings import LOCAL_UPDATES, AveragingSettings
from .state_sharing import StateUnavailable

__all__ = ["LocalUpdatesOptimizer", "MAX_START_PIECES", "outer_settings", "start_pieces"]

# The start is averaged in float32 and in line (the trainer waits for it), a piece at a time:
# ``start_pieces``, at most this many. With a sparse codec (~136x less than float32) a 64th of the
# start every 5 rounds is about the bytes of one sparse round spread over them, so a round costs
# ~114x less than with float32 deltas and whole-start averaging; the whole start is then averaged
# every 320 rounds.
MAX_START_PIECES = 64


def start_pieces(codec: str) -> int:
    """How many pieces the start is averaged in, one per ``average_state_every`` rounds: the
    power of two nearest above twice the codec's compression (at most ``MAX_START_PIECES``), so
    that a piece carries at most about half the bytes of a round's deltas. Whole, the start held
    every peer's training for as long as its float32 took to cross the uplink: at 10 Mbit/s with
    int8 deltas (``textlm`` small, 4 peers in the lab) 12-18 s of every ~70 s, where each round's
    deltas, overlapped, cost the trainer nothing. Int8 deltas: 8 pieces (the whole start every 40
    rounds); float32 deltas: 2; sparse: 64. Every peer of a swarm uses the same codec, so the same
    pieces, which the start averagers' keys name."""
    chosen = get_codec(codec)
    values = 1 << 20
    ratio = get_codec("none").payload_size(values) / chosen.payload_size(values)
    return min(MAX_START_PIECES, 1 << math.ceil(math.log2(2 * ratio)))


# With a sparse codec, a round that averaged nothing while others train on applies nothing (all of
# it stays owed), this many times in a row at most (``_others_train_on``).
MAX_OWED_ROUNDS = 3
# With fragments, a round that formed no group while a peer is a round behind keeps its epoch this
# many times in a row at most (``_keeps_turn``).
MAX_KEPT_TURNS = 2


log = logging.getLogger("peerd.training")


@dataclasses.dataclass
class RoundStreaks:
    """What the rounds so far say about settling a round that failed."""

    unaveraged: int = 0  # rounds in a row that averaged nothing
    kept_turns: int = 0  # rounds in a row whose epoch stayed ours: ``_keeps_turn``
    start_averaged_at: int | None = None  # the epoch of the last start averaging that met a group


class LocalUpdatesOptimizer(ReplicaOptimizer):
    """Same calling convention as CollaborativeOptimizer: ``await opt.step(batch_size)`` after
    ``loss.backward()``; True when an outer round completed.

    ``rounds`` says how a round ends: ``SequentialRounds()`` (the default) or
    ``OverlappedRounds(nursery)``, as ``peerd join --mode local-updates`` runs it. ``settings``:
    how it averages (default ``settings.LOCAL_UPDATES``: blockwise 8-bit deltas, longer deadlines),
    with any of its fields given as keyword arguments instead (``codec="none"``). ``fragments``: the
    model is averaged in that many fragments taking turns, one per round of ``local_steps /
    fragments`` inner steps, so each fragment still averages every ``local_steps``
    (``outer_fragments.py``); an epoch is then one such round, so every peer of a ``prefix`` must
    use the same count (their rounds' keys differ, and others' epochs would run P times slower).
    ``held_out``: the gradient of a held-out loss at given parameter values: each round, the
    shard this peer reduces scores the others' deltas against it at the shared start, and bans a
    sender whose deltas keep raising that loss (``contribution_scores.py``)."""

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        dht,
        *,
        prefix: str,
        local_steps: int = 20,
        fragments: int = 1,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        error_feedback: bool = True,
        rounds: RoundSchedule | None = None,
        settings: AveragingSettings = LOCAL_UPDATES,
        held_out: HeldOutGradient | None = None,
        **setting_changes: Any,
    ):
        self.settings = settings = settings.replace(**setting_changes)
        self.rounds: RoundSchedule = rounds if rounds is not None else SequentialRounds()
        self.inner = inner_optimizer
        self.local_steps = local_steps
        if fragments < 1 or local_steps % fragments:
            raise ValueError(f"{fragments} fragments must divide local_steps ({local_steps}) into equal rounds")
        self.round_steps = local_steps // fragments  # inner steps per round (per fragment)
        self.params = [p for group in inner_optimizer.param_groups for p in group["params"]]
        codec = settings.codec
        # With a sparse codec each peer keeps what the swarm has not applied yet in its parameters
        # (``ErrorFeedback.move_into``), which is only its own unsent progress at outer learning
        # rate 1 without outer momentum: momentum would apply that progress again every round.
        sparse = get_codec(codec).sparse
        self._owed_in_params = sparse and error_feedback
        outer_lr, outer_momentum = outer_settings(self._owed_in_params, outer_lr, outer_momentum)
        self._outer = OuterFragments(self.params, fragments, lr=outer_lr, momentum=outer_momentum)
        averaging = settings.averager_options()
        self.fragments = [
            RoundFragment(
                step,
                # each fragment its own key: a group's members always average the same fragment
                GroupAverager(
                    step.deltas, dht, prefix=f"{prefix}.outer" + (f".{index}of{fragments}" if fragments > 1 else ""),
                    codec=codec, allow_state_sharing=False, **averaging,
                    reference=None if held_out is None else functools.partial(
                        fragment_reference, held_out, self._outer, index
                    ),
                ),
                ErrorFeedback(step.deltas, codec, dht.host.peer_id) if error_feedback else None,
                self._owed_in_params,
            )
            for index, step in enumerate(self._outer.steps)
        ]  # fmt: skip
        # Newcomers download the start and the outer momentum; the start alone is averaged now and
        # then (a copy of it, by ``start_averager``) to pull replicas together, and only the start is
        # what witnesses compare: each peer's momentum is its own (worker momentum).
        self.replica = Replica(
            dht,
            prefix,
            self.snapshot + self.outer_state,
            averaging,
            progress_interval=settings.progress_interval,
            replicated=len(self.snapshot),
        )
        # The start is averaged a piece at a time, each time the next one: whole, its float32
        # would carry 27x the bytes of the sparse rounds in between, and hold training meanwhile.
        pieces = min(start_pieces(codec), sum(param.numel() for param in self.params))  # none empty
        self.start_averagers = [
            GroupAverager(
                # the key names the count: peers cutting the start otherwise never look for each other
                piece, dht, prefix=f"{prefix}.start" + (f".{index}of{pieces}" if pieces > 1 else ""),
                allow_state_sharing=False, **averaging,
            )
            for index, piece in enumerate(self._outer.start_fragments(pieces))
        ]  # fmt: skip
        self.inner_steps = 0
        self.local_samples = 0
        self._round_started: float | None = None
        self._streaks = RoundStreaks()

    @property
    def start_averager(self) -> GroupAverager:
        """The averager of the start (with a sparse codec: of the fragment averaged next)."""
        period = max(self._state_every, 1)
        return self.start_averagers[(self.replica.epoch // period) % len(self.start_averagers)]

    def fragment(self, epoch: int) -> RoundFragment:
        """What the round of ``epoch`` averages and steps (with one fragment: the whole model)."""
        return self.fragments[epoch % len(self.fragments)]

    @property
    def _state_every(self) -> int:
        """Rounds between averagings of the start: ``average_state_every`` per fragment's turn."""
        return self.settings.average_state_every * len(self.fragments)

    @property
    def outer_step(self) -> RoundFragment:
        """The current round's fragment, as a round schedule moves it (``local_rounds.py``)."""
        return self.fragment(self.epoch)

    @property
    def delta_averager(self) -> GroupAverager:
        """The averager of the current round's fragment."""
        return self.outer_step.averager

    @property
    def error_feedback(self) -> ErrorFeedback | None:
        """The error feedback of the current round's fragment (None: none)."""
        return self.outer_step.feedback

    @property
    def snapshot(self) -> list[torch.Tensor]:
        """The shared start (each fragment's as of its last round), in the parameters' order."""
        return self._outer.start

    @property
    def outer_state(self) -> list[torch.Tensor]:
        """The outer momentum buffer(s): this peer's own (worker momentum, ``outer_step.py``)."""
        return self._outer.momentum

    @property
    def state(self) -> EpochStateAverager:
        """The start and the outer momentum, as newcomers download them."""
        return self.replica.state

    async def step(self, batch_size: int) -> bool:
        if self._round_started is None:
            self._round_started = trio.current_time()
            swarm = await self.replica.fetch(self.local_samples)
            if swarm.epoch > self.replica.epoch + 1:
                await self._catch_up(swarm.epoch)
        await run_blocking(self._inner_step)
        self.inner_steps += 1
        self.local_samples += batch_size
        view = await self._view()
        replica = self.replica
        if view.epoch > replica.epoch + 1:
            # We fell behind (cut off, or stalled): this round's steps start from a start the
            # swarm left rounds ago, and no group of our round will form again.
            await self._catch_up(view.epoch)
            return False
        if not round_over(view, replica.epoch, self.inner_steps, self.local_samples, self.round_steps):
            return False
        elapsed = max(trio.current_time() - self._round_started, 1e-9)
        replica.samples_per_s = self.local_samples / elapsed
        return await self.rounds.end_round(self, float(self.local_samples))

    async def _view(self) -> SwarmProgress:
        """The swarm's progress with ours as of now, for ``round_length.round_over``; exchanges our
        progress every ``progress_interval`` (in the background between overlapped rounds, so the
        inner steps never wait for the DHT)."""
        replica = self.replica
        if replica.exchange_due():
            await self.rounds.exchange(replica, lambda: self.local_samples)
        return replica.view(self.local_samples)

    async def _catch_up(self, swarm_epoch: int) -> None:
        """Drop the round in flight and this round's steps, and take a donor's state; if none can
        send it, move to the swarm's round with our own parameters (the start averaging pulls them
        toward the swarm's), rather than asking again at every step."""
        await self.rounds.abandon()
        for fragment in self.fragments:
            if fragment.feedback is not None:
                fragment.feedback.reset()
        if not await self.load_state_from_peers():
            await self.replica.move_to_epoch(swarm_epoch)
        self.restart_round()

    def _inner_step(self) -> None:
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)

    async def load_state_from_peers(self) -> bool:
        """Adopt a peer's start, outer momentum and round, and train on from that start; False if
        no donor could send them."""
        try:
            await self.replica.load_state_from_peers(self.settings.load_state_timeout)
        except StateUnavailable as error:
            log.warning("could not load state from peers: %s", error)
            return False
        self._outer.reset_params_to_start()
        log.info("joined the swarm at outer round %d with its parameters", self.replica.epoch)
        return True

    # What a round schedule (local_rounds.LocalRound) drives:

    async def average_deltas(self, epoch: int, weight: float) -> AveragingRecord:
        fragment = self.fragment(epoch)
        record = await fragment.average(epoch, weight)
        self._streaks.unaveraged = 0 if record.averaged else self._streaks.unaveraged + 1
        await fragment.settle(record, keep_owed=self._owed_in_params and self._others_train_on(record))
        turns = len(self.fragments)
        if record.epoch % turns != epoch % turns:
            # A group on this fragment's key declared another fragment's turn: only a member's
            # word, and taking it (``Replica.count_round``) would skip that fragment's round.
            record = dataclasses.replace(record, epoch=epoch)
        return record

    def _others_train_on(self, record: AveragingRecord) -> bool:
        """Whether a round that averaged nothing should leave our start where the swarm's is (a
        sparse codec's rounds then apply nothing: ``RoundFragment.settle``): while other peers'
        progress records are live, whatever matchmaking saw (their declarations may have missed
        ours), and for ``MAX_OWED_ROUNDS`` rounds in a row at most. Past that we are on our own
        (cut off, or a saboteur spoils our rounds), and a start that never moved would be what
        newcomers download: our start takes our whole delta, as a peer alone's does."""
        if record.averaged or self._streaks.unaveraged > MAX_OWED_ROUNDS:
            return False
        view = self.replica.view(self.local_samples)
        return not record.alone or any(peer != view.me for peer in view.peers)

    async def advance(self, apply: Callable[[], None], record: AveragingRecord | None) -> None:
        """Apply an outer step and count the round ``record`` averaged (the group's epoch, which a
        peer that loaded state while its donor's step was in flight is one behind), as one change
        for anyone downloading our state (start, momentum and epoch must belong together)."""
        async with self.replica.state.locked_tensors():
            await run_blocking(apply)  # a fragment's: it leaves a sparse codec's unsent progress in the params
            if self._keeps_turn(record):
                self._streaks.kept_turns += 1
                self.replica.last_round = record
            else:
                self._streaks.kept_turns = 0
                self.replica.count_round(record)

    def _keeps_turn(self, record: AveragingRecord | None) -> bool:
        """Whether a round of fragments that formed no group stays this epoch's, so that the next
        round averages the same fragment again: while another peer's record claims the epoch
        before ours and none a later one, ``MAX_KEPT_TURNS`` times in a row at most. Such a peer
        is a round behind (it loaded state while its donor's round was in flight, say) and will
        look for this epoch's fragment next; were our failed round counted, we would move on to the
        next fragment's key as it comes to ours, and where rounds are clocked by the matchmaking
        deadline the two of us would stay a round apart, never meeting again. (With one fragment
        every round shares one key and ``Replica.count_round`` closes the gap.) A claim of our own
        epoch says nothing of this (the peers we failed to meet may have averaged it without us,
        and move on). Records are claims: a false one holds back only a peer whose round failed
        anyway, by a turn or two, and the start's averaging, on its own key, still runs."""
        if len(self.fragments) == 1 or record is None or record.averaged or record.matchmaking_s is not None:
            return False
        if self._streaks.kept_turns >= MAX_KEPT_TURNS:
            return False
        view, epoch = self.replica.view(self.local_samples), self.replica.epoch
        others = [progress.epoch for peer, progress in view.peers.items() if peer != view.me]
        return epoch - 1 in others and all(claim <= epoch for claim in others)

    def restart_round(self) -> None:
        self.inner_steps = 0
        self.local_samples = 0
        self._round_started = trio.current_time()

    async def finish_round(self) -> None:
        replica = self.replica
        self.restart_round()
        every = self._state_every
        if every and replica.epoch % every == 0 and self._streaks.start_averaged_at != replica.epoch:
            await self._average_start()
        await self.rounds.after_round(replica, lambda: self.local_samples)

    async def _average_start(self) -> None:
        """Average the shared start with a group; parameters move by the same correction, keeping
        whatever local progress they carry. A copy is averaged, so newcomers can still download
        our state meanwhile."""
        await run_blocking(self._outer.copy_start_for_averaging)
        if await average_state(self.start_averager, self.replica.epoch):
            self._streaks.start_averaged_at = self.replica.epoch
            async with self.replica.state.locked_tensors():
                await run_blocking(self._outer.move_to_averaged_start)


def outer_settings(owed_in_params: bool, lr: float | None, momentum: float | None) -> tuple[float, float]:
    """The outer learning rate and momentum: DiLoCo's 0.7 and Nesterov 0.9 for dense deltas; 1 and
    none when unsent progress stays in the parameters (sparse codecs), where nothing else works."""
    if not owed_in_params:
        return (0.7 if lr is None else lr), (0.9 if momentum is None else momentum)
    lr, momentum = (1.0 if lr is None else lr), (0.0 if momentum is None else momentum)
    if (lr, momentum) != (1.0, 0.0):
        raise ValueError(
            f"a sparse codec keeps unsent progress in the parameters: it needs outer_lr 1 and outer_momentum 0, "
            f"not {lr} and {momentum}"
        )
    return lr, momentum
