"""Forming an averaging group through the DHT.

1. Every peer stores a declaration under ``{prefix}.matchmaking`` (a DHT dictionary; subkey = its
   owner-signed ``peer_subkey``, value = address, bandwidth, mode, tensor schema, round), expiring
   with the deadline. Readers take the peer ID from the signed subkey, so nobody can declare, or
   squat on, another peer's place in a group. A swarm of more than a few groups declares in cells
   instead, one key each (``cells.py``), their number from a census of the DHT that every peer
   takes alike; a peer reads only its own cell, so a read costs the same at any swarm size.
2. After a settle time (as long as its own store took to land on most holders, not on all: one
   that left would hold it to its deadline; at least ``DEFAULT_SETTLE``) it reads all declarations,
   keeps those with its schema and round, and applies ``propose_group`` (the Moshpit grid rule; the
   first member declaring a direct address leads): everyone computes the same leader from the same
   declarations. The settle time ends early once every peer of the view that formed this peer's
   last group has declared the new round (``settling.py``).
3. Followers ask the leader to admit them (``avg.join``); the leader waits until every expected
   member asked (or is known not to come: ``stragglers.py``, ``Gathering.overtaken``) or the
   deadline passed, then answers all of them with the ordered group,
   bandwidths and a fresh group ID. Reads can differ (a store that has not yet reached every
   holder): a follower names the members its view gives, and a leader asked for members it did
   not expect reads again and waits for those that the fresh read puts in its group, instead of
   closing without them. A leader that follows another itself names it, and the follower asks
   that one (``following.py``). A follower whose leader refuses re-reads the declarations and
   tries again until the deadline. A leader that declines because it has matched the round
   already (a late reader's grid can differ from the one that formed the groups) is passed over
   for the round, keeping its place in the grid, and the next leader is asked at once, without a
   read or a pause. One whose leader is unreachable (refused the connection or lost it: dead)
   passes it over from then on, as every other follower of that leader does, so the group elects
   the next leader instead of losing the round to a declaration that outlived its peer. A leader
   that answers garbage, or a group without the follower, serves no matchmaking (a client-mode
   peer, whose connection to us serves no calls), or does not answer within half of the time left
   (``following.LEADER_PATIENCE_SHARE``) is passed over the same way: anyone can declare itself
   and, with a peer ID that ranks first (among direct addresses), be elected; it must not cost
   the others the round. Such a leader is passed over in the rounds that follow too, until the
   declaration that named it expires (``matchmaking_rules.PassedOver``): trying it again every
   round would cost each half its time.

Peers whose tensor schemas differ never meet: the schema hash (shapes, dtypes and the reducers'
rule, ``averager.tensor_schema``) is part of what is matched. Peers
this one ``excluded`` (reducers caught lying, ``verification.py``) are left out of its candidates,
refused as joiners, and a leader's group that holds one is passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial

import trio

from dht.peer_dictionary import dictionary_entries, peer_subkey, subkey_peer
from peer import ConnectError, ConnectionLost, PeerHost, PeerID, Router, RPCError, UnknownMethodError

from .cells import Cells, crowd_counts, crowd_wins, sparse_cell
from .census import Census
from .following import LEADER_PATIENCE_SHARE, follow
from .gathering import MAX_CONFIRMS, Declaration, Gathering, Match
from .group import MAX_GROUP_SIZE, GroupInfo
from .joins import Joins
from .leading import gather
from .matchmaking_errors import (
    LeaderDeclined,
    LeaderFailed,
    LeaderHoldsExcluded,
    MatchmakingError,
    NoOtherPeers,
    OutOfReach,
    no_group,
    too_few,
)
from .matchmaking_rules import (
    Candidate,
    GroupProposal,
    PassedOver,
    confirmed_round,
    in_reach,
    propose_group,
    reached_directly,
    round_to_join,
)
from .retry_pause import FIRST_RETRY_PAUSE, back_off
from .settling import settle
from .stragglers import HERE_METHOD, asker

__all__ = ["Matchmaker", "MatchmakingError", "NoOtherPeers", "OutOfReach", "Declaration", "Match"]

log = logging.getLogger("peerd.averaging")

# Too few peers declared: look again SPARSE_POLL later.
SPARSE_POLL = 0.2
# A withdrawal replaces our declaration (the owner's newer signed version wins whatever the
# expirations) and only has to outlive the reads of the round it cancels.
WITHDRAWAL_TTL = 5.0


class Matchmaker:
    """Runs matchmaking for one prefix on one peer; serves ``avg.join`` (and ``avg.here``) for it."""

    def __init__(
        self,
        host: PeerHost,
        dht,
        prefix: str,
        router: Router | None = None,
        excluded: Callable[[PeerID], bool] | None = None,
    ):
        self.host = host
        self.excluded = excluded or (lambda peer: False)
        self.dht = dht
        self.prefix = prefix
        self.joins = Joins(self.excluded)  # the leader's side of avg.join
        # (this round's: confirming reads left, and members found matched elsewhere: never expected again)
        self._confirms_left, self._matched_elsewhere = MAX_CONFIRMS, set[bytes]()
        self._named_dials: set[str] = set()  # endpoints dialled this round at a leader's word (following.py)
        # the other peers of the view that formed our last group: once all of them declared the
        # next round, that round's view is as complete as the last one was (``view_settled``)
        self._last_view: frozenset[PeerID] = frozenset()
        self._passed_over = PassedOver()  # leaders that did not serve us, until their declarations expire
        self.cells = Cells(prefix)
        self.census = Census(prefix)
        self._look_around: set[int] = set()  # (this round's) other counts to read once, after a census
        self._declared_key: str | None = None  # where our live declaration is, to withdraw it
        self._join_method = self.joins.serve(router or host.router, prefix)

    def key(self, round_number: int, cells: Cells | None = None) -> str:
        """The DHT key this peer declares under, and reads, for ``round_number``."""
        return (cells or self.cells).key(self.host.identity.peer_id.to_bytes(), round_number)

    async def form_group(
        self,
        me: Declaration,
        *,
        target_group_size: int,
        min_group_size: int,
        timeout: float,
        settle_time: float | None = None,
        hold_open: trio.Event | None = None,
    ) -> Match:
        """Declare, agree on a group and return it with our round in it; raises MatchmakingError
        after ``timeout``.

        ``settle_time``: how long at least to let declarations spread before reading them (default:
        DEFAULT_SETTLE, at most a quarter of the timeout; on a LAN 0.1-0.2 s is plenty).
        ``hold_open``: matching ahead of the round, a leader whose expected members all joined
        keeps admitting latecomers (peers that declared after it read the declarations) until the
        group is full or the event is set (the round is due), within its followers' patience."""
        if not 1 <= min_group_size <= target_group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"need 1 <= min_group_size <= target_group_size <= {MAX_GROUP_SIZE}")
        counted = self.census.next_round(self.cells)
        if counted is not self.cells:  # a census came in: the swarm may keep another count it allows
            self._look_around = self.census.band - {counted.count}  # (read once, in a round that reads)
        self.cells, failed = counted, None
        async with trio.open_nursery() as census:  # the census runs alongside, for the next round
            census.start_soon(self.census.take, self.dht, lambda: self.cells, target_group_size, timeout)
            try:
                return await self._match(me, target_group_size, min_group_size, timeout, settle_time, hold_open)
            except Exception as error:  # raised as itself, not in the nursery's exception group
                failed = error
            finally:
                self.joins.choosing(None)
        assert failed is not None
        raise failed

    async def _match(
        self,
        me: Declaration,
        target_group_size: int,
        min_group_size: int,
        timeout: float,
        settle_time: float | None,
        hold_open: trio.Event | None,
    ) -> Match:
        deadline = (began := trio.current_time()) + timeout
        own_round = me.round
        self._confirms_left, self._matched_elsewhere, self._named_dials = MAX_CONFIRMS, set(), set()
        self.joins.choosing(me)
        settled = await self._declare_and_settle(me, settle_time, timeout)
        last_error = "no other peer declared itself"
        alone = True  # until a read of the declarations finds another peer
        unreachable: set[bytes] = set()  # members found dead this round: passed over from now on
        sparse, probed = sparse_cell(target_group_size), False  # (a sparse cell is probed once a round)
        pause = FIRST_RETRY_PAUSE
        far_rounds: list[int] = []  # (the rounds out of reach, when they are why no group formed)
        rounds: list[int] = []  # (the others' rounds, newcomers' aside, of the read that found too few)
        while trio.current_time() < deadline:
            # Peers declared a round behind are catching up, as we may be about to: they belong in
            # this round's grid, or the leader would not wait for them.
            candidates, settled = settled or await self.read_candidates(me), None
            newest = round_to_join(own_round, [d.round for p, d in candidates.items() if p != me.peer_id])
            if newest > me.round:  # we are behind (a newcomer, or we missed a round): catch up
                me, candidates = await self._catch_up(me, newest, candidates, timeout)
                pause = FIRST_RETRY_PAUSE  # (a new round: its attempts have not failed yet)
            # (peers rounds away from ours cannot be in a group with us)
            far_rounds = [d.round for d in candidates.values() if not in_reach(me.round, d.round)]
            rounds = [d.round for peer, d in candidates.items() if peer != me.peer_id and d.round]
            candidates = {peer: d for peer, d in candidates.items() if in_reach(me.round, d.round)}
            if not probed and (self._look_around or len(candidates) < sparse and self.census.could_hold(sparse)):
                me, candidates = await self._join_the_crowd(me, candidates, timeout, sparse)
                probed = True
            alone = alone and not far_rounds and len(candidates.keys() - {me.peer_id}) == 0
            if len(candidates) < min_group_size:
                last_error = too_few(len(candidates), min_group_size, len(far_rounds), me.round)
                # (a peer that waits for others looks again soon: they may be declaring now)
                await back_off(SPARSE_POLL, deadline)
                continue
            far_rounds = []
            proposal = self._propose(me, candidates, target_group_size, min_group_size, unreachable)
            expected = {PeerID(raw) for raw in proposal.members} - {me.peer_id}
            if proposal.leader is None:
                raise MatchmakingError("no peer in the proposed group can lead (all are in client mode)")
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                try:
                    if proposal.leader == me.peer_id.to_bytes():
                        # the grid's ragged edge merges a small group into its neighbour: room for all
                        size = min(MAX_GROUP_SIZE, max(target_group_size, len(proposal.members)))
                        confirm, ask = self._leading(me, candidates, target_group_size, min_group_size, unreachable)
                        group = await self.lead(
                            me, expected, size, min_group_size, deadline, hold_open, confirm, ask, candidates, began
                        )
                    else:
                        leader = candidates[PeerID(proposal.leader)]
                        group = await self._follow(me, leader, deadline, proposal.members, candidates, unreachable)
                    return self._matched(me, own_round, group, candidates)
                except LeaderDeclined as error:  # it matched without us: the next one leads
                    unreachable.add(proposal.leader)
                    last_error = str(error)
                    settled = candidates  # (no need to read again: the rest of the view stands)
                except (ConnectError, ConnectionLost, LeaderFailed, UnknownMethodError) as error:
                    unreachable.add(proposal.leader)
                    last_error = str(error)
                    self._leader_failed(candidates[PeerID(proposal.leader)], error)
                except (MatchmakingError, RPCError, ValueError) as error:
                    last_error = str(error)
                    log.debug("matchmaking attempt failed: %s", error)
            # Each failed attempt reads the declarations again: wait longer after each, or a peer
            # whose group cannot form (its members beyond a partition) reads many times a second.
            # A leader that declined costs no read and no wait: the next one is asked at once.
            self.joins.choosing(me)
            if settled is not None:
                continue
            pause = await back_off(pause, deadline)
        message = f"no averaging group formed within {timeout:g} s: {last_error}"
        raise no_group(message, me.round, far_rounds, rounds, alone)

    async def _declare_and_settle(
        self, me: Declaration, settle_time: float | None, timeout: float
    ) -> dict[PeerID, Declaration] | None:
        """Declare ``me`` and let the declarations spread (``settling.settle``): the view the
        settle ended with, if one did."""
        stored_in = await self.declare(me, timeout)
        read, asked = partial(self.read_candidates, me), self.joins.asked_to_lead
        times = {"settle_time": settle_time, "timeout": timeout, "stored_in": stored_in}
        return await settle(me, read, self._last_view, asked, **times)

    async def _catch_up(
        self, me: Declaration, newest: int, candidates: dict[PeerID, Declaration], timeout: float
    ) -> tuple[Declaration, dict[PeerID, Declaration]]:
        """Declare ``newest`` instead of our round; the candidates of its key."""
        moves = self.key(newest) != self.key(me.round)
        me, self._matched_elsewhere = replace(me, round=newest), set()  # (found for the round we left)
        self.joins.choosing(me)
        await self.declare(me, timeout)
        return me, await self.read_candidates(me) if moves else {**candidates, me.peer_id: me}

    async def _follow(
        self,
        me: Declaration,
        leader: Declaration,
        deadline: float,
        view: tuple[bytes, ...],
        candidates: dict[PeerID, Declaration],
        unreachable: set[bytes],
    ) -> GroupInfo:
        """``following.follow``, never at another's word to a leader this round passed over; joins
        that come meanwhile are told whom we follow (``joins``)."""
        if leader.address is not None:
            self.joins.following(leader.peer_id, leader.address, me.round)
        else:
            self.joins.choosing(None)
        passed = unreachable | self._matched_elsewhere | self._passed_over.current(self.dht.clock.time())
        host, method, excluded = self.host, self._join_method, self.excluded
        return await follow(host, method, me, leader, deadline, view, candidates, excluded, passed, self._named_dials)

    def _matched(
        self, me: Declaration, own_round: int, group: GroupInfo, candidates: dict[PeerID, Declaration]
    ) -> Match:
        self._last_view = frozenset(candidates) - {me.peer_id}
        # a newcomer (round 0) has already joined the round its candidates declared
        joined = confirmed_round(own_round, me.peer_id, group, candidates) if own_round else me.round
        self.joins.matched(me.round)
        return Match(group, joined)

    def _propose(
        self,
        me: Declaration,
        candidates: dict[PeerID, Declaration],
        target_group_size: int,
        min_group_size: int,
        unreachable: set[bytes],
    ) -> GroupProposal:
        """Our group by the grid rule, passing over the leaders that did not serve us."""
        return propose_group(
            [Candidate(d.peer_id.to_bytes(), d.mode.reduces, reached_directly(d.address)) for d in candidates.values()],
            me.peer_id.to_bytes(),
            me.round,
            target_group_size,
            min_group_size,
            unreachable | self._matched_elsewhere | self._passed_over.current(self.dht.clock.time()),
        )

    def _leading(
        self,
        me: Declaration,
        candidates: dict[PeerID, Declaration],
        target_group_size: int,
        min_group_size: int,
        unreachable: set[bytes],
    ) -> tuple[Callable[[], Awaitable[set[PeerID]]], Callable[[PeerID], Awaitable[str | None]]]:
        """A leader's ``confirm`` and ``ask`` (``lead``). ``confirm``, for joiners that name members
        we did not expect: read the declarations again and return the others that the grid rule now
        puts in our group (none if we no longer lead it). Declarations read before are kept: a read
        that misses one is why views differ; ``ask`` reaches members at what any read declared."""
        candidates = dict(candidates)  # (ours: each confirming read adds to it)

        async def confirm() -> set[PeerID]:
            if self._confirms_left <= 0:  # (joiners' claims cost at most MAX_CONFIRMS reads a round)
                return set()
            self._confirms_left -= 1
            candidates.update(await self.read_candidates(me))
            fresh = {peer: d for peer, d in candidates.items() if in_reach(me.round, d.round)}
            proposal = self._propose(me, fresh, target_group_size, min_group_size, unreachable)
            if proposal.leader != me.peer_id.to_bytes():
                return set()
            return {PeerID(raw) for raw in proposal.members} - {me.peer_id}

        return confirm, asker(self.host, f"{HERE_METHOD}.{self.prefix}", candidates, me.round, self._matched_elsewhere)

    def _leader_failed(self, leader: Declaration, error: Exception) -> None:
        """``leader`` did not serve our join: passed over for the rest of the round (by the
        caller) and, unless a third peer is to blame, while its declaration lives."""
        log.info("peer dropped: leader %s is unreachable (%s); electing the next", leader.peer_id, error)
        if not isinstance(error, LeaderHoldsExcluded) and leader.expiration is not None:
            self._passed_over.remember(leader.peer_id.to_bytes(), leader.expiration, self.dht.clock.time())

    async def declare(self, me: Declaration, timeout: float) -> float:
        """Store our declaration under our own signed subkey, to live as long as the round; returns
        how long it took to land on most holders (the rest get it, and a withdrawal, in the background)."""
        subkey = peer_subkey(self.dht.host.identity.public_key)
        key, left = self.key(me.round), self._declared_key
        self._declared_key, started = key, trio.current_time()
        async with trio.open_nursery() as nursery:
            if left not in (None, key):  # moved cells: the old one must not expect us (at once)
                nursery.start_soon(self.withdraw, left, True)
            await self.dht.store(key, me.to_wire(), self.dht.clock.time() + timeout + 1.0, subkey=subkey, majority=True)
            return trio.current_time() - started

    async def withdraw(self, key: str | None = None, majority: bool = False) -> None:
        """Take our declaration back (we are leaving; ``key``: a cell we left): until it expired,
        others would keep proposing us as their leader or wait for us as a member. Readers drop the
        marker stored in its place as malformed. ``majority``: return once most holders took it (the
        node stays up to send it to the rest; one that is closing cancels those sends)."""
        subkey = peer_subkey(self.dht.host.identity.public_key)
        key = key or self._declared_key or self.key(0)
        expires = self.dht.clock.time() + WITHDRAWAL_TTL
        await self.dht.store(key, {"withdrawn": True}, expires, subkey=subkey, majority=majority)

    async def _join_the_crowd(
        self, me: Declaration, candidates: dict[PeerID, Declaration], timeout: float, sparse: int
    ) -> tuple[Declaration, dict[PeerID, Declaration]]:
        """We may count cells differently from the swarm (a census that saw a different k-th node,
        a newcomer whose census is still running): read our cell under the counts ``crowd_counts``
        names and move to the one whose cell shows the largest swarm (``crowd_wins``); the swarm's
        majority sees full cells and stays, so its count wins."""
        here, allowed, self._look_around = self.cells, self._look_around, set()
        best, best_candidates = here, candidates
        counted = self.census.counted.count if self.census.counted is not None else None  # (a newcomer's first)
        reads: dict[int, dict[PeerID, Declaration]] = {}

        async def read(count: int) -> None:
            reads[count] = await self.read_candidates(me, Cells(self.prefix, count))

        async with trio.open_nursery() as nursery:  # at once: each read may take a lookup's time
            for count in crowd_counts(here.count, allowed, len(candidates) < sparse, counted):
                nursery.start_soon(read, count)
        for count, found in sorted(reads.items()):  # (the counts: of others than us)
            if crowd_wins(len(found) - 1, count, len(best_candidates) - 1, best.count, allowed, sparse):
                best, best_candidates = Cells(self.prefix, count), found
        if best is not here:
            log.info("matchmaking in %d cell(s), as the peers around us do (not %d)", best.count, here.count)
            self.cells = best
            await self.declare(me, timeout)
            best_candidates[me.peer_id] = me
        return me, best_candidates

    async def read_candidates(self, me: Declaration, cells: Cells | None = None) -> dict[PeerID, Declaration]:
        """One read of the round's declarations in ``cells`` (ours by default): those of our schema
        that belong in the cell we read, and ours, by peer."""
        cells = cells or self.cells
        key = self.key(me.round, cells)
        found = await self.dht.get(key, latest=True)
        candidates = {me.peer_id: me}
        # A newcomer (round 0) reads its first cell for the rounds declared there, and takes the
        # others' word for whose cell it is; everyone else counts only those who belong in it.
        newcomer = me.round == 0

        def parse(subkey: tuple[PeerID, str], body) -> Declaration:
            peer, raw = subkey
            assert found is not None  # (entries come from it)
            return replace(Declaration.from_wire(peer, body), expiration=found.value[raw].expiration_time)

        for (peer, _raw), declaration in dictionary_entries(
            found, lambda raw: (subkey_peer(raw), raw), parse, now=self.dht.clock.time()
        ):
            if declaration.schema != me.schema or self.excluded(peer):
                continue
            if newcomer or cells.belongs(peer.to_bytes(), me.round, key):
                candidates[peer] = declaration
        return candidates

    @property
    def gathering(self) -> bool:
        """Whether this peer is gathering a group as its leader now (admitting joins)."""
        return self.joins.gathering is not None

    async def lead(
        self,
        me: Declaration,
        expected: set[PeerID],
        target: int,
        min_size: int,
        deadline: float,
        hold_open: trio.Event | None = None,
        confirm: Callable[[], Awaitable[set[PeerID]]] | None = None,
        ask: Callable[[PeerID], Awaitable[str | None]] | None = None,
        known: Iterable[PeerID] = (),
        began: float | None = None,
    ) -> GroupInfo:
        """As the elected leader of ``me``'s round, gather a group of ``target`` (``leading.gather``)
        with the ``expected`` members; fewer than ``min_size`` raises MatchmakingError. ``confirm``:
        a fresh look at who belongs in the group, taken when joiners name members we do not expect;
        ``ask``: whether a missing member still comes (``stragglers.py``); ``known``: the peers our
        read found, whose joins for the next round end the wait (``Gathering``; none: they never
        do). ``began``: when we began matching for the round (default: now); a joiner we do not
        expect hurries us no sooner than ``LEADER_PATIENCE_SHARE`` of the time from then to the
        deadline. Held open, the wait ends no sooner than ``hold_open`` is set."""
        began = trio.current_time() if began is None else began
        hurry_from = began + (deadline - began) * LEADER_PATIENCE_SHARE
        gathering = Gathering(me, expected, target, frozenset(known), hurry_from)
        return await gather(self.joins, gathering, min_size, deadline, hold_open, confirm, ask)
