"""When a local-updates round ends: on the swarm's progress, not on each peer's own count, sans I/O.

A round that ends after a fixed count of local steps ends at different times on peers of
different speeds, and the differences add up: peers whose boundaries drift further apart than the
matchmaking deadline never meet in a deltas group again, and each trains alone on its shard (in
the lab's 4-peer text benchmark, 2 of 4 peers averaged in none of their rounds, and the swarm's
loss was 1.2x a single trainer's).

So a round ends, as an epoch does in collaborative mode, when the swarm's samples for it (this
peer's own, and what the others' progress records claim for the same round, each claim bounded as
``SwarmProgress.samples_at`` bounds it) reach ``local_steps`` batches for every peer taking part:
a fast peer takes more local steps, a slow one fewer, and all of them end the round within about
one progress exchange of each other. Taking part means a record within one round of ours: a peer
still finishing the previous round holds ours back until it catches up.

Each peer's own steps stay within bounds: at least ``local_steps / MAX_STRETCH`` (a few inflated
claims cannot turn rounds into single steps) and at most ``local_steps * MAX_STRETCH`` (peers that
vanished, or claim to take part and never train, cannot hold a round open). When the evidence says
the swarm already moved past our round, the round ends as soon as the lower bound allows, so a
peer that fell behind sends what it has and catches up. The bound holds there too: the evidence
takes a claim of one epoch past ours from any peer we last averaged with, or from two identities
that agree (``epoch_evidence.py``), and such claims, renewed every round, would otherwise make
every round a single step, an exchange of the whole model per batch. A peer with nobody in view
takes ``local_steps``.
"""

from __future__ import annotations

from .progress import SwarmProgress

__all__ = ["MAX_STRETCH", "round_over"]

# A peer's own steps in a round are within [local_steps / MAX_STRETCH, local_steps * MAX_STRETCH]:
# peers up to twice as fast or slow as the swarm's average still end rounds together.
MAX_STRETCH = 2


def round_over(view: SwarmProgress, epoch: int, own_steps: int, own_samples: int, local_steps: int) -> bool:
    """Whether this peer's round ``epoch`` is over, after ``own_steps`` local steps on
    ``own_samples`` samples, given ``view`` (which holds this peer's own record as of now)."""
    if own_steps < 1:
        return False
    if own_steps >= local_steps * MAX_STRETCH:
        return True
    floor = max(1, local_steps // MAX_STRETCH)
    if view.epoch > epoch:
        return own_steps >= floor
    taking_part = sum(
        1 for peer, progress in view.peers.items() if peer != view.me and abs(progress.epoch - epoch) <= 1
    )
    if taking_part == 0:
        return own_steps >= local_steps
    if own_steps < floor:
        return False
    batch = own_samples / own_steps
    # (the view may be one progress cell of the swarm: samples_at scales its sum to the swarm's)
    return view.samples_at(epoch) >= local_steps * batch * view.scale * (1 + taking_part)
