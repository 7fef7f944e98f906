"""A leader's expected members that do not come: asked whether they still match for the round.

A leader waits for every member its read of the declarations put in its group, until its most
impatient follower gives up (half the time the follower had left; a follower it does not expect,
no sooner than halfway through its own time: ``Gathering.answer_by``), or until peers of the next
round ask it to lead that one (``Gathering.overtaken``). A member whose machine went off
after it declared never comes, and neither does one that has its group for the round already (its
own read put it in another: views differ by a declaration); each cost its group that whole wait (in
the simulated churning swarm of 32 peers, 30 s of the round's 60-s deadline, in a round of three).

So once half of the expected members joined, or ``ASK_UNJOINED_AFTER`` after it began to lead
with fewer, the leader asks each member still missing that it can dial directly (``HERE_METHOD``,
naming the round), and so each member expected later (a joiner's view named it). One that gives no
answer within ``PROBE_DEADLINE`` (its machine is off, or cut off from us), whose address refuses
the connection or answers as another peer (it is not there any more), or that answers that it has
its group for the round is not waited for, and is not waited for again when a later joiner's view
names it (its declaration outlives it). One that answers that it still matches (it follows another
leader, which may yet fail it), or whose connection was lost mid-call, is asked again
``PROBE_SPACING`` later, then at twice the last spacing each time: a member that follows a leader
which does not form its group may match elsewhere many seconds later, and a leader that stops
asking waits out the round for it; doubling bounds the questions to a few a round.
Anything else keeps the wait as it was: a refusal (a peer that predates the question), a member
behind a relay (a relay that fails the dial must not cost a live member its group), one with no
address (client mode).
A member's answer can only shorten the wait for that member, never admit anyone: a liar gains
nothing it could not by not joining.

Fewer than half may never join: on real TCP, 128 peers on one loop, a first round's views differ
by dozens of declarations, and leaders that ask only once half have joined wait ~40 s for members
that joined other groups (12 leaders in one run, each failing the round). A member that answers
that it matched elsewhere is not expected again in the leader's later proposals of the round
(``asker``'s ``matched``, which the grid rule takes as unreachable: such members keep their
places, so the leader's grid stays the one its followers compute).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping

import trio

from peer import ConnectError, ConnectionLost, PeerHost, PeerID, RPCError

from .gathering import Declaration, Gathering
from .group import is_counter
from .matchmaking_rules import reached_directly

__all__ = [
    "AGAIN",
    "ASK_UNJOINED_AFTER",
    "GONE",
    "HERE_METHOD",
    "MATCHED",
    "MATCHING",
    "PROBE_DEADLINE",
    "PROBE_SPACING",
    "asker",
    "here_answer",
    "stop_waiting_for_stragglers",
]

HERE_METHOD = "avg.here"
PROBE_SPACING = 1.0
# A dial across the world and its request take ~4 round trips (~1.2 s at the antipodes); a member
# silent for this long is gone, or too far to be waited for.
PROBE_DEADLINE = 2.0
# A leader that fewer than half of its members joined asks the missing ones after this long: its
# followers' reads of the declarations came back by then, unless the loop or their link is slow.
ASK_UNJOINED_AFTER = 3.0

MATCHING, MATCHED = "matching", "matched"  # a member's answers
GONE = "gone"  # no answer, or not there (``ask``'s own verdict)
AGAIN = "again"  # the connection was lost mid-call: ask again later (``ask``'s own verdict)


def here_answer(matched_round: int | None, body: object) -> str:
    """What a member answers a leader that asks whether it still matches for ``body["round"]``,
    having its group for ``matched_round`` (None: none yet)."""
    round_number = body.get("round") if isinstance(body, dict) else None
    if not is_counter(round_number):
        raise ValueError("a question needs the round it asks about")
    return MATCHED if matched_round is not None and round_number <= matched_round else MATCHING


def asker(
    host: PeerHost,
    method: str,
    candidates: Mapping[PeerID, Declaration],
    round_number: int,
    matched: set[bytes] | None = None,
) -> Callable[[PeerID], Awaitable[str | None]]:
    """``ask(peer)``: the expected member's answer for ``round_number``; ``GONE`` if it gave none in
    time or its host refused the connection; None if it cannot tell us (see the module's doc).
    The members that answer ``MATCHED`` are added to ``matched`` (their peer IDs' bytes)."""

    async def ask(peer: PeerID) -> str | None:
        answer = await _answer(peer)
        if matched is not None and answer == MATCHED:
            matched.add(peer.to_bytes())
        return answer

    async def _answer(peer: PeerID) -> str | None:
        declaration = candidates.get(peer)
        if declaration is None or not reached_directly(declaration.address):
            return None
        assert declaration.address is not None
        with trio.move_on_after(PROBE_DEADLINE):
            try:
                body = {"round": round_number}
                reply = await host.call(declaration.address, method, body, timeout=2 * PROBE_DEADLINE)
            except ConnectError as error:
                return GONE if error.refused or error.answered_by is not None else None
            except ConnectionLost:
                return AGAIN
            except (RPCError, OSError):  # (a refusal, RemoteError, among them)
                return None
            return reply.body if reply.body in (MATCHING, MATCHED) else None
        return GONE

    return ask


async def stop_waiting_for_stragglers(gathering: Gathering, ask: Callable[[PeerID], Awaitable[str | None]]) -> None:
    """Run beside a leader's wait (which cancels it): once half of the expected members joined (or
    ``ASK_UNJOINED_AFTER`` passed), ask the missing ones, and those expected later, and stop
    expecting those that are gone or matched elsewhere (``Gathering.not_coming``)."""
    with trio.move_on_after(ASK_UNJOINED_AFTER):
        while 2 * len(gathering.expected & gathering.joined.keys()) < len(gathering.expected):
            await gathering.changed.wait()
    due: dict[PeerID, float] = {}  # when each is asked next (inf: asking now, settled, or cannot tell)
    spacing: dict[PeerID, float] = {}

    async def probe(peer: PeerID) -> None:
        answer = await ask(peer)
        if answer in (GONE, MATCHED):
            gathering.not_coming(peer)
        elif answer in (MATCHING, AGAIN):  # (asked again later, each time twice as late)
            spacing[peer] = 2 * spacing.get(peer, PROBE_SPACING / 2)
            due[peer] = trio.current_time() + spacing[peer]

    while True:
        now = trio.current_time()
        missing = [peer for peer in gathering.expected - gathering.joined.keys() if due.get(peer, now) <= now]
        async with trio.open_nursery() as probes:
            for peer in missing:
                due[peer] = math.inf
                probes.start_soon(probe, peer)
        # (members expected while the questions ran, a joiner's view naming them, are due at once:
        # the change that added them was signalled before this wait began)
        now = trio.current_time()
        waiting = [due.get(peer, now) for peer in gathering.expected - gathering.joined.keys()]
        with trio.move_on_at(min(waiting, default=math.inf)):
            await gathering.changed.wait()
