"""Where a large swarm declares itself for matchmaking: one DHT key per cell, not one for everyone.

With one key, ``{prefix}.matchmaking``, every peer reads every peer's declaration every round:
O(N) signed records per read, O(N^2) across the swarm, all of it on the k nodes that hold the key.
So a swarm larger than a few groups splits into ``count`` cells, each a key of its own holding
about ``CELL_GROUPS`` groups' worth of declarations; a read costs the same whatever the swarm's
size, and the load spreads over ``count`` sets of holders. Within a cell the Moshpit grid
(``matchmaking_rules``) forms the groups, as it does for a small swarm in its single key.

Which cell a peer is in is a hash of its peer ID and the round's period (``CELL_ROUNDS`` rounds,
the grid's depth within a cell, so that the cell reaches its exact mean before it is reshuffled):
nobody chooses a cell, every reader can check that a declaration belongs in the cell it is read
from, and each period mixes the swarm's cells afresh, so values travel between cells as they do
between groups.

Every peer must agree on ``count``, or peers would declare under keys the others never read. It
comes from a census: the k nodes nearest to a target that every peer derives from the prefix and
the wall-clock period (``census_target``), from whose distances Kademlia's size estimate
(``dht.routing.swarm_estimate``) follows. Peers that look up the same target find the same k nodes, and so
the same estimate, without anyone announcing a size; the target moves every ``CENSUS_PERIOD_S``,
so no node holds the census for long. The estimate counts DHT nodes: a DHT shared by several
prefixes, or stuffed with nodes near one target, makes cells sparser than they should be, which
``MAX_CELLS`` and the cells' own width (``CELL_GROUPS`` groups) bound.

Sans I/O: the matchmaker does the lookup and the reads.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from dht.routing import swarm_estimate

__all__ = [
    "CELL_GROUPS",
    "CELL_ROUNDS",
    "bucket_of",
    "CENSUS_HYSTERESIS",
    "CENSUS_PERIOD_S",
    "Cells",
    "KEYSPACE",
    "MAX_CELLS",
    "MIN_CELL_SWARM",
    "PROBE_REACH",
    "more_crowded",
    "larger_swarm",
    "crowd_counts",
    "crowd_wins",
    "census_band",
    "probe_counts",
    "census_target",
    "next_cell_count",
    "sparse_cell",
    "cell_count",
    "swarm_estimate",
]

# A cell holds between CELL_GROUPS and 2 x CELL_GROUPS groups' worth of declarations: enough that
# the grid's ragged edge and a few peers leaving or arriving do not leave anyone alone in it.
CELL_GROUPS = 2
# A peer stays in one cell for this many rounds: the grid's depth for a cell of up to
# group_size^2 peers, after which the cell holds its exact mean (for group sizes >= 2 x CELL_GROUPS;
# smaller groups take more rounds, and the next period mixes them on).
CELL_ROUNDS = 2
# A swarm smaller than this keeps its single key whatever its group size: a read of a few dozen
# declarations costs little, and the grid over the whole swarm reaches the exact mean soonest.
MIN_CELL_SWARM = 64
# How often the census target moves (wall-clock seconds): a swarm's size changes over minutes.
CENSUS_PERIOD_S = 600.0
# A census moves the count only past this factor of margin (``next_cell_count``): wider than the
# estimate's spread between two censuses of one swarm (k = 20: within 1.5x of each other mostly).
CENSUS_HYSTERESIS = 1.5
# At most this many cells: 2^12 cells of 2-4 groups of 16 is 131k-262k peers, past anything we test,
# and a census inflated by nodes packed near its target can cost no more than this split.
MAX_CELLS = 1 << 12
KEYSPACE = 1 << 160
# A peer in a sparse cell looks for the swarm's count this many times above and below its own.
PROBE_REACH = 4


def cell_count(estimate: float, group_size: int) -> int:
    """How many cells a swarm of ``estimate`` peers splits into: a power of two (so that counts
    change by halves and doublings), each cell holding ``CELL_GROUPS`` to 2 x ``CELL_GROUPS``
    groups; 1 (the single key) below twice that or below ``MIN_CELL_SWARM``."""
    width = CELL_GROUPS * max(2, group_size)
    if not math.isfinite(estimate) or estimate < max(2 * width, MIN_CELL_SWARM):
        return 1
    return min(MAX_CELLS, 1 << int(math.log2(estimate / width)))


def next_cell_count(current: int, estimate: float, group_size: int) -> int:
    """The count to take after a census, from ``current``: kept while any estimate within a factor
    ``CENSUS_HYSTERESIS`` of this one would give it, else ``cell_count(estimate)``. A census is
    noisy (~1/sqrt(k)) and a swarm near a boundary would otherwise flip its count at every period,
    splitting for a while into peers that count differently; the band keeps a count until the
    swarm has clearly grown or shrunk past it."""
    return current if current in census_band(estimate, group_size) else cell_count(estimate, group_size)


def census_band(estimate: float, group_size: int) -> set[int]:
    """The counts that a swarm within a factor ``CENSUS_HYSTERESIS`` of ``estimate`` would take:
    any of them is a count the census allows (1, 2 and 4 at ~90 peers in groups of 16). Counts
    that ``cell_count`` never gives are left out: from the single key it splits into at least
    the count of its least split swarm (8 cells in groups of 4)."""
    low = cell_count(estimate / CENSUS_HYSTERESIS, group_size)
    high = cell_count(estimate * CENSUS_HYSTERESIS, group_size)
    least_split = cell_count(max(2 * CELL_GROUPS * max(2, group_size), MIN_CELL_SWARM), group_size)
    counts = {1 << bits for bits in range(low.bit_length() - 1, high.bit_length())}
    return {count for count in counts if count == 1 or count >= least_split}


def probe_counts(count: int) -> set[int]:
    """The other cell counts that a peer alone in a sparse cell of ``count`` looks at: up to
    ``PROBE_REACH`` times fewer and more. A newcomer's first census, taken while its routing table
    still fills, can fall that far below the swarm's (at 128 peers on the simulated internet: 1
    cell against the swarm's 4), and newcomers that looked only at half and twice their count
    would average among themselves for good."""
    counts = set()
    factor = 2
    while factor <= PROBE_REACH:
        counts |= {max(1, count // factor), min(MAX_CELLS, count * factor)}
        factor *= 2
    return counts - {count}


def more_crowded(found: int, count: int, than: int, than_count: int) -> bool:
    """Whether ``found`` other peers in our cell of ``count`` cells show a larger swarm than
    ``than`` others in our cell of ``than_count``: more peers in the cell, and more in the swarm
    they stand for (a cell of ``count`` holds about 1/count of the peers who count so). By the
    cells alone, a peer in a briefly sparse cell of the swarm's 4 would move to the single key
    whenever that held more stragglers, each move making it more crowded (at 128 peers on the
    simulated internet the whole swarm drifts into one key so); by the swarms alone, a few
    declarations in a cell of 4x our count would outweigh a sparse cell of ours."""
    return found > than and found * count > than * than_count


def larger_swarm(found: int, count: int, than: int, than_count: int, least: int) -> bool:
    """Whether ``found`` other peers in our cell of ``count`` cells stand for a larger swarm than
    ``than`` others in our cell of ``than_count``, being a population of their own: at least
    ``least``, and at least half as many as ours. Between counts that the census allows, the
    larger swarm wins however full our cell is: newcomers whose census counts ~90 where a swarm of
    128 keeps 4 cells keep the single key, where soon enough of them gather to be no sparse cell
    to look past, and would average among themselves beside the swarm's cells of 22. The half
    keeps a few declarations in a cell of a count 16x ours (a product of small numbers: noise, or
    sybils) from pulling a full cell away."""
    return found >= max(least, than // 2) and found * count > than * than_count


def crowd_counts(count: int, allowed: set[int], sparse: bool, counted: int | None) -> set[int]:
    """The other counts a peer in ``count`` cells reads its cell under: after a census, the others
    it ``allowed``; from a ``sparse`` cell, those near ours (``probe_counts``); and the count of a
    census that has just come in (``counted``: a newcomer's first)."""
    counts = set(allowed) | (probe_counts(count) if sparse else set()) | ({counted} - {None})
    return counts - {count}


def crowd_wins(found: int, count: int, than: int, than_count: int, allowed: set[int], least: int) -> bool:
    """Whether ``found`` others in our cell of ``count`` show a larger swarm than the ``than`` of
    ``than_count``: ``more_crowded``, or, between counts the census ``allowed``, ``larger_swarm``
    with at least ``least`` others."""
    return more_crowded(found, count, than, than_count) or (
        count in allowed and larger_swarm(found, count, than, than_count, least)
    )


def sparse_cell(group_size: int) -> int:
    """Fewer declarations than this in a cell suggest that we count cells differently from the
    swarm around us (half a cell's least width)."""
    return max(2, CELL_GROUPS * max(2, group_size) // 2)


def census_target(prefix: str, wall_time: float) -> int:
    """The ID whose nearest nodes every peer of ``prefix`` counts during the current census period."""
    period = int(wall_time // CENSUS_PERIOD_S)
    return int.from_bytes(hashlib.blake2b(f"{prefix}.census.{period}".encode(), digest_size=20).digest(), "big")


def bucket_of(data: bytes, count: int, purpose: bytes) -> int:
    """Which of ``count`` buckets ``data`` hashes into, for ``purpose`` (a personalisation of at
    most 16 bytes, so that one peer's buckets for different purposes are independent)."""
    digest = hashlib.blake2b(data, digest_size=8, person=purpose).digest()
    return int.from_bytes(digest, "big") % count


@dataclass(frozen=True)
class Cells:
    """``count`` cells of one prefix's matchmaking: which key a peer declares under in a round."""

    prefix: str
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_CELLS:
            raise ValueError(f"need 1 <= cell count <= {MAX_CELLS}")

    def cell_of(self, peer: bytes, round_number: int) -> int:
        if self.count == 1:
            return 0
        period = round_number // CELL_ROUNDS
        return bucket_of(peer + period.to_bytes(8, "big"), self.count, b"peerd-cell")

    def key(self, peer: bytes, round_number: int) -> str:
        """The key ``peer`` declares under for ``round_number``."""
        if self.count == 1:
            return f"{self.prefix}.matchmaking"
        return f"{self.prefix}.cells{self.count}.{self.cell_of(peer, round_number)}.matchmaking"

    def belongs(self, peer: bytes, round_number: int, key: str) -> bool:
        """Whether ``peer``, taking part in ``round_number``, declares under ``key``: a declaration
        read from a cell it has left (an older period, a newcomer's first look) is no candidate."""
        return self.key(peer, round_number) == key
