"""A follower's side of ``avg.join``: ask the elected leader to admit us, and follow its word to
the leader it follows itself.

Views of the declarations differ while stores spread (a read can miss declarations that another
finds), and the grid rule over another view can elect another leader: our view may elect L while
L's has it follow M. L then has no group to admit us to, and asking L again until M's group forms
without us costs us the round (measured: 128 peers on one loop, 9 lost a first round so in one
run, each refused by a following leader once a second for 10-20 s while M waited for them). So L
names M with the address it read for it (``joins.Following``) and we ask M: a gathering leader
admits any joiner until its group is full, and M's group is where our group mates are. Our own
read may lack M (that is how views differ), so we dial L's address for M when ours has none,
always as M: the handshake proves that M answers, and a lying L gets one failed dial of an
endpoint of its choice that we may dial from where we are (as relays' dial-backs), each endpoint
once a round and MAX_NAMED_DIALS in all (a dial that hangs costs at most the join's patience).
At most MAX_REDIRECTS hops an attempt, without our view (it described L's group, not M's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

import trio

from peer import PeerAddress, PeerHost, PeerID, RemoteError, RPCError
from peer.holepunch import dialable

from .gathering import ANSWER_MARGIN, Declaration
from .group import MAX_GROUP_SIZE, GroupInfo
from .joins import FOLLOWING, NOT_LEADING
from .matchmaking_errors import LeaderDeclined, LeaderFailed, LeaderFollows, LeaderHoldsExcluded, MatchmakingError

__all__ = ["LEADER_PATIENCE_SHARE", "MAX_NAMED_DIALS", "MAX_REDIRECTS", "ask_to_join", "follow"]

# A follower gives its leader this share of the time left to answer; an honest leader answers by
# then with whoever joined (it forms the group before its most impatient follower gives up), or
# refuses in time a follower it did not expect whose patience ends before this share of its own
# time (``Gathering.answer_by``); a leader that did neither is passed over with the other half left
# for the next one to gather a group.
LEADER_PATIENCE_SHARE = 0.5
# A leader's leader may follow a third (views differ in more than one place; chains of four were
# seen among 128 peers): at most this many hops, then we read the declarations again as after any
# refusal.
MAX_REDIRECTS = 4
# Addresses a leader named for the leader it follows, that our own read did not declare, dialled in
# one round: a lying leader names an endpoint of its choice at each of our attempts, and each is a
# dial we make for it.
MAX_NAMED_DIALS = 8
# An address as text (``HOST:PORT/PEERID``: a peer ID is ~45 characters in base58), as the relay's
# dial-backs bound it.
MAX_ADDRESS_TEXT = 100


async def ask_to_join(
    host: PeerHost,
    method: str,
    me: Declaration,
    leader: PeerID,
    address: PeerAddress | None,
    deadline: float,
    view: tuple[bytes, ...],
    excluded: Callable[[PeerID], bool],
) -> GroupInfo:
    """Ask ``leader`` (at ``address``) to admit us, naming the group our ``view`` of the
    declarations gives: a leader whose own read missed one of its members looks again instead of
    closing without it."""
    if address is None:
        raise LeaderFailed("the leader has no address")
    patience = max((deadline - trio.current_time()) * LEADER_PATIENCE_SHARE, 1e-3)
    body = {**me.to_wire(), "patience": patience, "view": list(view[:MAX_GROUP_SIZE])}
    with trio.move_on_after(patience + ANSWER_MARGIN):
        try:
            reply = await host.call(address.with_peer_id(leader), method, body)
        except RemoteError as error:
            if error.type_name == NOT_LEADING:
                raise LeaderDeclined(str(error)) from None
            if error.type_name == FOLLOWING:
                raise _follows(leader, error) from None
            raise
        try:
            group = GroupInfo.from_wire(reply.body)
        except ValueError as error:
            raise LeaderFailed(f"the leader {leader} answered with a malformed group: {error}") from None
        if group.member(me.peer_id) is None:
            raise LeaderFailed(f"the leader {leader}'s group does not include this peer")
        if any(excluded(member.peer_id) for member in group.members):
            raise LeaderHoldsExcluded(f"the leader {leader}'s group holds a peer this one excludes")
        return group
    raise LeaderFailed(f"the leader {leader} did not answer within {patience:.2g} s")


async def follow(
    host: PeerHost,
    method: str,
    me: Declaration,
    leader: Declaration,
    deadline: float,
    view: tuple[bytes, ...],
    candidates: Mapping[PeerID, Declaration],
    excluded: Callable[[PeerID], bool],
    passed_over: AbstractSet[bytes],
    named_dials: set[str],
) -> GroupInfo:
    """``ask_to_join`` the elected ``leader``; if it follows another leader itself, ask that one
    (at the address our ``candidates`` declare for it, else at the one ``leader`` read, dialled
    only as that peer: the handshake proves who answers; an address named to us must be one we
    may dial from where we are, ``holepunch.dialable``). A leader this round passed over
    (``passed_over``: peer IDs' bytes) is not asked again at another's word. ``named_dials``: the
    endpoints dialled this round at others' word, at most MAX_NAMED_DIALS, each once. What goes
    wrong with a leader we were sent to is not the elected one's failure: it raises a plain
    MatchmakingError (the caller reads again), never one that passes the elected leader over."""
    try:
        return await ask_to_join(host, method, me, leader.peer_id, leader.address, deadline, view, excluded)
    except LeaderFollows as error:
        refusal = error
    asked = {me.peer_id, leader.peer_id}
    for _ in range(MAX_REDIRECTS):
        onward, declared = refusal.leader, candidates.get(refusal.leader)
        address = declared.address if declared is not None else refusal.address
        if onward in asked or excluded(onward) or onward.to_bytes() in passed_over:
            raise refusal
        if address is None or address.relay is not None:
            raise refusal
        if declared is None:
            own = me.address or host.listen_address  # (where we are: what we may dial from it)
            ours = own.host if own is not None else None
            if (
                address.endpoint in named_dials
                or len(named_dials) >= MAX_NAMED_DIALS
                or not dialable(address.host, ours)
            ):
                raise refusal
            named_dials.add(address.endpoint)
        asked.add(onward)
        try:
            return await ask_to_join(host, method, me, onward, address, deadline, (), excluded)
        except LeaderFollows as error:
            refusal = error
        except (MatchmakingError, OSError, RPCError, ValueError) as error:
            raise MatchmakingError(f"{leader.peer_id} follows {onward}, which did not admit us: {error}") from None
    raise refusal


def _follows(leader: PeerID, error: RemoteError) -> MatchmakingError:
    """The leader ``leader`` follows, from its ``Following`` refusal: the address it read for it,
    with that leader's peer ID (``joins.Following``)."""
    text = error.remote_message.strip()
    try:
        address = PeerAddress.parse(text) if len(text) < MAX_ADDRESS_TEXT else None
    except ValueError:
        address = None
    if address is None or address.peer_id is None:
        return MatchmakingError(f"the leader {leader} follows another, named unreadably")
    return LeaderFollows(f"the leader {leader} follows {address.peer_id}", address.peer_id, address)
