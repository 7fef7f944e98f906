"""One all-reduce round as this peer sees it, sans I/O: what became of every shard and of every
sender, and the round's result, of which it is the one writer.

The trio driver (``allreduce.py``, ``round_roles.py``) moves the bytes and keeps the time; it tells
the round what happened (events) and asks it what is left to do. Each shard of the plan is in
one state of a table, and moves only along it (in the manner of h11's ``_state.py``)::

    PENDING -> AVERAGED   its reducer's whole average arrived (or the shard is empty)
    PENDING -> LOCAL      it keeps this peer's own values: the reason says why
    AVERAGED -> CHECKED   its reducer passed this peer's check (``verification.py``)
    AVERAGED -> BANNED    its reducer is on our ban list or failed its check: local values
    AVERAGED -> LEFT_OUT  a checked round's reducer left out senders the others took in: local values

Every sender of the group is ``IN`` until some reducer leaves it out of its average
(``DROPPED``, with the reason). A sender dropped midway is still in the parts averaged before
that: ``part_contributors`` says per part whose contributions the average holds.

The round itself goes ``EXCHANGING`` (shards arrive) -> ``REVIEWING`` (bans and checks judge the
averages) -> ``DONE`` (the result is out). An event that the table does not allow is a bug in the
driver: it raises ``RoundStateError`` and the round stays broken (sticky), as h11's do.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass, field

import torch

from peer import PeerID

from .group import GroupInfo
from .partition import AllReducePlan
from .reduction import ReductionOutcome
from .uplink import UploadFigures

__all__ = ["AllReduceResult", "AllReduceRound", "RoundPhase", "RoundStateError", "SenderState", "ShardState"]


class RoundStateError(RuntimeError):
    """An event the round's state table does not allow (a bug in whoever drives it)."""


class ShardState(enum.Enum):
    PENDING = "pending"
    AVERAGED = "averaged"
    LOCAL = "local"
    CHECKED = "checked"
    BANNED = "banned"
    LEFT_OUT = "left out"


class SenderState(enum.Enum):
    IN = "in"
    DROPPED = "dropped"


class RoundPhase(enum.Enum):
    EXCHANGING = "exchanging"
    REVIEWING = "reviewing"
    DONE = "done"


SHARD_TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    ShardState.PENDING: frozenset({ShardState.AVERAGED, ShardState.LOCAL}),
    ShardState.AVERAGED: frozenset({ShardState.CHECKED, ShardState.BANNED, ShardState.LEFT_OUT}),
    ShardState.LOCAL: frozenset(),
    ShardState.CHECKED: frozenset(),
    ShardState.BANNED: frozenset(),
    ShardState.LEFT_OUT: frozenset(),
}
# Which events each phase takes.
PHASE_EVENTS: dict[RoundPhase, frozenset[str]] = {
    RoundPhase.EXCHANGING: frozenset({"shard_averaged", "shard_failed", "own_shard_reduced", "exchanges_over"}),
    RoundPhase.REVIEWING: frozenset({"screen", "unjust_exclusions", "checked", "finish"}),
    RoundPhase.DONE: frozenset(),
}


@dataclass
class AllReduceResult:
    group: GroupInfo
    # shard index -> peers whose contribution is in every part of that shard's average
    contributors: dict[int, list[PeerID]] = field(default_factory=dict)
    # shard index -> per part (``plan.parts(shard)``), the peers whose contribution is in that
    # part's average: a sender dropped midway is in the parts averaged before it was dropped
    part_contributors: dict[int, list[list[PeerID]]] = field(default_factory=dict)
    # shards that kept this peer's local values (their reducer died, stalled or got nothing)
    local_shards: dict[int, str] = field(default_factory=dict)
    # peers that failed this peer in some way (as reducer, or dropped as sender by some reducer)
    failed_peers: set[PeerID] = field(default_factory=set)
    # how the vector was split (shard i is reduced by group.reducers[i]; which also fixes how each
    # part was encoded), and the shard this peer reduced
    plan: AllReducePlan | None = None
    my_shard: int | None = None
    # what this peer's link achieved in the round (bytes/s, the slower direction), if measurable
    link_rate: float | None = None
    # reducers this peer checked after the round (``verification.py``): shard index -> the
    # reducer, and why it was caught (None: its answer held); a caught one's shard stays local
    reducer_checks: dict[int, tuple[PeerID, str | None]] = field(default_factory=dict)
    seconds: float = 0.0  # the round itself, from the start to the averages written back
    # a round too small to outvote a liar that would have moved our values farther than our own
    # history allows (``own_radius.py``): (how far its averages were from our values, the radius
    # they were held to); None if it moved them no farther
    bounded: tuple[float, float] | None = None
    # what the round showed of our uplink (``uplink.UplinkEstimate`` learns it from this)
    upload: UploadFigures | None = None
    # senders whose contribution to our shard was scored against our reference: the cosine of
    # each with the gradient of our held-out loss (``contribution_scores.py``)
    alignment: dict[PeerID, float] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return not self.local_shards and not self.failed_peers


@dataclass
class ShardEntry:
    """One shard's row of the table."""

    reducer: PeerID
    state: ShardState = ShardState.PENDING
    reason: str | None = None  # why it keeps local values (LOCAL, BANNED)
    contributors: list[PeerID] | None = None  # in every part's average (None: unknown)
    part_contributors: list[list[PeerID]] | None = None
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (flat offset, values)
    verdict: tuple[PeerID, str | None] | None = None  # our check of its reducer, if we made one


@dataclass
class SenderEntry:
    state: SenderState = SenderState.IN
    reason: str | None = None  # why it was dropped
    dropped_by: PeerID | None = None


class AllReduceRound:
    """The table of one round on this peer (see the module docstring). ``sends``: whether this
    peer contributes values (and so writes averages back into them)."""

    def __init__(self, group: GroupInfo, plan: AllReducePlan, me: PeerID, *, sends: bool):
        self.group = group
        self.plan = plan
        self.me = me
        self.sends = sends
        self.my_shard = next((i for i, m in enumerate(group.reducers) if m.peer_id == me), None)
        self.phase = RoundPhase.EXCHANGING
        self.broken: RoundStateError | None = None
        self.shards = {index: ShardEntry(member.peer_id) for index, member in enumerate(group.reducers)}
        self.senders = {member.peer_id: SenderEntry() for member in group.senders}
        for index in self.shards:
            if not plan.shard_sizes[index] and index != self.my_shard:  # a tiny vector split many ways
                everyone = list(self.senders)
                self._move(index, ShardState.AVERAGED, contributors=everyone, part_contributors=[])

    # ------------------------------------------------------------------ queries
    def exchanges(self) -> list[int]:
        """The shards whose averages we must fetch from their reducers."""
        if not self.sends:
            return []
        return [i for i, e in self.shards.items() if e.state is ShardState.PENDING and i != self.my_shard]

    def in_state(self, *states: ShardState) -> list[int]:
        return [index for index, entry in self.shards.items() if entry.state in states]

    def received(self) -> list[tuple[int, torch.Tensor]]:
        """(flat offset, values) of every averaged part of other reducers' shards still believed."""
        others = [e for i, e in self.shards.items() if e.state is ShardState.AVERAGED and i != self.my_shard]
        return [part for entry in others for part in entry.parts]

    def senders_in(self) -> int:
        """How many senders (this peer included, if it sends) no reducer has left out so far."""
        return sum(1 for entry in self.senders.values() if entry.state is SenderState.IN)

    def part_contributors(self) -> dict[int, list[list[PeerID]]]:
        return {i: e.part_contributors for i, e in self.shards.items() if e.part_contributors is not None}

    def averages(self) -> list[tuple[int, torch.Tensor]]:
        """What to write into our values once the round is reviewed: every believed average."""
        believed = (ShardState.AVERAGED, ShardState.CHECKED)
        return [part for e in self.shards.values() if e.state in believed for part in e.parts]

    def unaveraged(self) -> list[tuple[int, int]]:
        """(start, end) of every shard with no average we believe (its reducer failed, was banned
        or failed its check): where a dense round leaves our values as they are, and a sparse one
        writes zeros (``allreduce._written``)."""
        believed = (ShardState.AVERAGED, ShardState.CHECKED)
        bounds = [self.plan.shard_bounds(index) for index, e in self.shards.items() if e.state not in believed]
        return [(start, end) for start, end in bounds if end > start]

    # ------------------------------------------------------------------ events
    def shard_averaged(
        self, index: int, part_contributors: list[list[PeerID]], parts: list[tuple[int, torch.Tensor]]
    ) -> None:
        """The whole of shard ``index``'s average arrived from its reducer, part by part with
        whose contributions each holds; a sender it left out of a part is dropped."""
        self._event("shard_averaged")
        every_part = _in_every(part_contributors)
        self._move(
            index, ShardState.AVERAGED, contributors=every_part, part_contributors=part_contributors, parts=parts
        )
        for sender in self.senders:
            if sender not in every_part and sender != self.me:  # (a reducer may leave us out: ours is no failure)
                self._drop(sender, "left out of its average", self.shards[index].reducer)

    def shard_failed(self, index: int, reason: str) -> None:
        """Shard ``index``'s reducer failed us: the shard keeps our values."""
        self._event("shard_failed")
        self._move(index, ShardState.LOCAL, reason=reason)

    def own_shard_reduced(
        self, outcome: ReductionOutcome, error: str | None = None, average: torch.Tensor | None = None
    ) -> None:
        """Our own reduction is over: ``outcome`` says who is in it and who was dropped;
        ``error``: why its replies stopped; ``average``: our shard as the senders decode it."""
        self._event("own_shard_reduced")
        index = self.my_shard
        if index is None:
            raise self._break("this peer reduces no shard in this round")
        for sender, reason in outcome.dropped.items():
            self._drop(_peer(sender), reason, self.me)
        known = {"contributors": list(outcome.contributors), "part_contributors": outcome.part_contributors}
        if not self.sends:  # nothing to write back: the shard's table row only says who is in it
            self.shards[index].contributors = known["contributors"]
            self.shards[index].part_contributors = known["part_contributors"]
            return
        if error is None and outcome.averaged is None:
            error = "no contribution arrived"
        if error is not None or average is None:
            self._move(index, ShardState.LOCAL, reason=error or "no average", **known)
        else:
            self._move(index, ShardState.AVERAGED, parts=[(self.plan.shard_bounds(index)[0], average)], **known)

    def exchanges_over(self) -> None:
        """Every exchange and our own reduction are over; shards nobody settled stay local."""
        self._event("exchanges_over")
        for index in self.in_state(ShardState.PENDING) if self.sends else []:
            self._move(index, ShardState.LOCAL, reason="the round ended before its average arrived")
        self.phase = RoundPhase.REVIEWING

    def screen(self, banned: Container[PeerID], reason_of: Callable[[PeerID], str]) -> None:
        """Averages from reducers on our ban list are not believed (a group formed ahead of a ban
        may still hold one)."""
        self._event("screen")
        for index in self.in_state(ShardState.AVERAGED) if self.sends else []:
            reducer = self.shards[index].reducer
            if reducer != self.me and reducer in banned:
                self._move(index, ShardState.BANNED, reason="reducer banned: " + reason_of(reducer))

    def unjust_exclusions(self) -> list[PeerID]:
        """Averages that left out a sender the other reducers took in keep our own values
        instead, where that is us or a quarter of the senders; returns the reducers that left
        *us* out so.

        A reducer drops a sender that falls silent and says so; in a robust round it must not
        choose whose contributions make an average (one that left honest senders out would hand
        its shard to the rest). Who was late shows in the other reducers' averages: only those of
        reducers that send too (an identity that only reduces costs an attacker less), and never
        a sender's own shard (it always holds its own contribution). A sender that at least half
        of them took in whole was not late; one left out by most of them was, and the averages
        without it are used (and checked) as any. With nothing to compare (a pair) we keep our
        own values. Another sender's unjust exclusion alone does not discard an average: any
        sender can get itself dropped by a reducer on purpose (a stream ended early), and would
        then discard that reducer's average for everyone; only as many as
        ``max(2, a quarter of the senders)`` do (a censor that leaves out so many honest senders
        could otherwise hand CenteredClip's majority to the rest). Only our own exclusions are
        held against a reducer (``ReducerChecks.note_exclusions``)."""
        self._event("unjust_exclusions")
        whole = {  # sending reducers' shards -> the senders in every part of their averages
            index: set(_in_every(entry.part_contributors))
            for index, entry in self.shards.items()
            if entry.part_contributors
            and entry.reducer in self.senders
            and (entry.state is ShardState.AVERAGED or index == self.my_shard)
        }
        reducer_of = {entry.reducer: index for index, entry in self.shards.items()}
        enough = max(2, math.ceil(len(self.senders) / 4))
        unjust_to_us = []
        for index in self.in_state(ShardState.AVERAGED) if self.sends else []:
            entry = self.shards[index]
            if index == self.my_shard or not entry.part_contributors:
                continue
            named = set(_in_every(entry.part_contributors))
            unjust = []
            for sender in [s for s in self.senders if s not in named]:
                others = [j for j in whole if j not in (index, reducer_of.get(sender))]
                took = sum(sender in whole[j] for j in others)
                if (2 * took >= len(others) > 0) or (sender == self.me and not others):
                    unjust.append(sender)
            if self.me in unjust or len(unjust) >= enough:
                why = "us" if self.me in unjust else f"{len(unjust)} senders"
                self._move(index, ShardState.LEFT_OUT, reason=f"its reducer left out {why}, whom the others took in")
                if self.me in unjust:
                    unjust_to_us.append(entry.reducer)
        return unjust_to_us

    def took_us_in(self) -> list[PeerID]:
        """The other reducers whose averages we use and whose every part holds us."""
        return [
            entry.reducer
            for index, entry in self.shards.items()
            if entry.state is ShardState.AVERAGED
            and index != self.my_shard
            and entry.part_contributors
            and self.me in _in_every(entry.part_contributors)
        ]

    def checked(self, index: int, reducer: PeerID, verdict: str | None) -> None:
        """Our check of shard ``index``'s reducer: None, it held; else why it was caught."""
        self._event("checked")
        entry = self.shards[index]
        if entry.reducer != reducer:
            raise self._break(f"shard {index} is not reduced by {reducer}")
        entry.verdict = (reducer, verdict)
        if verdict is None:
            self._move(index, ShardState.CHECKED)
        else:
            self._move(index, ShardState.BANNED, reason=f"reducer failed its check: {verdict}")

    def finish(
        self,
        link_rate: float | None = None,
        seconds: float = 0.0,
        bounded: tuple[float, float] | None = None,
        upload: UploadFigures | None = None,
    ) -> AllReduceResult:
        """The round's result, written once, from the table (``bounded``, ``upload``: see
        ``AllReduceResult``)."""
        self._event("finish")
        self.phase = RoundPhase.DONE
        result = AllReduceResult(self.group, plan=self.plan, my_shard=self.my_shard, link_rate=link_rate)
        result.seconds, result.bounded, result.upload = seconds, bounded, upload
        for index, entry in self.shards.items():
            if entry.contributors is not None:
                result.contributors[index] = entry.contributors
            if entry.part_contributors is not None:
                result.part_contributors[index] = entry.part_contributors
            if entry.reason is not None:
                result.local_shards[index] = entry.reason
                if index != self.my_shard:
                    result.failed_peers.add(entry.reducer)
            if entry.verdict is not None:
                result.reducer_checks[index] = entry.verdict
        result.failed_peers.update(p for p, s in self.senders.items() if s.state is SenderState.DROPPED)
        return result

    # ------------------------------------------------------------------ the table's rules
    def _event(self, name: str) -> None:
        if self.broken is not None:
            raise self.broken
        if name not in PHASE_EVENTS[self.phase]:
            raise self._break(f"{name} while the round is {self.phase.value}")

    def _move(self, index: int, state: ShardState, **fields) -> None:
        entry = self.shards.get(index)
        if entry is None:
            raise self._break(f"no shard {index} in this round")
        if state not in SHARD_TRANSITIONS[entry.state]:
            raise self._break(f"shard {index} cannot go from {entry.state.value} to {state.value}")
        entry.state = state
        for name, value in fields.items():
            setattr(entry, name, value)

    def _drop(self, sender: PeerID, reason: str, by: PeerID) -> None:
        entry = self.senders.get(sender)
        if entry is not None and entry.state is SenderState.IN:
            entry.state, entry.reason, entry.dropped_by = SenderState.DROPPED, reason, by

    def _break(self, message: str) -> RoundStateError:
        self.broken = RoundStateError(message)
        return self.broken


def _in_every(part_contributors: list[list[PeerID]]) -> list[PeerID]:
    if not part_contributors:
        return []
    first, *rest = part_contributors
    return [p for p in first if all(p in part for part in rest)]


def _peer(sender: Hashable) -> PeerID:
    assert isinstance(sender, PeerID)
    return sender
