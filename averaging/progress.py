"""Swarm-wide training progress through the DHT.

Each peer publishes ``{epoch, samples, samples_per_s, shard}`` under ``{prefix}.progress``
(subkey = its owner-signed ``peer_subkey``, so nobody else can write or squat on its record) and reads
everyone's. From that every peer decides on its own, and consistently with the others, when the
swarm has accumulated ``target_batch_size`` samples for the current epoch (time to average and
step) and whether it has fallen behind (time to load state from peers). Every record is a claim:
the swarm's epoch is the one backed by evidence (``epoch_evidence.py``), not the highest claimed.

A large swarm keeps its records in cells. Every peer refreshes its record about once a second, so
one key for everyone costs each reader O(N) records a second and the key's k holders O(N^2); past
``2 * PROGRESS_CELL_PEERS`` peers (by a census, ``census.py``, as matchmaking counts its cells) the
records go to ``count`` keys ``{prefix}.progress.cells{count}.{i}``, a peer's cell fixed by a hash
of its DHT node ID (which each record proves), and a peer reads only its own cell. A cell is a
uniform sample of the swarm, so ``count`` times what it holds estimates the swarm
(``SwarmProgress.scale``): samples toward the target batch, the combined rate, the rate that bounds
how fast claims may advance. Peers of one cell see the same records and step together; cells
differ by the sampling (a cell of ~64-128 peers: about a tenth), which matchmaking's reach of one
round absorbs. A peer whose cell is nearly empty (its census counted differently from the swarm's)
reads its cell at every count a swarm of its estimate may hold and moves to the fullest, at most
once a ``PROBE_PERIOD_S``.

The data shard a record names (``I/N`` of the task's data, None: not said) only steers which shard
a newcomer picks (the daemon's ``--data-shard auto``); nothing here counts it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import trio

from dht.peer_dictionary import peer_entries, peer_subkey
from peer import NodeIDProof, PeerID

from .cells import CELL_GROUPS, Cells, bucket_of
from .census import Census
from .epoch_evidence import EpochEvidence
from .group import is_counter

__all__ = ["PROGRESS_CELL_PEERS", "PeerProgress", "SwarmProgress", "ProgressTracker", "progress_cell", "progress_key"]

# A record outlives a few missed refreshes (peers publish at least every second while training),
# then disappears with a dead peer.
PROGRESS_TTL = 15.0
# No peer's samples count for more than this many times the typical peer's in an epoch: honest
# volunteers differ in speed (a GPU peer may do several times a CPU peer's work), so a fast peer
# loses little by the bound, while a liar alone with one honest peer can at most end its epoch
# after a fifth of the target instead of at once.
MAX_SAMPLE_SHARE = 4
# Peers per progress cell, at the least (a cell holds one to two times this many): enough that the
# evidence's quorum and majority have many claims to weigh and a cell's sum is within ~10% of its
# share of the swarm's.
PROGRESS_CELL_PEERS = 64
# A cell with fewer other peers than this is sparse: the swarm may count its cells differently.
SPARSE_PROGRESS_CELL = PROGRESS_CELL_PEERS // 4
# A sparse cell's neighbouring counts are read at most this often (wall-clock seconds): a lone peer,
# or a DHT shared with other runs, would otherwise read three keys at every refresh.
PROBE_PERIOD_S = 60.0
# The census, beside a progress read, takes at most this long (it runs once per census period), and
# is looked at once a CENSUS_RETRY_S at most (a census that failed is retried then).
CENSUS_DEADLINE = 20.0
CENSUS_RETRY_S = 60.0
# The group size that makes ``cells.cell_count`` count cells of PROGRESS_CELL_PEERS.
CELL_GROUP = PROGRESS_CELL_PEERS // CELL_GROUPS

# The most shards a record may claim to split the data into: far more than any swarm needs, and
# small enough that overlaps of two claims (``lcm`` of the counts) stay cheap integers.
MAX_CLAIMED_SHARDS = 1 << 16


@dataclass(frozen=True)
class PeerProgress:
    epoch: int
    samples: int
    samples_per_s: float
    shard: tuple[int, int] | None = None  # (index, count): the data shard this peer says it trains
    choosing: bool = False  # the shard is not final yet: the peer is still choosing it

    def to_wire(self) -> dict:
        wire: dict[str, Any] = {"epoch": self.epoch, "samples": self.samples, "sps": self.samples_per_s}
        if self.shard is not None:
            wire["shard"] = list(self.shard)
        if self.choosing:
            wire["choosing"] = True
        return wire

    @classmethod
    def from_wire(cls, body: Any) -> PeerProgress:
        """Raises ValueError for anything but a sane record (the DHT is open to everyone)."""
        if not isinstance(body, dict):
            raise ValueError("a progress record is a map")
        epoch, samples, sps = body.get("epoch"), body.get("samples"), body.get("sps")
        if type(epoch) is not int or type(samples) is not int or not isinstance(sps, (int, float)):
            raise ValueError("a progress record needs integer epoch and samples and a numeric rate")
        if not (is_counter(epoch) and is_counter(samples)) or not 0 <= sps < 1e12:
            raise ValueError("progress out of range")
        return cls(epoch, samples, float(sps), _shard_claim(body.get("shard")), body.get("choosing") is True)


def _shard_claim(raw: Any) -> tuple[int, int] | None:
    """A record's shard, or None for one that is absent or malformed (the rest of the record still
    counts: a shard is only a hint for newcomers)."""
    if not isinstance(raw, (list, tuple)) or len(raw) != 2 or not all(type(x) is int for x in raw):
        return None
    index, count = raw
    return (index, count) if 0 <= index < count <= MAX_CLAIMED_SHARDS else None


@dataclass(frozen=True)
class SwarmProgress:
    """What one peer knows of the swarm at one moment: everyone's claims, and the epoch that the
    evidence backs (``None``: the claims are taken as they are, for views built from local data)."""

    peers: dict[PeerID, PeerProgress]
    evidenced: int | None = None
    me: PeerID | None = None  # whose view: our own samples are a fact, not a claim
    scale: int = 1  # the swarm is this many times the peers in view (their progress cells' count)

    @property
    def epoch(self) -> int:
        if self.evidenced is not None:
            return self.evidenced
        return max((p.epoch for p in self.peers.values()), default=0)

    def samples_at(self, epoch: int) -> int:
        """The samples the swarm accumulated for ``epoch``: ours in full, every other peer's claim
        up to ``MAX_SAMPLE_SHARE`` times the larger of our own count and the lower median of the
        positive claims. One record claiming 10**15 samples cannot end every peer's epoch at once
        (the lower median is an honest claim whenever fewer than half of the claims are lies),
        and stale low records of peers that stopped cannot hold back the ones still training."""
        mine = self.peers.get(self.me) if self.me is not None else None
        own = mine.samples if mine is not None and mine.epoch == epoch else 0
        claims = [p.samples for peer, p in self.peers.items() if p.epoch == epoch and peer != self.me]
        positive = sorted(c for c in [*claims, own] if c > 0)
        if not positive:
            return 0
        bound = MAX_SAMPLE_SHARE * max(positive[(len(positive) - 1) // 2], own)
        return self.scale * (own + sum(min(claim, bound) for claim in claims))

    def ready_to_step(self, epoch: int, target_batch_size: int) -> bool:
        """The swarm finished ``epoch``: enough samples, or the evidence says it moved past it."""
        return self.epoch > epoch or self.samples_at(epoch) >= target_batch_size

    @property
    def samples_per_s(self) -> float:
        return self.scale * sum(p.samples_per_s for p in self.peers.values())


def progress_cell(node_id: bytes, count: int) -> int:
    """The progress cell among ``count`` of the peer with DHT node ID ``node_id`` (its puzzle's
    outcome, ``peer/node_id.py``): landing in a chosen cell takes ``count`` solved puzzles on
    average, so filling one with identities costs the puzzle times the cell count each."""
    return 0 if count == 1 else bucket_of(node_id, count, b"peerd-progress")


def progress_key(prefix: str, count: int, cell: int) -> str:
    """Where the records of cell ``cell`` of ``count`` live (one cell: the swarm's single key)."""
    return f"{prefix}.progress" if count == 1 else f"{prefix}.progress.cells{count}.{cell}"


class ProgressTracker:
    """Publishes this peer's progress record and reads those of its progress cell (the whole
    swarm's, below ``2 * PROGRESS_CELL_PEERS`` peers), weighing them as evidence.

    ``samples_per_epoch``: how many of the swarm's samples an epoch takes (the target batch size),
    which bounds how fast claims may advance; None where epochs are not counted in samples."""

    def __init__(self, dht, prefix: str, samples_per_epoch: int | None = None):
        self.dht = dht
        self.prefix = prefix
        self.count = 1  # progress cells, from the census
        self.census = Census(f"{prefix}.progress", counts="progress records")
        self._probed_at = -math.inf  # (the DHT's wall clock) when a sparse cell was last probed
        self._census_tried = -math.inf  # (the DHT's wall clock) when the census was last looked at
        self.me = dht.host.peer_id
        self.node_id = dht.host.node_id.node_id
        self.subkey = peer_subkey(dht.host.identity.public_key)
        self.evidence = EpochEvidence(self.me, samples_per_epoch)
        self.data_shard: tuple[int, int] | None = None  # named in every record this tracker publishes

    @property
    def key(self) -> str:
        """Where our record goes now."""
        return progress_key(self.prefix, self.count, progress_cell(self.node_id, self.count))

    async def publish(self, progress: PeerProgress) -> None:
        if progress.shard is None and self.data_shard is not None:
            progress = dataclasses.replace(progress, shard=self.data_shard)
        wire = {**progress.to_wire(), "nonce": self.dht.host.node_id.nonce}  # (see ``_parse``)
        # (a majority of the holders: a trainer that exchanges in line would wait out a gone one's timeout)
        expiration = self.dht.clock.time() + PROGRESS_TTL
        await self.dht.store(self.key, wire, expiration, subkey=self.subkey, majority=True)

    async def records(self) -> dict[PeerID, PeerProgress]:
        """Every other live record of our progress cell as it claims it (no evidence weighed)."""
        await self._recount()
        found = await self._read(self.count)
        if len(found) < SPARSE_PROGRESS_CELL and self.census.estimate >= 2 * SPARSE_PROGRESS_CELL:
            found = await self._probe(found)
        return found

    async def fetch(self, mine: PeerProgress) -> SwarmProgress:
        peers = {self.me: mine, **await self.records()}
        # A cell that still looks sparse after probing (our reads fail, or we are in the wrong count)
        # is no sample of the swarm: scaled up, our own samples alone would count as a cell's and
        # we would step after a fraction of the target. Unscaled, we step late, never early.
        scale = self.count if len(peers) >= SPARSE_PROGRESS_CELL else 1
        now = self.dht.clock.monotonic()
        return SwarmProgress(peers, self.evidence.evidenced(peers, mine.epoch, now, scale=scale), self.me, scale)

    async def _read(self, count: int) -> dict[PeerID, PeerProgress]:
        """The live records of our cell among ``count``, but ours and those of other cells' peers."""
        cell = progress_cell(self.node_id, count)
        found = await self.dht.get(progress_key(self.prefix, count, cell), latest=True)

        def parse(peer: PeerID, body: Any) -> PeerProgress:
            progress, node_id = self._parse(peer, body)
            if progress_cell(node_id, count) != cell:
                raise ValueError("a record of another cell's peer")
            return progress

        return {
            peer: progress
            for peer, progress in peer_entries(found, parse, now=self.dht.clock.time())
            if peer != self.me
        }

    async def _recount(self) -> None:
        """Take the census when its period is new and apply its count: looked at once a
        ``CENSUS_RETRY_S`` at most, so a census that fails is not retried at every refresh."""
        now = self.dht.clock.time()
        if now - self._census_tried >= CENSUS_RETRY_S:
            self._census_tried = now
            current = Cells(f"{self.prefix}.progress", self.count)
            await self.census.take(self.dht, lambda: current, CELL_GROUP, CENSUS_DEADLINE)
        self.count = self.census.next_round(Cells(f"{self.prefix}.progress", self.count)).count

    async def _probe(self, found: dict[PeerID, PeerProgress]) -> dict[PeerID, PeerProgress]:
        """Our cell is sparse: read our cell at every count a swarm of about our census's
        estimate may hold (the census's margin spans up to three) and at half and twice ours, and
        move to the fullest."""
        now = self.dht.clock.time()
        if now - self._probed_at < PROBE_PERIOD_S:
            return found
        self._probed_at = now
        counts = (self.census.band | {max(1, self.count // 2), self.count * 2}) - {self.count}
        probed: dict[int, dict[PeerID, PeerProgress]] = {}

        async def probe(count: int) -> None:
            with trio.move_on_after(CENSUS_DEADLINE):
                probed[count] = await self._read(count)

        async with trio.open_nursery() as nursery:
            for count in sorted(counts):
                nursery.start_soon(probe, count)
        best = max(probed, key=lambda count: len(probed[count]), default=self.count)
        if best in probed and len(probed[best]) > len(found):
            self.count, found = best, probed[best]
        return found

    def _parse(self, peer: PeerID, body: Any) -> tuple[PeerProgress, bytes]:
        """A record and its writer's node ID, if it comes with the writer's node-ID proof at the
        run's difficulty: an identity costs the puzzle, so a writer cannot fill a cell with free
        signing keys, and the node ID places it in its cell."""
        nonce = body.get("nonce") if isinstance(body, dict) else None
        proof = NodeIDProof.claimed(peer, nonce, self.dht.host.node_id_difficulty)
        return PeerProgress.from_wire(body), proof.node_id
