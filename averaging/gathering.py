"""What matchmaking passes around: a peer's declaration as read from the DHT, the group it formed,
and a leader's open invitation (``Gathering``), which is plain state that the leader's trio code
drives: who joined, by when each follower stops waiting, and whether the group is complete."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import trio

from peer import PeerAddress, PeerID

from .group import MAX_GROUP_SIZE, AveragingMode, GroupInfo, GroupMember, is_counter

__all__ = ["Declaration", "Match", "Gathering", "joiner_view", "ANSWER_MARGIN", "MAX_CONFIRMS", "OVERTAKEN_BY"]

# A leader answers this long before its own deadline or a follower's, the follower's counted from
# when its join arrived (and no later than the call's deadline: ``joins.py``); the follower listens
# this long past its patience, counted from when it asked. Between them the two margins must hold
# the join's way there and the answer's way back: a round trip of up to twice this (antipodes:
# ~0.35 s); with less, a follower far away gives up just before the answer comes, while the leader
# forms the group with a member that is gone.
ANSWER_MARGIN = 0.25
# A leader re-reads the declarations at most this many times a round because joiners named members
# it does not expect: an honest view that missed a declaration needs one, and a joiner that names
# made-up peers costs no more than these reads.
MAX_CONFIRMS = 2
# Peers asking a leader to admit them to the round after its own, this many of them, show that the
# swarm has moved on: its groups for the leader's round formed without the members still missing
# (a peer whose epoch ended late elects its grid group's leader and finds that every one of them
# matched already; leading what is left, it would wait out its deadline while the next round's
# readers, which count its declaration as catching up, elect it and are refused again and again).
# A round is a claim, so only askers the leader's own read of the round found declared count
# (``known``), each once, and only for the very next round: an honest reader one round ahead elects
# a leader a round behind (``in_reach``), nobody further ahead does. A newcomer's round 0 has no
# next round (established peers of any round elect it): asks never overtake it. Two such peers can
# close the gathering early (the group forms with whoever joined); one member the leader expects can
# too, by joining with little patience, since the leader answers before its most impatient expected
# follower gives up (a joiner it does not expect, no sooner than ``Gathering.hurry_from``).
OVERTAKEN_BY = 2


@dataclass(frozen=True)
class Declaration:
    peer_id: PeerID
    address: PeerAddress | None
    bandwidth: float
    mode: AveragingMode
    schema: str
    round: int
    # When the DHT record it was read from expires (the DHT's wall clock); None: not read from it
    expiration: float | None = field(default=None, compare=False)

    def to_wire(self) -> dict:
        return {
            "address": str(self.address) if self.address else None,
            "bandwidth": self.bandwidth,
            "mode": self.mode.value,
            "schema": self.schema,
            "round": self.round,
        }

    @classmethod
    def from_wire(cls, peer_id: PeerID, body) -> Declaration:
        if not isinstance(body, dict):
            raise ValueError("declaration must be a map")
        member = GroupMember.from_wire(
            [peer_id.to_bytes(), body.get("address"), body.get("bandwidth"), body.get("mode")]
        )
        schema, round_number = body.get("schema"), body.get("round")
        if not (isinstance(schema, str) and len(schema) <= 128 and is_counter(round_number)):
            raise ValueError("declaration needs a schema string and a round number")
        return cls(peer_id, member.address, member.bandwidth, member.mode, schema, round_number)

    def member(self) -> GroupMember:
        return GroupMember(self.peer_id, self.address, self.bandwidth, self.mode)


@dataclass(frozen=True)
class Match:
    """A group that formed, and the round this peer takes part in with it: the one it declared,
    or the next if the group had caught up to it (``confirmed_round``)."""

    group: GroupInfo
    round: int


def joiner_view(raw) -> list[PeerID]:
    """The members a joiner's read put in the group it asks to join; anything malformed names none
    (an older peer sends no view)."""
    if not isinstance(raw, list) or len(raw) > MAX_GROUP_SIZE:
        return []
    try:
        return [PeerID(item) for item in raw if isinstance(item, bytes)]
    except ValueError:
        return []


class Gathering:
    """A leader's open invitation for one round."""

    def __init__(
        self,
        me: Declaration,
        expected: set[PeerID],
        target: int,
        known: frozenset[PeerID] = frozenset(),
        hurry_from: float = -math.inf,
    ):
        """``known``: the peers whose declarations our read of the round found (``passed_by``;
        none: asks for the next round never end the wait). ``hurry_from``: the earliest moment a
        joiner we do not expect can make us answer (``answer_by``)."""
        self.me = me
        self.expected = expected
        self.target = target
        self.known = known
        self.hurry_from = hurry_from
        # Members that joiners' views put in this group and ours does not: the declarations we read
        # may have missed one that theirs found, and closing on our smaller view would turn that
        # peer away. They are claims: the leader confirms them with a read of its own (``confirm``).
        self.unconfirmed: set[PeerID] = set()
        self._looked_up: set[PeerID] = set()
        self.joined: dict[PeerID, Declaration] = {}
        self.patience: dict[PeerID, float] = {}  # when each follower stops waiting for our answer
        self.ahead: set[PeerID] = set()  # known peers that asked for the next round (at most OVERTAKEN_BY)
        self.changed = trio.Event()
        self.formed: GroupInfo | None = None
        self.closed = trio.Event()

    @property
    def accepting(self) -> bool:
        """Whether joins may still be admitted: the leader has not answered, given up or filled
        the group."""
        return self.formed is None and not self.closed.is_set() and not self.full

    def has_place(self, peer: PeerID) -> bool:
        """Whether ``peer`` may join now. A joiner we do not expect takes only a place that no
        expected member still needs, nor one a joiner named that our confirming read may come to
        expect: a place is a claim too, and strangers (any identity, no declaration needed)
        filling the group would close it at once (``full``) without the members it is for. From
        ``hurry_from`` on, a missing member is unlikely to come, and a joiner whose declaration
        our read found (``known``) may take its place."""
        if not self.accepting:
            return False
        if peer in self.expected:
            return True
        room = len(self.joined) + 1 + len((self.missing | self.unconfirmed) - {peer}) < self.target
        return room or (peer in self.known and trio.current_time() >= self.hurry_from)

    def admit(self, declaration: Declaration, gives_up_at: float, view: Iterable[PeerID] = ()) -> None:
        """``view``: the members the joiner's own read put in this group (``has_place`` must
        hold)."""
        if self.closed.is_set() and self.formed is None:
            raise ValueError("not gathering a group now")
        if not self.accepting:
            raise ValueError("group is already full or formed")
        if not self.has_place(declaration.peer_id):
            raise ValueError("the group's places left are kept for the members it expects")
        self.joined[declaration.peer_id] = declaration
        self.patience[declaration.peer_id] = gives_up_at
        accounted = self.expected | self.joined.keys() | self._looked_up | {self.me.peer_id}
        self.unconfirmed |= set(view) - accounted
        self._changed()

    def confirm(self, found: set[PeerID]) -> None:
        """A fresh read of the declarations puts ``found`` in this group: wait for the members
        joiners named that it found. The named are settled by it, found or not; others it puts in
        the group are not waited for (the grid rule over a larger view may reshuffle the groups,
        and a peer nobody named is likely in another one)."""
        named, self.unconfirmed = self.unconfirmed, set()
        self._looked_up |= named
        self.expected = self.expected | (found & named)
        self._changed()

    def not_coming(self, peer: PeerID) -> None:
        """An expected member that has not joined is gone, or has its group for the round
        elsewhere (``stragglers.py``): the group forms without waiting for it."""
        if peer in self.expected and peer not in self.joined:
            self.expected = self.expected - {peer}
            self._looked_up.add(peer)  # (settled: a later joiner's view that names it changes nothing)
            self._changed()

    def passed_by(self, peer: PeerID, round_number: int) -> None:
        """``peer`` asked to join ``round_number``, a later round than ours: once ``OVERTAKEN_BY``
        known peers asked for the next one, the members still missing are not waited for
        (``complete``)."""
        next_round = self.me.round != 0 and round_number == self.me.round + 1
        counts = next_round and peer in self.known and peer not in self.joined
        if counts and peer not in self.ahead and len(self.ahead) < OVERTAKEN_BY:
            self.ahead.add(peer)
            self._changed()

    @property
    def overtaken(self) -> bool:
        """The swarm has moved on to the next round (``OVERTAKEN_BY``)."""
        return len(self.ahead) >= OVERTAKEN_BY

    def withdraw(self, peer: PeerID) -> None:
        """A follower stopped waiting before the group formed: it must not become a member that
        never shows up (the others would wait a whole sender deadline for it)."""
        if self.formed is None and self.joined.pop(peer, None) is not None:
            self.patience.pop(peer, None)
            self._changed()

    def close(self) -> None:
        """The leader answered (``formed``) or gave up: joins waiting on us look again."""
        self.closed.set()
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def answer_by(self) -> float:
        """Form the group before the most impatient follower gives up on us; but a joiner we do
        not expect hurries us no sooner than ``hurry_from`` (we answer ANSWER_MARGIN before it).
        Its patience is a claim: without the floor, one peer anywhere in the swarm joining every
        leader with a patience of a millisecond would close every group at once, without the
        members each leader waits for. An honest joiner that began matching when we did, with our
        timeout, gives up no sooner than that (``hurry_from``: ``LEADER_PATIENCE_SHARE`` of our
        time); one whose deadline comes earlier (it began earlier, or gave itself less time) may
        give up first, and is told so in time to read the declarations again (``waits_until``).
        From ``hurry_from`` on, any joiner's patience counts, and so it does once no expected member
        is missing (the floor protects them alone: a group held open for latecomers, ``leading.py``,
        answers a latecomer before it gives up)."""
        expected = min((t for peer, t in self.patience.items() if peer in self.expected), default=math.inf)
        others = min((t for peer, t in self.patience.items() if peer not in self.expected), default=math.inf)
        floor = self.hurry_from if self.missing else -math.inf
        return min(expected, max(others, floor)) - ANSWER_MARGIN

    def waits_until(self, peer: PeerID) -> float:
        """How long ``peer``'s join waits for the group to form: until just before it gives up on
        us. A joiner whose patience ``answer_by`` counts is answered by then (ANSWER_MARGIN before
        it gives up; its join waits a little longer); one it does not count is refused as early as
        it would have been answered, and reads the declarations again instead of passing us over."""
        gives_up_at = self.patience.get(peer, math.inf)
        counted = peer in self.expected or gives_up_at >= self.hurry_from or not self.missing
        return gives_up_at - (ANSWER_MARGIN / 2 if counted else ANSWER_MARGIN)

    @property
    def missing(self) -> set[PeerID]:
        """The expected members that have not joined."""
        return self.expected - self.joined.keys()

    @property
    def full(self) -> bool:
        return len(self.joined) + 1 >= self.target

    @property
    def complete(self) -> bool:
        return self.expected <= set(self.joined) or self.full or self.overtaken

    def changed_when(self, event: trio.Event) -> Callable[[], Awaitable[None]]:
        """A task that wakes the leader once ``event`` is set."""

        async def wake() -> None:
            await event.wait()
            self._changed()

        return wake
