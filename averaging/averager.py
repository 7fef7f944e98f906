"""The averager: a peer's tensors, averaged with other peers' in DHT-matched groups.

``GroupAverager`` is the trio-native object (compose it in a trio program or the daemon); the
synchronous ``Averager`` in ``averaging/facade.py`` wraps it for plain scripts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
import trio

from peer import PeerHost
from peer.worker_threads import run_blocking

from .allreduce import AllReduceResult, AllReduceService, RoundSettings
from .compression import get_codec
from .group import MAX_BANDWIDTH, AveragingMode, GroupInfo, is_counter
from .link_speed import BandwidthEstimate
from .matchmaking import Declaration, Matchmaker, MatchmakingError, OutOfReach
from .own_radius import OwnRadius
from .partition import DEFAULT_PART_SIZE
from .robust import Aggregation, resolve_aggregation
from .state_sharing import StateSharing
from .uplink import UplinkEstimate

__all__ = [
    "AveragingRound",
    "FormedGroup",
    "GroupAverager",
    "MatchmakingError",
    "AveragerSettings",
    "RoundTiming",
    "tensor_schema",
]

log = logging.getLogger("peerd.averaging")

# How long a leaving averager tries to take its declaration back: a DHT store to k peers, which
# takes well under a second when the swarm answers; a script that ends must not hang on it.
WITHDRAW_TIMEOUT = 3.0


@dataclass(frozen=True)
class RoundTiming:
    """Where a step's time went: finding the group, and the all-reduce once it formed."""

    matchmaking_s: float
    allreduce_s: float


@dataclass(frozen=True)
class FormedGroup:
    """A group that matchmaking agreed on, before its all-reduce: ``round`` is the round it formed
    in (the one declared, or the next if the group had caught up to it), ``formed_at`` when."""

    group: GroupInfo
    round: int
    formed_at: float


@dataclass(frozen=True)
class AveragingRound:
    """What one ``GroupAverager.step`` was: the group, the round it averaged in, where its time
    went, and what the all-reduce did."""

    group: GroupInfo
    round: int
    timing: RoundTiming
    result: AllReduceResult


@dataclass(frozen=True)
class AveragerSettings:
    """How an averager forms its groups, and how their all-reduce runs (``rounds``)."""

    target_group_size: int
    min_group_size: int
    matchmaking_timeout: float
    settle_time: float | None
    rounds: RoundSettings


def all_reduce_service(host: PeerHost) -> AllReduceService:
    """The one all-reduce service of a host (several averagers on one peer share its RPC method)."""
    return host.service(AllReduceService)


def tensor_schema(
    tensors: Sequence[torch.Tensor], aggregation: Aggregation | None = None, codec: str | None = None
) -> str:
    """A short hash of shapes and dtypes, of the reducers' rule and of the codec the tensors are
    sent in: peers whose tensors differ must never be grouped, nor peers whose checks would each
    take the other's rule for a lie, nor peers whose plans would cut the round into other parts
    (a part's size counts its bytes in the codec: ``partition.bytes_per_value``)."""
    description = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    if aggregation is not None:
        description += f"|{Aggregation(aggregation).value}"
    if codec is not None:
        description += f"|{codec}"
    return hashlib.sha256(description.encode()).hexdigest()[:32]


class GroupAverager:
    """Average ``tensors`` (in place) with peers that use the same ``prefix`` and tensor schema."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht,
        *,
        prefix: str,
        target_group_size: int = 4,
        min_group_size: int = 2,
        mode: AveragingMode | str = AveragingMode.NODE,
        bandwidth: float | None = None,
        codec: str = "none",
        matchmaking_timeout: float = 5.0,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        allow_state_sharing: bool = True,
        settle_time: float | None = None,
        aggregation: Aggregation | str = "auto",
        uplink: float | None = None,
        replicated: int | None = None,
        reference: Callable[[], Sequence[torch.Tensor] | None] | None = None,
    ):
        """``aggregation``: how this peer aggregates the shard it reduces: ``mean``,
        ``centered-clip`` (robust to a hostile minority, ``robust.py``), ``centered-clip-mixed``
        (the same over nearest-neighbour mixes, for peers whose data differ: ``mixing.py``), or
        ``auto``: centered-clip in a public swarm, the mean in a private one
        (``peer/access.py``). With a robust rule, a round too small to outvote a liar (fewer than
        three senders) moves our tensors only as far as their own recent updates allow
        (``own_radius.py``).
        ``uplink``: this peer's uplink in bytes/s, if the operator knows it: each round's
        connections are paced to share it (``uplink.py``); None: the rounds measure it and pace
        to share what they measured (``uplink.UplinkEstimate``).
        ``replicated``: how many of the leading tensors honest replicas hold alike (a newcomer's
        witnesses compare only those; the rest, such as worker momentum, are each peer's own);
        None: all of them.
        ``reference``: called in a worker thread before each round: the gradient of this peer's
        held-out loss at the point the tensors start from, shaped as they are (None: none this
        round). Each sender's contribution to the shard we reduce is scored against it, and a
        sender whose contributions keep raising that loss is banned (``contribution_scores.py``)."""
        if uplink is not None and not (0 < uplink < math.inf):
            raise ValueError(f"uplink must be a positive number of bytes/s, got {uplink}")
        self.tensors = list(tensors)
        self.dht = dht
        self.mode = AveragingMode(mode)
        if self.host.client_mode and self.mode is not AveragingMode.CLIENT:
            self.mode = AveragingMode.CLIENT  # a peer that accepts no connections cannot reduce
        # None: declare what our link achieved in past rounds (bytes/s), so that our share of the
        # reduction follows it; a number: declare that, always (0 reduces nothing).
        self.link_speed = BandwidthEstimate(fixed=None if bandwidth is None else float(bandwidth))
        self.uplink_estimate = UplinkEstimate(declared=uplink)
        rounds = RoundSettings(
            codec=codec,
            sender_timeout=sender_timeout,
            reducer_timeout=reducer_timeout,
            part_size=part_size,
            aggregation=resolve_aggregation(aggregation, self.host.access.private),
            uplink=uplink,
        )
        self.settings = AveragerSettings(target_group_size, min_group_size, matchmaking_timeout, settle_time, rounds)
        self.allow_state_sharing = allow_state_sharing
        self.reference = reference
        # Robust rounds too small to outvote a liar move our values only as far as our own history
        # allows (``own_radius.py``); the plain mean trusts every member anyway.
        self._own_radius = OwnRadius() if rounds.aggregation.robust else None
        self.schema = tensor_schema(self.tensors, rounds.aggregation, get_codec(rounds.codec).name)
        self.round = 0  # the next round this averager declares; only its own steps move it
        self._service = all_reduce_service(self.host)
        self._matchmaker = Matchmaker(self.host, dht, prefix, excluded=self._service.checks.banned.__contains__)
        # One round at a time; locked_tensors() waits for it. A semaphore rather than a Lock so the
        # synchronous facade can acquire and release it from two different loop tasks.
        self._lock = trio.Semaphore(1, max_value=1)
        # One matchmaking at a time (the matchmaker serves one gathering): a group looked for ahead
        # of the step (``find_group``) may be forming while the previous round's all-reduce runs.
        self._matching = trio.Lock()
        self.state_sharing = StateSharing(self.host, dht, prefix, self, replicated=replicated)

    @property
    def host(self) -> PeerHost:
        return self.dht.host

    @property
    def prefix(self) -> str:
        """The DHT keys' prefix of this averager's swarm (its matchmaking and donors')."""
        return self.state_sharing.prefix

    @property
    def all_reduce(self) -> AllReduceService:
        """The host's all-reduce service this averager runs its rounds in (shared by every
        averager on the peer, with the reducer checks and the bans they made)."""
        return self._service

    @property
    def uplink(self) -> float | None:
        """The uplink (bytes/s) this averager's rounds pace their connections to share, declared or
        measured, if known."""
        return self.uplink_estimate.value

    @property
    def bandwidth(self) -> float:
        """What this peer declares: 0 in client mode, else the fixed or the measured bandwidth."""
        if self.mode is AveragingMode.CLIENT:
            return 0.0
        if self.link_speed.fixed is not None:
            return self.link_speed.fixed
        return min(self.link_speed.value, MAX_BANDWIDTH)

    def _declaration(self, round_number: int | None = None) -> Declaration:
        address = None if self.mode is AveragingMode.CLIENT else self.host.public_address
        declared = self.round if round_number is None else round_number
        return Declaration(self.host.peer_id, address, self.bandwidth, self.mode, self.schema, declared)

    async def find_group(
        self, round_number: int | None = None, timeout: float | None = None, hold_open: trio.Event | None = None
    ) -> FormedGroup:
        """Matchmaking alone: find a group for ``round_number`` (default: ``self.round``) without
        averaging yet; ``step(group=...)`` runs its all-reduce later. Raises MatchmakingError if
        no group formed within ``timeout`` (default: ``matchmaking_timeout``). ``hold_open``: as
        a leader, keep admitting latecomers until the group is full or the event is set
        (``Matchmaker.form_group``)."""
        settings = self.settings
        declaration = self._declaration(round_number)
        async with self._matching:
            match = await self._matchmaker.form_group(
                declaration,
                target_group_size=settings.target_group_size,
                min_group_size=settings.min_group_size,
                timeout=timeout if timeout is not None else settings.matchmaking_timeout,
                settle_time=settings.settle_time,
                hold_open=hold_open,
            )
        log.info("group %s formed: %d peers", match.group.group_id.hex()[:8], len(match.group.members))
        return FormedGroup(match.group, match.round, trio.current_time())

    async def step(
        self,
        weight: float = 1.0,
        timeout: float | None = None,
        group: FormedGroup | None = None,
        round_number: int | None = None,
        on_group: Callable[[FormedGroup], None] | None = None,
    ) -> AveragingRound:
        """Find a group and average with it; returns what the round was. Raises MatchmakingError
        if no group formed in time.

        ``timeout`` bounds matchmaking (default: ``matchmaking_timeout``); the all-reduce itself is
        bounded by deadlines that follow each peer's progress (``allreduce.py``), capped by
        ``sender_timeout`` and ``reducer_timeout`` where they are set. ``group``: one that
        ``find_group`` formed ahead of time, to average with at once instead of matching now.
        ``round_number``: the round to declare (default: ``self.round``, one past the last round
        this averager took part in); ``self.round`` moves one past the round averaged in, one past the
        round declared when no group formed (a peer kept a round behind would read its cell of an
        older period, where nobody else declares, and fail again), or, left more than a round behind
        every peer that declared (``OutOfReach``), to the swarm's round.
        ``on_group(group)`` runs once the group is known, before its all-reduce (``step_ahead.py``
        starts the next round's matchmaking there).
        """
        async with self._lock:
            started = trio.current_time()
            reference = await self._reference_for_round()
            if group is None:
                try:
                    group = await self.find_group(round_number, timeout)
                except OutOfReach as error:
                    if round_number is None:  # our own count, left behind: join where the swarm is
                        self.round = error.swarm_round
                    raise
                except MatchmakingError:
                    # the round went on without us: the swarm's next is ours (a newcomer's round 0
                    # stays, to join whichever round the swarm declares)
                    if round_number is None and self.round > 0:
                        self.round += 1
                    raise
            self.round = group.round + 1
            if on_group is not None:
                on_group(group)
            formed = max(started, group.formed_at)
            result = await self._average(group.group, weight, reference)
            if result.failed_peers:
                log.info("round done; failed peers: %s", ", ".join(str(p) for p in result.failed_peers))
            else:
                log.info("round done with %d peers", len(group.group.members))
            self.link_speed.update(result.link_rate)
            self.uplink_estimate.observe(result.upload)
            timing = RoundTiming(formed - started, trio.current_time() - formed)
        if self.allow_state_sharing:
            self.state_sharing.announce_soon(self.round)
        return AveragingRound(group.group, group.round, timing, result)

    async def _reference_for_round(self) -> Sequence[torch.Tensor] | None:
        """The reference this round's contributions are scored against, if we score them: only a
        peer that both sends and reduces can (a round counts only when our own contribution lowered
        the held-out loss). A reference that fails costs the scoring of one round, not the round."""
        if self.reference is None or self.mode is not AveragingMode.NODE:
            return None
        try:
            return await run_blocking(self.reference)
        except Exception as error:  # (a task's own code: out of memory, a frozen parameter ...)
            log.warning("no held-out gradient this round, contributions not scored: %r", error)
            return None

    async def _average(
        self, group: GroupInfo, weight: float, reference: Sequence[torch.Tensor] | None = None
    ) -> AllReduceResult:
        """One all-reduce of our tensors with ``group``, bounded by our own history if it is robust."""
        history = self._own_radius
        radius = history.before_round(self.tensors) if history is not None else None
        settings = dataclasses.replace(self.settings.rounds, uplink=self.uplink_estimate.for_next_round())
        try:
            return await self._service.run(
                group, self.tensors, weight=weight, settings=settings, own_radius=radius, reference=reference
            )
        finally:
            if history is not None:  # (a failed or cancelled round left our values as they were)
                history.after_round(self.tensors)

    async def leave(self) -> None:
        """Stop taking part: withdraw our matchmaking declaration, so that the others neither
        elect us nor wait for us in the rounds to come (call before closing the DHT node)."""
        with trio.move_on_after(WITHDRAW_TIMEOUT):
            await self._matchmaker.withdraw()

    @asynccontextmanager
    async def locked_tensors(self) -> AsyncIterator[list[torch.Tensor]]:
        """The averaged tensors, with no round running while the block runs."""
        async with self._lock:
            yield self.tensors

    async def hold_tensors(self) -> list[torch.Tensor]:
        """``locked_tensors`` in two halves, for a caller whose block spans two loop tasks (the
        synchronous facade): no round runs from now until ``release_tensors``."""
        await self._lock.acquire()
        return self.tensors

    def release_tensors(self) -> None:
        self._lock.release()

    def state_metadata(self) -> Any:
        """What a newcomer learns besides the tensors (subclasses add epochs, optimizer state...)."""
        return {"round": self.round, "cells": self._matchmaker.cells.count}

    async def load_state_from_peers(self, timeout: float = 30.0) -> Any:
        """Replace our tensors with a donor's (in place) and adopt its round; returns its metadata."""
        metadata, tensors = await self.state_sharing.download(self.tensors, timeout)
        async with self._lock:
            with torch.no_grad():
                for ours, theirs in zip(self.tensors, tensors, strict=True):
                    ours.copy_(theirs)
            if isinstance(metadata, dict):  # its round, and its cells until our census comes in
                if is_counter(metadata.get("round")):
                    self.round = max(self.round, metadata["round"])
                self._matchmaker.census.take_donors(metadata.get("cells"))
            if self._own_radius is not None:  # a donor's values are no update of ours
                self._own_radius.reset()
        log.info("loaded state from peers (round %d)", self.round)
        return metadata
