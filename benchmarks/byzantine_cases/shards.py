"""The peers' data: ``iid`` (the task's own shards: every N-th image of a seeded shuffle, so each
peer's label mix is the whole set's) or ``non-iid`` (a label-skewed split, as federated-learning
papers make one: each class's training images are shared out among the peers in proportions drawn
from a Dirichlet(0.5), seeded; Hsu, Qi, Brown 2019)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from peerd.tasks import ShardSpec, Task, digits_data, digits_task, endless_batches

__all__ = ["SHARDINGS", "dirichlet_split", "peer_task"]

SHARDINGS = ("iid", "non-iid")
ALPHA = 0.5  # Dirichlet concentration: at 0.5 most peers hold 2-4 classes for most of their data
SEED = 7
# A split where some peer holds fewer images than this is drawn again: the skew is the point, an
# almost empty peer is not (at 16 peers the split leaves each about 90 on average).
MIN_SHARD = 16
DRAWS = 1000


def dirichlet_split(labels: torch.Tensor, count: int, alpha: float = ALPHA, seed: int = SEED) -> list[torch.Tensor]:
    """Indices into ``labels`` for each of ``count`` peers: each class split among them in
    Dirichlet(alpha) proportions; drawn again until every peer holds ``MIN_SHARD`` or more."""
    rng = np.random.default_rng(seed)
    values = labels.numpy()
    for _ in range(DRAWS):
        shards: list[list[int]] = [[] for _ in range(count)]
        for label in np.unique(values):
            items = np.flatnonzero(values == label)
            rng.shuffle(items)
            cuts = (np.cumsum(rng.dirichlet([alpha] * count))[:-1] * len(items)).astype(int)
            for peer, part in enumerate(np.split(items, cuts)):
                shards[peer].extend(part.tolist())
        if min(len(shard) for shard in shards) >= MIN_SHARD:
            return [torch.tensor(sorted(shard), dtype=torch.long) for shard in shards]
    raise ValueError(f"no Dirichlet({alpha}) split of {len(values)} items gives {count} peers {MIN_SHARD} each")


def peer_task(index: int, count: int, sharding: str) -> Task:
    """Peer ``index`` of ``count``'s digits task, on its shard of the given kind."""
    task = digits_task(ShardSpec(index, count))
    if sharding == "iid":
        return task
    if sharding != "non-iid":
        raise ValueError(f"unknown sharding {sharding!r}")
    inputs, targets, train, _held_out = digits_data()
    mine = train[dirichlet_split(targets[train], count)[index]]
    batches = endless_batches(inputs[mine], targets[mine], task.batch_size, seed=1000 + index)
    return dataclasses.replace(task, batches=batches)
