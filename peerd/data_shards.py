"""``--data-shard auto``: a peer trains the part of the task's data that the fewest live peers train.

Shard ``I/N`` is every N-th item of the task's seeded shuffle, from the I-th (``ShardSpec``). Two
claims of different counts still compare exactly: ``I/N`` and ``J/M`` share the items whose
position is I mod N and J mod M, which exist when I = J (mod gcd(N, M)) and are then 1/lcm(N, M)
of the data. So a peer that chose ``0/1`` alone, one that chose ``1/3`` later and one started with
an explicit ``--data-shard 2/4`` all count, each for the part of the data it covers.

The rule (``ShardChoice``, no I/O): with ``n`` peers holding a live progress record, this one
included, the data splits into ``N = min(n, MAX_AUTO_SHARDS)`` shards and the peer takes the shard
``J/N`` that the counted claims cover least (the sum, over claims, of the fraction of ``J/N`` each
covers); a shard ``J/M`` of a smaller count ``M`` that a counted claim uses is a candidate too, and
wins when it is covered strictly less (the other half of a peer that chose halves while it saw only
two peers, where every third would overlap that half). Counted are the claims of peers that have
chosen (every record but a ``choosing`` one) and of peers still choosing that rank before this one
(by a hash of the peer ID). Ties go by a
hash of (peer ID, J), different for every peer, so peers that see the same records spread out
instead of all taking shard 0.

Peers that start together settle in rank order (``claim_shard``): each publishes its choice as a
``choosing`` record, waits ``SETTLE`` for the others' records to arrive, reads them and chooses
again; it is done when a round changed neither its choice nor the claims it counts and none of
those is still a choice, or after ``MAX_ROUNDS``. The first in rank counts none of the others and
is done after two reads; the second waits for the first's final choice and counts it, and so on:
three peers started at once take three different shards within a few rounds, even when one's reads
are slow and its first choice, made before it saw the others, stays in its record for a while. A
choice that never becomes final (its peer crashed, or a hostile record ranked first) holds the
later-ranked choosers for all ``MAX_ROUNDS`` (about 4 s), after which they settle on their best
guess; so do more than about seven peers choosing at once, the last in rank.

Re-evaluation: none during a run. A peer chooses once, before its task's data loads, and keeps the
shard (its batches follow one seeded order over it; moving would reload the data and restart that
order). The swarm still spreads over the data as it changes: every newcomer takes the least-covered
part, and a peer that left stops counting once its record expires (``PROGRESS_TTL``). A restarted
peer chooses again.

A shard in a record is a claim: a peer lying about its shard can make newcomers choose a less
useful shard, nothing more; it changes neither what is averaged nor how.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping

import trio

from averaging.progress import PROGRESS_TTL, PeerProgress, ProgressTracker
from peer import PeerID

__all__ = ["ShardChoice", "choose_shard", "overlap", "claim_shard", "hold_claim", "publish_claim", "MAX_AUTO_SHARDS"]

log = logging.getLogger("peerd.shards")

# At most this many shards: the built-in tasks' smallest data set (digits: 1,437 training images)
# still gives every shard more than two batches of 32, and a swarm larger than this shares shards
# (the least-covered rule keeps how often each is trained even).
MAX_AUTO_SHARDS = 16
# Between publishing a choice and reading the others': a DHT store and get take milliseconds on a
# LAN and a few hundred on a WAN; peers that start within this of each other see each other.
SETTLE = 0.5
# Peers choosing at once settle one per round in rank order; later ones are told apart sooner.
MAX_ROUNDS = 8
# A held claim is stored again this often: three times per record lifetime, so one lost store
# does not let it lapse.
HOLD_PERIOD = PROGRESS_TTL / 3


def overlap(candidate: tuple[int, int], claim: tuple[int, int]) -> float:
    """The fraction of shard ``candidate`` (index, count) that shard ``claim`` also holds."""
    (j, count), (i, other) = candidate, claim
    if (i - j) % math.gcd(count, other):
        return 0.0
    return count / math.lcm(count, other)


def _rank(peer: PeerID) -> bytes:
    return hashlib.sha256(b"peerd-shard-rank\0" + peer.to_bytes()).digest()


def _tie_break(peer: PeerID, index: int) -> bytes:
    return hashlib.sha256(b"peerd-shard-tie\0" + peer.to_bytes() + index.to_bytes(4, "big")).digest()


def choose_shard(me: PeerID, records: Mapping[PeerID, PeerProgress]) -> tuple[tuple[int, int], frozenset]:
    """(the shard for ``me``, the claims counted for it) given the other peers' live ``records``."""
    count = max(1, min(len({peer for peer in records if peer != me}) + 1, MAX_AUTO_SHARDS))
    mine = _rank(me)
    counted = frozenset(
        (peer, record.shard)
        for peer, record in records.items()
        if peer != me and record.shard is not None and (not record.choosing or _rank(peer) < mine)
    )
    # Besides the count of live peers, the counts the counted claims use: when a peer chose halves
    # while it saw only two peers, a third that takes the other half leaves no part of the data
    # trained twice by them, where any third would overlap that half.
    counts = {count} | {shard[1] for _, shard in counted if shard[1] < count}
    candidates = [(j, n) for n in counts for j in range(n)]

    def rank(candidate: tuple[int, int]) -> tuple:
        coverage = round(sum(overlap(candidate, shard) for _, shard in counted), 9)
        # ties go to the live count, then by a hash that differs for every peer
        return coverage, candidate[1] != count, _tie_break(me, candidate[0]), candidate[1]

    return min(candidates, key=rank), counted


class ShardChoice:
    """Rounds of choosing: ``update(records)`` after each read of the others' records returns the
    choice to publish next; ``done`` once a round changed nothing and every claim it counts is
    final (or ``max_rounds`` passed)."""

    def __init__(self, me: PeerID, max_rounds: int = MAX_ROUNDS):
        self.me = me
        self.max_rounds = max_rounds
        self.rounds = 0
        self.shard: tuple[int, int] | None = None
        self.done = False
        self.counted: frozenset = frozenset()  # the claims the last round counted

    def update(self, records: Mapping[PeerID, PeerProgress]) -> tuple[int, int]:
        shard, counted = choose_shard(self.me, records)
        self.rounds += 1
        # A counted claim still marked choosing may yet change (its peer's reads may be slow, and its
        # first choice counted fewer peers): settled only once every counted claim is final.
        settled = not any(records[peer].choosing for peer, _ in counted)
        unchanged = shard == self.shard and counted == self.counted
        self.done = (settled and unchanged) or self.rounds >= self.max_rounds
        self.shard, self.counted = shard, counted
        return shard


async def claim_shard(
    tracker: ProgressTracker, *, settle: float = SETTLE, max_rounds: int = MAX_ROUNDS
) -> tuple[int, int]:
    """Choose this peer's shard among the peers whose records ``tracker`` reads (see the module's
    docstring), publishing each round's choice; the tracker names the final one in every record
    from then on."""
    choice = ShardChoice(tracker.me, max_rounds)
    while True:
        shard = choice.update(await tracker.records())
        if choice.done:
            break
        await tracker.publish(PeerProgress(0, 0, 0.0, shard, choosing=True))
        await trio.sleep(settle)
    await publish_claim(tracker, shard)
    log.info(
        "training data shard %d/%d (the least covered of %d, after %d rounds; counted: %s)",
        *shard,
        shard[1],
        choice.rounds,
        ", ".join(f"{index}/{count}" for _, (index, count) in sorted(choice.counted, key=str)) or "none",
    )
    return shard


async def publish_claim(tracker: ProgressTracker, shard: tuple[int, int]) -> None:
    """Store this peer's final claim of ``shard`` (chosen, or given with ``--data-shard I/N``), and
    name it in every record the tracker publishes from then on. A given shard is claimed at once
    too: newcomers choosing while its data loads would otherwise not count it."""
    tracker.data_shard = shard
    await tracker.publish(PeerProgress(0, 0, 0.0, shard))


async def hold_claim(tracker: ProgressTracker, shard: tuple[int, int], period: float = HOLD_PERIOD) -> None:
    """Store the final claim again every ``period`` until cancelled. Run it while the task's data
    loads, which can outlast a record's life (``PROGRESS_TTL``): without it the claim would lapse
    before the trainer's first progress record names the shard, and a newcomer choosing then would
    not count it. Cancel it before the trainer publishes: its records carry the real progress."""
    while True:
        await trio.sleep(period)
        await tracker.publish(PeerProgress(0, 0, 0.0, shard))
