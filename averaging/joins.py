"""The leader's side of ``avg.join``: a join is admitted to this peer's open invitation
(``Gathering``) and answered once the group forms; a join that arrives while this peer is still
choosing its role for the round waits for the choice.

Reads of the declarations come back at different times: a follower whose read came back before
its leader's asks before the leader knows it leads. Refused then, it would read the declarations
again and retry, and with many such followers the key's holders would carry every retry. So such a
join waits until we lead (it is admitted), follow or give up (it is refused, and its peer reads
again). The wait is bounded like everything a remote peer asks for: only joins of our schema and
of a round we match for wait, at most one per peer and MAX_WAITING_JOINS in all, and a join whose
patience ran out while it waited is refused rather than admitted with no time to form a group in.

A join for a round this peer has matched already is refused with ``NotLeading``: a late reader
whose view of the grid differs from the one that formed the groups elected us from a declaration
that outlived our choice, and passes us over for the round instead of asking again and again. A
join while we follow another leader for its round is refused with ``Following``, which names that
leader: the joiner's view elected us where ours elected it, and the group we follow is where the
joiner's group mates are (``following.py``). Any other refusal (we have not begun this round) may
change within the round and is answered with a retryable error. So is a join for a later round
than the one we gather for, but one for the next round from a peer our read found is counted: two
such mean the swarm has moved on, and we stop waiting for members still missing
(``Gathering.overtaken``): the group forms with whoever joined, or the attempt fails and our next
read of the declarations catches us up.

An admitted join waits for the group until just before its peer gives up on us: its patience, as
the joiner counted it, ends no later than the call's own deadline (the joiner counted it before it
dialled). While an expected member is missing, a joiner the leader does not expect hurries the
group no sooner than halfway through the leader's time (``Gathering.answer_by``); it waits for a
place no expected member still needs (``Gathering.has_place``; from halfway on, one whose
declaration the leader's read found may take a missing member's). Refused before it gives up, it
reads the declarations again. Joins that wait for a place are bounded as those that wait for our
choice are, each on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from peer import PeerAddress, PeerID, Router

from .gathering import ANSWER_MARGIN, Declaration, Gathering, joiner_view
from .group import MAX_GROUP_SIZE
from .stragglers import HERE_METHOD, here_answer

__all__ = ["FOLLOWING", "Following", "JOIN_METHOD", "Joins", "MAX_WAITING_JOINS", "NOT_LEADING", "NotLeading"]

# No more joins than one group's members wait for our choice, or for a place in our group: an
# honest swarm sends us at most the followers of one group.
MAX_WAITING_JOINS = MAX_GROUP_SIZE
# A join that waited for our choice and has less patience left than this could not see the group
# form: the leader answers ANSWER_MARGIN before the most impatient follower gives up. (A join that
# finds us leading is admitted with what it has: an expected member's patience hurries the group.)
MIN_PATIENCE_LEFT = 2 * ANSWER_MARGIN


class NotLeading(Exception):
    """This peer has matched the joiner's round and leads no group for it; reaches the joiner as a
    RemoteError whose ``type_name`` is NOT_LEADING."""


NOT_LEADING = NotLeading.__name__


class Following(Exception):
    """This peer follows another leader for the joiner's round; the message is the address this
    peer read for it, with its peer ID. Reaches the joiner as a RemoteError whose ``type_name`` is
    FOLLOWING."""


FOLLOWING = Following.__name__


JOIN_METHOD = "avg.join"


class Joins:
    """Serves ``avg.join`` for one matchmaker: what its matchmaking is doing decides a join's
    fate. ``choosing``: our declaration while we match for its round and have not chosen a role
    for this attempt; ``gathering``: our open invitation while we lead."""

    def __init__(self, excluded: Callable[[PeerID], bool]):
        self.excluded = excluded
        self.gathering: Gathering | None = None
        self._choosing: Declaration | None = None
        self._chosen = trio.Event()
        self._waiting: set[PeerID] = set()  # joins waiting for our choice
        # set once a join for the round we choose for waits for our choice (``settling.settle``)
        self.asked_to_lead = trio.Event()
        self._placing: set[PeerID] = set()  # joins waiting for a place in our group
        self._matched_round: int | None = None  # the newest round we formed or joined a group for
        self._following: tuple[str, int] | None = None  # the address of the leader we elected, the round

    def serve(self, router: Router, prefix: str) -> str:
        """Serve joins (and leaders' questions: ``stragglers.py``) for ``prefix`` on ``router``;
        returns the join method's name."""
        method = f"{JOIN_METHOD}.{prefix}"
        try:
            router.add_unary(method, self.handle)
            router.add_unary(f"{HERE_METHOD}.{prefix}", self.here)
        except ValueError as error:  # two on one peer would share its peer ID, declarations and joins
            raise ValueError(
                f"this peer already averages under prefix {prefix!r}; each averager on a peer needs its own prefix"
            ) from error
        return method

    def choosing(self, me: Declaration | None) -> None:
        """We are choosing our role for ``me``'s round now (None: we chose, or stopped matching);
        joins that wait for the choice look again."""
        if me is not None and (self._choosing is None or self._choosing.round != me.round):
            self.asked_to_lead = trio.Event()  # (we begin matching, or catch up to a newer round)
        self._choosing, self._following = me, None
        self._chosen.set()
        self._chosen = trio.Event()

    def following(self, leader: PeerID, address: PeerAddress, round_number: int) -> None:
        """We chose to follow ``leader`` (declared at ``address``) for ``round_number``: joins for
        that round (or older ones) are told whom we follow until we choose again, lead or match."""
        self.choosing(None)
        self._following = (str(address.with_peer_id(leader)), round_number)

    def matched(self, round_number: int) -> None:
        """We have our group for ``round_number``: joins for it (or older rounds) are declined."""
        if self._matched_round is None or round_number > self._matched_round:
            self._matched_round = round_number
        self.choosing(None)

    def open(self, gathering: Gathering) -> None:
        """We lead: joins are admitted to ``gathering`` until ``close``."""
        self.gathering = gathering
        self.choosing(None)

    def close(self) -> None:
        self.gathering = None

    async def handle(self, request) -> dict:
        declaration = Declaration.from_wire(request.peer, request.body)
        if self.excluded(request.peer):
            raise ValueError("this peer excludes you from its groups")
        patience = request.body.get("patience")
        if not (isinstance(patience, (int, float)) and 0 < patience <= 3600):
            raise ValueError("a join needs the follower's patience in seconds")
        # (the patience was counted before the joiner dialled us; the call's deadline, after)
        gives_up_at = min(trio.current_time() + patience, trio.current_effective_deadline() - ANSWER_MARGIN)
        if self.gathering is None and self._would_wait(declaration):
            await self._wait_for_choice(declaration, gives_up_at)
        gathering = self.gathering
        if gathering is None:
            if self._matched_round is not None and declaration.round <= self._matched_round:
                raise NotLeading(f"this peer has its group for round {self._matched_round}")
            if self._following is not None and declaration.round <= self._following[1]:
                raise Following(self._following[0])
            raise ValueError("not gathering a group now")
        if declaration.schema != gathering.me.schema:
            raise ValueError("schema differs from this group's")
        if declaration.round > gathering.me.round:
            gathering.passed_by(request.peer, declaration.round)  # (the swarm may have moved on)
            raise ValueError("the joiner is a round ahead of this group")
        if not gathering.has_place(request.peer):
            await self._wait_for_place(gathering, request.peer, gives_up_at)
        gathering.admit(declaration, gives_up_at, joiner_view(request.body.get("view")))
        try:
            # (a confirming read may come to expect the joiner meanwhile: then its patience counts)
            while not gathering.closed.is_set() and trio.current_time() < gathering.waits_until(request.peer):
                with trio.move_on_at(gathering.waits_until(request.peer)):
                    await gathering.closed.wait()
        finally:
            if gathering.formed is None:  # the follower gave up, or its connection died
                gathering.withdraw(request.peer)
        if not gathering.closed.is_set():
            raise ValueError("the group did not form within the joiner's patience")
        if gathering.formed is None or gathering.formed.member(request.peer) is None:
            raise ValueError("the group did not form")
        return gathering.formed.to_wire()

    async def here(self, request) -> str:
        """A leader that expects us in its group for a round asks whether we still match for it
        (``stragglers.py``)."""
        return here_answer(self._matched_round, request.body)

    def _would_wait(self, joiner: Declaration) -> bool:
        me = self._choosing
        return me is not None and joiner.schema == me.schema and joiner.round <= me.round

    async def _wait_for_choice(self, joiner: Declaration, gives_up_at: float) -> None:
        with self._waits(joiner.peer_id, self._waiting), trio.move_on_at(gives_up_at - MIN_PATIENCE_LEFT):
            if self._choosing is not None and joiner.round == self._choosing.round:
                self.asked_to_lead.set()  # (a joiner of an older round read that round's declarations)
            # (woken by a catch-up to a newer round too: still choosing, so wait on)
            while self.gathering is None and self._would_wait(joiner):
                await self._chosen.wait()
        if gives_up_at - trio.current_time() <= MIN_PATIENCE_LEFT:  # (the wait above ended there)
            raise ValueError("the join's patience ran out while this peer chose its role")

    async def _wait_for_place(self, gathering: Gathering, joiner: PeerID, gives_up_at: float) -> None:
        """A joiner we do not expect waits for a place (``Gathering.has_place``): until a missing
        member is found not coming, or (a joiner our read found) halfway through our time; refused
        before it would give up (``admit``), it reads the declarations again."""
        if gathering.accepting:
            waits_until = min(gathering.hurry_from, gives_up_at - MIN_PATIENCE_LEFT)
            with self._waits(joiner, self._placing), trio.move_on_at(waits_until):
                while gathering.accepting and not gathering.has_place(joiner):
                    await gathering.changed.wait()

    @contextmanager
    def _waits(self, joiner: PeerID, waiting: set[PeerID]) -> Iterator[None]:
        """One join per peer in ``waiting``, MAX_WAITING_JOINS in all."""
        if joiner in waiting or len(waiting) >= MAX_WAITING_JOINS:
            raise ValueError("too many joins wait on this peer")
        waiting.add(joiner)
        try:
            yield
        finally:
            waiting.discard(joiner)
