"""Who averages with whom this round, sans I/O.

Peers of one averaging prefix declare themselves in the DHT; every peer reads the same set of
declarations and applies the same deterministic rule, so they agree on groups and leaders without
talking. The rule is Moshpit averaging's grid: peers are ranked by ID and the ranks written in
base ``target_group_size``; in round ``r`` the peers that share every digit except digit
``r mod D`` form a group. Over D consecutive rounds every peer's value reaches every other's, so
with a full grid the swarm holds the exact global mean after D rounds (3 rounds for 8 peers in
pairs), instead of the slow diffusion of random regrouping.

Declarations can disagree for a moment (a late store, a dead peer), so the rule only proposes a
leader and the expected members; the leader admits whoever actually asks to join.

A dead peer's declaration outlives it (until it expires with the round). Peers that found a member
``unreachable`` (its connection refused or lost) keep the grid as it is, since the rest of the swarm
still ranks that peer, but pass it over: the next member of the group that can lead leads, and
nobody waits for the dead one. Every follower of a dead leader finds it dead by asking it, so they
all pass it over and agree on the next leader without talking. A leader that did not serve this
peer stays passed over in the rounds that follow, until its declaration expires (``PassedOver``).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peer import PeerAddress, PeerID

from .group import MAX_GROUP_SIZE, GroupInfo

if TYPE_CHECKING:
    from .matchmaking import Declaration

__all__ = [
    "Candidate",
    "GroupProposal",
    "MAX_PASSED_OVER",
    "PassedOver",
    "confirmed_round",
    "grid_dimensions",
    "in_reach",
    "propose_group",
    "reached_directly",
    "round_to_join",
    "view_settled",
]


@dataclass(frozen=True)
class Candidate:
    peer_id: bytes
    can_lead: bool  # client-mode peers accept no connections, so they cannot lead
    # declared an address others dial directly, not one through a relay (a peer behind NAT)
    direct: bool = True


def reached_directly(address: PeerAddress | None) -> bool:
    """A declared ``address`` that others dial directly, not through a relay (None: client mode)."""
    return address is not None and address.relay is None


@dataclass(frozen=True)
class GroupProposal:
    leader: bytes | None  # None: nobody in the proposed group can lead
    members: tuple[bytes, ...]  # the expected group, in rank order


def grid_dimensions(count: int, group_size: int) -> int:
    """D: how many base-``group_size`` digits the ranks of ``count`` peers need (at least 1)."""
    if count <= 1 or group_size <= 1:
        return 1
    return max(1, math.ceil(math.log(count, group_size) - 1e-9))


def _digits(rank: int, base: int, dimensions: int) -> list[int]:
    return [(rank // base**d) % base for d in range(dimensions)]


def propose_group(
    candidates: list[Candidate],
    me: bytes,
    round_number: int,
    target_group_size: int,
    min_group_size: int,
    unreachable: Collection[bytes] = (),
) -> GroupProposal:
    """The group ``me`` should join in ``round_number``, by the grid rule, without the members
    in ``unreachable`` (which still hold their places in the grid).

    Where the round's digit has fewer values than the group size (the top digit of a grid that is
    not a full power of it: 2 rows of 16 give columns of 2), consecutive grid groups that differ
    only in the next digit are merged until each holds ``target_group_size`` peers (at most
    ``MAX_GROUP_SIZE``): whole columns of one block, so that every row still weighs the same in
    each group and the grid still reaches the exact mean, in groups that lose no round when one
    member is gone (a pair whose other half left averages nothing). Groups smaller than
    ``min_group_size`` (the grid's ragged edge) are merged into the nearest group of the same
    round, so nobody is left out just because the swarm size is not a power of the group size.

    The leader is the first member that can lead and is reached directly; only a group with no
    such member is led through a relay. Every member dials its leader at once, and a peer behind
    NAT is reached through circuits its relay caps per peer (``nat_state.RelayLimits``), or
    through dials back that its relay budgets: as a leader it would be unreachable to some of
    its group, who then pass it over and form the group without it, while it waits out the round.
    Directness is read from the declaration: a newcomer behind NAT declares its private listen
    address until its reachability check is done (5-10 s), and reads as direct until then.
    """
    ranked = sorted({c.peer_id: c for c in candidates}.values(), key=lambda c: c.peer_id)
    if me not in {c.peer_id for c in ranked}:
        raise ValueError("this peer is not among the candidates")
    base = max(2, target_group_size)
    dimensions = grid_dimensions(len(ranked), base)
    varying = round_number % dimensions
    groups: dict[tuple[int, ...], list[Candidate]] = {}
    for rank, candidate in enumerate(ranked):
        digits = _digits(rank, base, dimensions)
        fixed = tuple(d for i, d in enumerate(digits) if i != varying)
        groups.setdefault(fixed, []).append(candidate)
    merged: list[list[Candidate]] = []
    block: tuple[int, ...] | None = None  # the digits a short group shares with those it may join
    for key in sorted(groups):
        group = groups[key]
        ragged = merged and (len(group) < min_group_size or len(merged[-1]) < min_group_size)
        short = merged and len(merged[-1]) < target_group_size and key[:-1] == block
        if (ragged or short) and len(merged[-1]) + len(group) <= MAX_GROUP_SIZE:
            merged[-1].extend(group)
        else:
            merged.append(list(group))
            block = key[:-1]
    mine = [
        c
        for c in next(group for group in merged if any(c.peer_id == me for c in group))
        if c.peer_id == me or c.peer_id not in unreachable
    ]
    leaders = [c for c in mine if c.can_lead]
    leader = next((c for c in leaders if c.direct), leaders[0] if leaders else None)
    return GroupProposal(leader.peer_id if leader else None, tuple(c.peer_id for c in mine))


# Leaders remembered at most: entries come only from leaders this peer elected and asked, a few
# per round, and each goes when its declaration expires (the DHT caps that at 5 minutes), so this
# many outlast any honest swarm's failures while a table of them stays a few kilobytes.
MAX_PASSED_OVER = 256


class PassedOver:
    """Leaders that did not serve this peer (never answered, refused the connection, serve no
    matchmaking, answered garbage or a group without us), each passed over until the declaration
    that named it leader expires: a declaration that outlives its peer, or an attacker's, costs
    the round in which we first try it and no other.

    Only a leader this peer elected and asked itself is remembered, never on another peer's word,
    so nobody can have an honest leader skipped except by that leader failing us; and not past
    that leader's own declaration, which only its owner can extend (an honest one lives a round).
    Times are the DHT's wall clock, in which expirations count."""

    def __init__(self, limit: int = MAX_PASSED_OVER):
        self.limit = limit
        self._until: dict[bytes, float] = {}

    def remember(self, leader: bytes, until: float, now: float) -> None:
        """Pass ``leader`` over until ``until`` (its declaration's expiration)."""
        self._expire(now)
        if until > now:
            self._until[leader] = max(until, self._until.get(leader, until))
        while len(self._until) > self.limit:  # the one that would have gone soonest goes first
            del self._until[min(self._until, key=self._until.__getitem__)]

    def current(self, now: float) -> frozenset[bytes]:
        """The leaders passed over now."""
        self._expire(now)
        return frozenset(self._until)

    def _expire(self, now: float) -> None:
        for leader in [leader for leader, until in self._until.items() if until <= now]:
            del self._until[leader]


def view_settled(last_view: frozenset[PeerID], declared: dict[PeerID, Declaration], round_number: int) -> bool:
    """Whether every peer of ``last_view`` has declared ``round_number`` (or later): the view then
    holds everyone the last one did, so waiting longer only waits for newcomers, which the settle
    time never promised to catch. A missing peer (it left, or is slow) means waiting out the settle
    time. Declarations are claims, but only their owners can store them: another peer's can
    neither add to this view nor hold it back beyond the settle time."""
    return bool(last_view) and all(peer in declared and declared[peer].round >= round_number for peer in last_view)


def round_to_join(own_round: int, declared: list[int]) -> int:
    """The round to declare, given the rounds other peers declared. Every round number is a claim
    (anyone may store a declaration), so none may pull this peer along by itself: a peer that has
    averaged before catches up one round at most (further behind, it loads state instead); a
    newcomer (round 0) joins the lower median of the declared rounds, which a minority of liars
    cannot move."""
    if own_round == 0:
        return sorted(declared)[(len(declared) - 1) // 2] if declared else 0
    return max((r for r in declared if own_round < r <= own_round + 1), default=own_round)


def in_reach(own_round: int, declared: int) -> bool:
    """Whether a peer that declared round ``declared`` can be in one group with us in ``own_round``:
    one round apart at most (the one behind catches up), or a newcomer (round 0, which joins where
    the swarm is). A declaration further away is left out of the grid: its peer cannot catch up to
    us, nor we to it (``round_to_join``), so electing it leader, or waiting for it as a member,
    costs the round; a peer left behind by failed rounds would otherwise cost its grid neighbours
    every round after."""
    return declared == 0 or abs(declared - own_round) <= 1


def confirmed_round(own_round: int, me: PeerID, group: GroupInfo, declared: dict[PeerID, Declaration]) -> int:
    """The round this peer took part in: its own, or the next one if another member of the group
    that formed declared it (catching up by one round). A declaration from outside the group, which
    anyone can store, never moves it: otherwise one peer declaring a round ahead, again and again,
    would push every honest peer's epoch forward an extra step per round."""
    members = {member.peer_id for member in group.members} - {me}
    ahead = any(declared[peer].round == own_round + 1 for peer in members if peer in declared)
    return own_round + 1 if ahead else own_round
