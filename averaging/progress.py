"""Swarm-wide training progress through the DHT.

Each peer publishes ``{epoch, samples, samples_per_s, shard}`` under ``{prefix}.progress``
(subkey = its owner-signed ``peer_subkey``, so nobody else can write or squat on its record) and reads
everyone's. From that every peer decides on its own, and consistently with the others, when the
swarm has accumulated ``target_batch_size`` samples for the current epoch (time to average and
step) and whether it has fallen behind (time to load state from peers). Every record is a claim:
the swarm's epoch is the one backed by evidence (``epoch_evidence.py``), not the highest claimed.
The data shard a record names (``I/N`` of the task's data, None: not said) only steers which shard
a newcomer picks (the daemon's ``--data-shard auto``); nothing here counts it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dht.peer_dictionary import peer_entries, peer_subkey
from peer import PeerID

from .epoch_evidence import EpochEvidence
from .group import is_counter

__all__ = ["PeerProgress", "SwarmProgress", "ProgressTracker"]

# A record outlives a few missed refreshes (peers publish at least every second while training),
# then disappears with a dead peer.
PROGRESS_TTL = 15.0
# No peer's samples count for more than this many times the typical peer's in an epoch: honest
# volunteers differ in speed (a GPU peer may do several times a CPU peer's work), so a fast peer
# loses little by the bound, while a liar alone with one honest peer can at most end its epoch
# after a fifth of the target instead of at once.
MAX_SAMPLE_SHARE = 4
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
        return own + sum(min(claim, bound) for claim in claims)

    def ready_to_step(self, epoch: int, target_batch_size: int) -> bool:
        """The swarm finished ``epoch``: enough samples, or the evidence says it moved past it."""
        return self.epoch > epoch or self.samples_at(epoch) >= target_batch_size

    @property
    def samples_per_s(self) -> float:
        return sum(p.samples_per_s for p in self.peers.values())


class ProgressTracker:
    """Publishes this peer's progress record and reads everyone's, weighing them as evidence.

    ``samples_per_epoch``: how many of the swarm's samples an epoch takes (the target batch size),
    which bounds how fast claims may advance; None where epochs are not counted in samples."""

    def __init__(self, dht, prefix: str, samples_per_epoch: int | None = None):
        self.dht = dht
        self.key = f"{prefix}.progress"
        self.me = dht.host.peer_id
        self.subkey = peer_subkey(dht.host.identity.public_key)
        self.evidence = EpochEvidence(self.me, samples_per_epoch)
        self.data_shard: tuple[int, int] | None = None  # named in every record this tracker publishes

    async def publish(self, progress: PeerProgress) -> None:
        if progress.shard is None and self.data_shard is not None:
            progress = dataclasses.replace(progress, shard=self.data_shard)
        await self.dht.store(self.key, progress.to_wire(), self.dht.clock.time() + PROGRESS_TTL, subkey=self.subkey)

    async def records(self) -> dict[PeerID, PeerProgress]:
        """Every other peer's live record as it claims it (no evidence weighed)."""
        found = await self.dht.get(self.key, latest=True)
        return {
            peer: progress
            for peer, progress in peer_entries(found, _parse, now=self.dht.clock.time())
            if peer != self.me
        }

    async def fetch(self, mine: PeerProgress) -> SwarmProgress:
        found = await self.dht.get(self.key, latest=True)
        peers = {self.me: mine}
        peers.update(
            (peer, progress)
            for peer, progress in peer_entries(found, _parse, now=self.dht.clock.time())
            if peer != self.me
        )
        return SwarmProgress(peers, self.evidence.evidenced(peers, mine.epoch, self.dht.clock.monotonic()), self.me)


def _parse(peer: PeerID, body: Any) -> PeerProgress:
    return PeerProgress.from_wire(body)
