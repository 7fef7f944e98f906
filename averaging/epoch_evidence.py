"""Which epoch the swarm has reached, from progress records that are only claims, sans I/O.

Anyone can join and sign a progress record saying any epoch. A peer that believed the highest one
(one forged record at epoch 10**9) reloaded state over and over, stepped at every batch and pushed
its learning-rate schedule to its end. So a higher epoch is adopted on evidence only:

- Quorum: the evidenced epoch is the highest one that at least ``quorum`` distinct identities
  (other than this peer) claim to have reached, where ``quorum`` is EPOCH_QUORUM, or one when only
  one other peer is in view (a newcomer follows the one veteran of a two-peer swarm). One liar
  among two or more other peers moves nobody, in a running swarm or a fresh one.
- The group: the peers this one last averaged with (``vouch``) showed up at the round they
  declared, so the claim of any one of them is evidence enough. That is how a single veteran
  brings fresh peers up to its epoch once it is in their group.
- Plausibility: a peer's claim may only advance as fast as the swarm's reported samples allow
  since this peer last accepted a claim of it (RATE_SLACK times the epochs that the swarm's
  combined samples per second buy, plus one), and a peer seen for the first time may only claim
  an epoch at most one ahead of ours, unless we are fresh ourselves (epoch 0, no peer seen yet):
  then there is no history to hold a claim against, and the quorum alone decides. An implausible
  claim is left out of the evidence and logged; the peer's samples still count. The last accepted
  claim of a peer that left the view is remembered (up to MAX_REMEMBERED peers), so peers cut off
  by a partition are judged by their rate when it heals.
- Majority: an epoch that more than half of the other peers in view (and at least ``quorum``)
  claim is taken even from strangers, so a peer that was away while the whole swarm changed still
  finds its way back; Sybils would have to outnumber the peers it sees. A known peer counts here
  with its claim only as far as its rate allows.
- Averaging with a group that reached an epoch moves a peer one epoch per round
  (``Replica.count_round``), on the word of the group it actually averaged with.

A claim no higher than our own epoch + 1 is never a jump for us, so it is always taken as it is.
What this does not stop: EPOCH_QUORUM identities that agree can still make a fresh newcomer
believe their epoch, and identities that keep advancing their claims at the plausible rate can
move running peers up to RATE_SLACK times faster than the swarm trains. Several newcomers that
join a single veteran at once train among themselves until they meet it in a group.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from typing import Protocol

from peer import PeerID

__all__ = ["EPOCH_QUORUM", "RATE_SLACK", "EpochEvidence"]

log = logging.getLogger("peerd.training")

# Two identities must agree before anyone jumps: one forged record alone never moves a peer, and
# a Sybil needs a second identity (a node ID costs work, peer/node_id.py) for every lie.
EPOCH_QUORUM = 2
# Rates are measured over whole epochs and vary with load; an honest peer's epochs never advance
# four times faster than the swarm's combined rate says, while 10**9 epochs in a second always do.
RATE_SLACK = 4.0
# A peer's claimed samples/s counts at most this many times the median claim, so one peer claiming
# 1e11 samples/s cannot make any epoch jump plausible.
MAX_RATE_SHARE = 4.0
# Peers whose last accepted claim is remembered after they leave the view: a swarm's worth, so that
# a healed partition is judged by history; the oldest are forgotten first.
MAX_REMEMBERED = 4096


class Claim(Protocol):
    epoch: int
    samples_per_s: float


class EpochEvidence:
    """Keeps, per peer, the last claim accepted from it and when; ``evidenced`` turns a view of the
    swarm into the highest epoch backed by evidence."""

    def __init__(self, me: PeerID, samples_per_epoch: int | None, quorum: int = EPOCH_QUORUM):
        if quorum < 1:
            raise ValueError("the quorum is at least one peer")
        self.me = me
        self.samples_per_epoch = samples_per_epoch  # None: epochs are not counted in samples (no rate bound)
        self.quorum = quorum
        self._accepted: dict[PeerID, tuple[int, float]] = {}
        self._refused: set[PeerID] = set()
        self._seen_others = False
        self._vouched: frozenset[PeerID] = frozenset()

    def vouch(self, peers) -> None:
        """``peers`` averaged with this peer in its last round: each one's claim is evidence alone."""
        self._vouched = frozenset(peers)

    def evidenced(self, claims: Mapping[PeerID, Claim], my_epoch: int, now: float, *, scale: int = 1) -> int:
        """The highest epoch backed by evidence, never below ``my_epoch``; ``now`` in seconds;
        ``scale``: the swarm is this many times the peers of ``claims`` (a progress cell's view),
        so its combined rate is as many times theirs."""
        others = {peer: claim for peer, claim in claims.items() if peer != self.me}
        fresh = my_epoch == 0 and not self._seen_others
        rate = scale * self._epochs_per_s(claims.values())
        plausible = []
        standing = []  # for the majority: strangers' claims, and known peers' as far as plausible
        vouched = 0
        for peer, claim in others.items():
            known = self._accepted.get(peer)
            if self._plausible(peer, claim.epoch, my_epoch, now, rate, fresh):
                standing.append(claim.epoch)
                self._accepted[peer] = (claim.epoch, now)
                self._refused.discard(peer)
                plausible.append(claim.epoch)
                if peer in self._vouched:
                    vouched = max(vouched, claim.epoch)
                continue
            standing.append(claim.epoch if known is None else known[0])
            if peer not in self._refused:
                self._refused.add(peer)
                message = "ignoring peer %s's claim of epoch %d: more than the swarm's reported samples allow"
                log.warning(message, peer, claim.epoch)
        # Remember peers that left the view (a partition heals), but only so many: the oldest go.
        while len(self._accepted) > MAX_REMEMBERED:
            del self._accepted[min(self._accepted, key=lambda p: self._accepted[p][1])]
        self._refused &= set(others)
        self._seen_others = self._seen_others or bool(others)
        plausible.sort(reverse=True)
        quorum = min(self.quorum, len(others))
        agreed = plausible[quorum - 1] if 0 < quorum <= len(plausible) else 0
        standing.sort(reverse=True)
        majority = len(standing) // 2 + 1
        backed = standing[majority - 1] if len(standing) >= max(self.quorum, 2) else 0
        return max(my_epoch, agreed, vouched, backed)

    def _plausible(self, peer: PeerID, epoch: int, my_epoch: int, now: float, rate: float, fresh: bool) -> bool:
        if epoch <= my_epoch + 1:
            return True
        accepted = self._accepted.get(peer)
        if accepted is None:
            return fresh
        last_epoch, since = accepted
        return epoch <= last_epoch + 1 + max(0.0, now - since) * rate

    def _epochs_per_s(self, claims) -> float:
        """How many epochs per second the swarm's reported rates allow, with RATE_SLACK."""
        if self.samples_per_epoch is None:
            return math.inf
        rates = [claim.samples_per_s for claim in claims]
        if not rates:
            return 0.0
        cap = MAX_RATE_SHARE * statistics.median_low(rates)
        return RATE_SLACK * sum(min(rate, cap) for rate in rates) / max(self.samples_per_epoch, 1)
