"""A higher epoch is adopted on evidence, not on one claim.

One forged (self-signed) progress record claiming epoch 10**9 used to cut a swarm's training rate
thirtyfold, with state reloads at every batch, and push an embedded optimizer's learning-rate
schedule to its end.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import trio

from averaging.epoch_evidence import EPOCH_QUORUM, EpochEvidence
from averaging.optimizer import CollaborativeOptimizer
from averaging.progress import MAX_SAMPLE_SHARE, PeerProgress, ProgressTracker, SwarmProgress
from dht.node import DHTNode
from peer import PeerID
from peerd.tasks import ShardSpec, digits_task

ME = PeerID(b"\x00" * 20)
PEERS = [PeerID(bytes([i]) * 20) for i in range(1, 6)]
FORGED = 10**9


@dataclass
class Claim:
    epoch: int
    samples_per_s: float = 100.0


def claims(*epochs: int, me: int = 0) -> dict[PeerID, Claim]:
    return {ME: Claim(me), **{peer: Claim(epoch) for peer, epoch in zip(PEERS, epochs, strict=False)}}


def test_one_liar_among_veterans_moves_nobody_and_is_logged(caplog) -> None:
    evidence = EpochEvidence(ME, samples_per_epoch=1000)
    assert evidence.evidenced(claims(7, 7, 7), 0, now=0.0) == 7  # a newcomer: the swarm's epoch
    with caplog.at_level(logging.WARNING, logger="peerd.training"):
        for second in range(1, 20):
            assert evidence.evidenced(claims(7, 7, FORGED, me=7), 7, now=float(second)) == 7
    assert sum("ignoring peer" in r.message for r in caplog.records) == 1  # logged once, not per view
    # A fresh peer meeting the same swarm: the quorum alone holds the liar off.
    assert EpochEvidence(ME, 1000).evidenced(claims(7, 7, FORGED), 0, now=0.0) == 7


def test_a_single_veteran_brings_fresh_peers_to_its_epoch_but_not_a_running_peer_to_a_stranger() -> None:
    assert EpochEvidence(ME, 1000).evidenced(claims(40), 0, now=0.0) == 40  # a two-peer swarm
    # One veteran and two newcomers: one claim against two, until the veteran is in our group.
    fresh = EpochEvidence(ME, 1000)
    assert fresh.evidenced(claims(40, 0), 0, now=0.0) == 0
    fresh.vouch([PEERS[0]])
    assert fresh.evidenced(claims(41, 0), 0, now=1.0) == 41
    # A fresh swarm with one liar in it: the liar is one claim against one.
    assert EpochEvidence(ME, 1000).evidenced(claims(FORGED, 0), 0, now=0.0) == 0
    running = EpochEvidence(ME, 1000)
    assert running.evidenced(claims(5, 5), 5, now=0.0) == 5
    assert running.evidenced(claims(5, 5, FORGED), 5, now=1.0) == 5  # a stranger claiming far ahead
    # Two identities agreeing: a quorum, but strangers' first claims far ahead of us stay implausible
    # (and two of four are no majority).
    assert running.evidenced(claims(5, 5, FORGED, FORGED), 5, now=2.0) == 5


def test_claims_advance_only_as_fast_as_the_reported_samples_allow() -> None:
    # Three peers at 100 samples/s, 1000 samples an epoch: 0.3 epochs/s, x4 slack = 1.2 epochs/s.
    evidence = EpochEvidence(ME, samples_per_epoch=1000)
    assert evidence.evidenced(claims(10, 10, me=10), 10, now=0.0) == 10
    assert evidence.evidenced(claims(500, 500, me=10), 10, now=1.0) == 10  # 490 epochs in a second
    assert evidence.evidenced(claims(13, 13, me=10), 10, now=2.0) == 13  # three epochs in two seconds
    # A partition that heals: peers last seen a minute ago have trained on meanwhile.
    assert evidence.evidenced(claims(50, 50, me=13), 13, now=62.0) == 50
    # Peers that left the view (cut off by a partition) are judged by their last accepted claim
    # when they come back, not as strangers.
    assert evidence.evidenced(claims(me=50), 50, now=70.0) == 50
    assert evidence.evidenced(claims(80, 80, me=50), 50, now=100.0) == 80
    # A running peer that was away while the whole swarm changed: strangers, but most of its view.
    away = EpochEvidence(ME, samples_per_epoch=1000)
    assert away.evidenced(claims(4, 4, me=4), 4, now=0.0) == 4
    assert away.evidenced({ME: Claim(4), **{PeerID(bytes([9, i]) * 10): Claim(90) for i in range(3)}}, 4, 1.0) == 90
    # ... which two Sybils among three honest peers are not.
    liars = {**claims(80, 80, 80, me=80), PeerID(b"\x09" * 20): Claim(FORGED), PeerID(b"\x0a" * 20): Claim(FORGED)}
    assert evidence.evidenced(liars, 80, now=101.0) == 80
    # A claim of a huge rate counts at most MAX_RATE_SHARE times the median rate.
    liar = {**claims(80, 80, me=80), PEERS[1]: Claim(5000, samples_per_s=1e11)}
    assert evidence.evidenced(liar, 80, now=102.0) == 80
    assert EPOCH_QUORUM == 2


async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(initial_peers=initial) as node:
        task_status.started(node)
        await trio.sleep(math.inf)


async def test_a_forged_epoch_neither_reloads_state_nor_moves_the_learning_rate_schedule() -> None:
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_node, [])
        nodes = [first] + [await nursery.start(run_node, [first.address]) for _ in range(2)]
        attacker = nodes[2]
        await ProgressTracker(attacker, "forged").publish(PeerProgress(FORGED, 0, 1000.0))  # its own, signed
        peers = []
        for index, node in enumerate(nodes[:2]):
            task = digits_task(shard=ShardSpec(index, 2))
            inner = torch.optim.SGD(task.model.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
            optimizer = CollaborativeOptimizer(
                inner,
                node,
                prefix="forged",
                target_batch_size=128,
                scheduler=scheduler,
                settle_time=0.1,
                matchmaking_timeout=2.0,
                averaging_timeout=6.0,
                progress_interval=0.1,
                load_state_timeout=2.0,
            )
            peers.append((task, inner, optimizer))
        loads = [0, 0]

        async def train(i: int) -> None:
            task, _, optimizer = peers[i]
            load = optimizer.replica.load_state_from_peers

            async def counted(*args, **kwargs):
                loads[i] += 1
                return await load(*args, **kwargs)

            optimizer.replica.load_state_from_peers = counted
            while optimizer.epoch < 4:
                for batch in task.batches:
                    task.loss_fn(task.model, batch).backward()
                    await optimizer.step(len(batch[1]))
                    if optimizer.epoch >= 4:
                        break

        with trio.fail_after(60):
            async with trio.open_nursery() as training:
                for i in range(2):
                    training.start_soon(train, i)
        for (_, inner, optimizer), reloads in zip(peers, loads, strict=True):
            assert optimizer.epoch < 10, optimizer.epoch
            assert inner.param_groups[0]["lr"] == 0.5 ** (optimizer.epoch // 2)
            assert reloads == 0
        nursery.cancel_scope.cancel()


def test_one_peer_claiming_huge_sample_counts_cannot_end_everyone_s_epoch():
    me, other, sybil = (PeerID(bytes([i]) * 20) for i in (1, 2, 3))
    view = SwarmProgress(
        {me: PeerProgress(5, 10, 1.0), other: PeerProgress(5, 12, 1.0), sybil: PeerProgress(5, 10**15, 1.0)}, 5
    )
    assert view.samples_at(5) == 10 + 12 + MAX_SAMPLE_SHARE * 12  # the lie counts as 4x the median
    assert not view.ready_to_step(5, 1000)
    honest = SwarmProgress({me: PeerProgress(5, 600, 1.0), other: PeerProgress(5, 500, 1.0)}, 5)
    assert honest.ready_to_step(5, 1000)  # honest claims count in full
    fresh = SwarmProgress({me: PeerProgress(5, 0, 1.0), other: PeerProgress(5, 0, 1.0)}, 5)
    assert fresh.samples_at(5) == 0
    # stale low records of peers that stopped (cut off, say) never cap our own count, and a liar
    # next to us counts for at most 4x what we did
    stale = {other: PeerProgress(5, 3, 1.0), sybil: PeerProgress(5, 2, 1.0)}
    assert SwarmProgress({me: PeerProgress(5, 900, 1.0), **stale}, 5, me).ready_to_step(5, 900)
    lying = SwarmProgress({me: PeerProgress(5, 10, 1.0), sybil: PeerProgress(5, 10**15, 1.0)}, 5, me)
    assert lying.samples_at(5) == 10 + MAX_SAMPLE_SHARE * 10
