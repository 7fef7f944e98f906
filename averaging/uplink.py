"""Sharing this peer's uplink between the connections of one round, sans I/O.

In an all-reduce every peer streams to every other peer at once: its parts to each reducer, its
averages back to each sender. Left to TCP, the flows through one uplink do not share it evenly:
each shaped link's queue fills, flows lose packets at different times, and some run ahead while
others fall behind. The round waits for the slowest flow, so the uplink idles at the end while the
late flows finish. Measured in the lab (4 peers, 100 Mbit/s tbf links), plain TCP moving an
all-reduce's bytes between the hosts, with no dependencies at all, reached 0.80-0.84 of the
line-rate bound (``benchmarks/wan.py``, part ``raw_alltoall``), and peerd's all-reduce the same.

A peer that knows its uplink (``uplink``, bytes per second) therefore caps each connection of the
round at its share: the uplink times the share of the round's upload that goes through that
connection, times ``PACING_SHARE``. What goes through a connection is known as the round uses it:
our parts to a reducer go on the connection we stream them on, our averages to a sender on the
one its stream came in on, and these are one connection or two. Every flow then runs at the rate
that makes all of them end together, no queue builds, and the same all-to-all reached 0.93-0.96
of the bound. The caps add up to a little under the whole uplink (``PACING_SHARE``) because a
queue that does build brings the unfairness back: caps adding up to 99% of the link measured
0.90, and to 98% 0.91-0.96, while 97% and 95% gave peerd's all-reduce 0.950-0.951 and 0.933-0.934
(each the line-rate fraction of the lab's 4-peer, 100 Mbit/s round).

Only flows that cross the uplink share it: a member that announces the same host as we do (a peer
per GPU on one machine, both reached directly) is left out, its connection unpaced, so that
neither is its free flow held to an uplink share nor the uplink left partly idle for it.

A declared uplink below the real one wastes the difference; one more than ~3% above it leaves TCP
to share the link as before. The caps are lifted when the round ends.

A peer whose operator declared nothing measures its uplink instead (``UplinkEstimate``), as BBR
does: the best sustained rate at which its bytes were acknowledged in a round that TCP paced alone
(``link_speed.ThroughputMeter``: the uplink was full then, since every flow of the round had bytes
to send), and paces the rounds after it to share that. A paced round cannot show a faster link
(its caps bound what it sends), so every ``PROBE_EVERY``-th round goes unpaced and measures again.
A paced round whose bytes went out clearly slower than its caps allowed was held back by the link,
not by them, and the estimate drops so that the caps add up to what that round delivered (never
below ``MAX_LOWERING`` of the last unpaced reading: slow readers hold a round back too): an
unpaced round's reading is often high, since acknowledgements that queued behind the other
direction's data come in bursts (1.02-1.22x the link in the lab's 50 ms queues), while a paced
round's flows and their acknowledgements are smooth (0.95 of the link when it holds them back).
"""

from __future__ import annotations

from typing import NamedTuple

from peer import PeerAddress

from .group import GroupInfo
from .partition import AllReducePlan

__all__ = [
    "AVERAGES",
    "MAX_LOWERING",
    "MIN_EVEN_SHARE",
    "PACING_SHARE",
    "PARTS",
    "PROBE_EVERY",
    "UploadFigures",
    "UplinkEstimate",
    "uplink_shares",
]

PACING_SHARE = 0.97
# No rate below this fraction of an even split of the paced uplink. Shards follow the reducers'
# bandwidth claims, so a claim of next to nothing buys a shard of a value or two, and a rate that
# small (bytes per second) would have the part's framing, and any other call on that connection
# during the round, take minutes. A flow that small ends at once at the floor rate, so the floor
# costs the other flows nothing; at worst (every flow at the floor) the caps add up to 1/32 more.
MIN_EVEN_SHARE = 1 / 32


# One round in this many goes unpaced to measure the uplink again (at worst that round shares the
# link as TCP does, as every round would with no estimate).
PROBE_EVERY = 8
# A paced round whose upload peaked below this share of its caps' sum was held back by the link,
# not by the caps: the link is slower than the estimate. (A round that its caps held back reads
# 0.97-0.99 of their sum: the lab's 100 Mbit/s links, the uplink declared.)
SLOWER_THAN_CAPS = 0.95

# A paced round lowers the estimate to no less than this share of what the last unpaced round read:
# all our flows add up to what a round shows, so members that read slowly (a slow downlink, or a
# hostile peer reading at a crawl on purpose) hold it back as a slow link would, and must not push
# our rounds down round after round until the next probe.
MAX_LOWERING = 0.5

PARTS = "parts"  # our parts of the peer's shard (we send, it reduces)
AVERAGES = "averages"  # our shard's average (we reduce, it sends)


def uplink_shares(plan: AllReducePlan, group: GroupInfo, me, uplink: float) -> dict[tuple, float]:
    """The pacing rate (bytes/s) for what we send each other member of ``group``, keyed by
    ``(peer, PARTS)`` and ``(peer, AVERAGES)``: ``uplink`` split in proportion to the values each
    carries. A connection carrying both (the usual case: one connection per pair of peers) is
    paced at the sum; two peers that dialed each other at once each send one kind on each."""
    reducers = [member.peer_id for member in group.reducers]
    my_shard = reducers.index(me) if me in reducers else None
    member = group.member(me)
    we_send = member is not None and member.mode.sends
    ours = member.address if member is not None else None
    owed: dict[tuple, int] = {}
    for other in group.members:
        if other.peer_id == me or _same_machine(ours, other.address):
            continue
        if we_send and other.peer_id in reducers and plan.shard_sizes[reducers.index(other.peer_id)]:
            owed[(other.peer_id, PARTS)] = plan.shard_sizes[reducers.index(other.peer_id)]
        if my_shard is not None and other.mode.sends and plan.shard_sizes[my_shard]:
            owed[(other.peer_id, AVERAGES)] = plan.shard_sizes[my_shard]
    total = sum(owed.values())
    floor = uplink * PACING_SHARE / max(1, len(owed)) * MIN_EVEN_SHARE
    return {key: max(floor, uplink * PACING_SHARE * values / total) for key, values in owed.items()}


def _same_machine(ours: PeerAddress | None, theirs: PeerAddress | None) -> bool:
    """Whether bytes to ``theirs`` stay off our uplink: both reached directly at one host. (A
    relayed address names the relay's host, which is no member's own machine.)"""
    if ours is None or theirs is None or ours.relay is not None or theirs.relay is not None:
        return False
    return ours.host == theirs.host


class UploadFigures(NamedTuple):
    """What a round shows of this peer's uplink."""

    rate: float | None  # the best sustained rate our bytes were delivered at (bytes/s), if measurable
    paced_at: float | None  # the uplink (bytes/s) the round's caps shared; None: TCP paced it alone


class UplinkEstimate:
    """The uplink (bytes/s) a peer's next round paces its connections to share, sans I/O: the
    operator's figure where one was declared, else the one measured (see the module's text)."""

    def __init__(self, declared: float | None = None, probe_every: int = PROBE_EVERY):
        self.declared = declared
        self.probe_every = probe_every
        self.measured: float | None = None
        self.probed: float | None = None  # what the last unpaced round read
        self.paced_rounds = 0  # rounds paced since that one, finished or not

    @property
    def value(self) -> float | None:
        """The uplink as known now (declared or measured), whether or not the next round probes."""
        return self.declared if self.declared is not None else self.measured

    def for_next_round(self) -> float | None:
        """The uplink to pace the next round at (call once per round); None: let TCP share the
        link and measure it, which every ``probe_every``-th round does, and every round until one
        has measured it."""
        if self.declared is not None:
            return self.declared
        if self.measured is None or self.paced_rounds >= self.probe_every - 1:
            return None
        self.paced_rounds += 1
        return self.measured

    def observe(self, figures: UploadFigures | None) -> None:
        """Take in what a round showed (rounds that moved too few bytes to tell change nothing)."""
        if self.declared is not None or figures is None or figures.rate is None:
            return
        if figures.paced_at is None:
            self.measured = self.probed = figures.rate
            self.paced_rounds = 0
        elif figures.rate < SLOWER_THAN_CAPS * PACING_SHARE * figures.paced_at:
            # held back by the link: the caps add up to what it delivered, but no lower than
            # MAX_LOWERING of the last reading, whatever slow readers held our flows back
            floor = MAX_LOWERING * self.probed if self.probed is not None else 0.0
            self.measured = max(figures.rate / PACING_SHARE, floor)
