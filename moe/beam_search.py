"""Finding the best live experts of a grid: beam search through the DHT's prefix dictionaries.

A mixture scores an expert ``prefix.i.j`` as ``s0[i] + s1[j]`` (one gating score per grid
dimension, as in Hivemind's DMoE). Scoring every expert of a large grid and checking each for life
costs one DHT lookup per expert; instead the search walks the grid one dimension at a time, keeping
the ``beam_size`` best live partial IDs per sample and asking the DHT only for their children
(``announce.prefix_key``). On a fully populated grid a beam of at least ``k_best`` finds exactly
the top ``k_best``; on a sparse grid a wider beam trades lookups for exactness.

``GridBeamSearch`` is the sans-I/O part: it says which prefix keys it needs and takes their
children; ``find_best_experts`` drives it with DHT reads, all prefixes of one depth concurrently.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from .announce import DHT_TIMEOUT, fetch_children, prefix_key
from .protocol import UID_DELIMITER

__all__ = ["ExpertMatch", "GridBeamSearch", "find_best_experts", "exhaustive_top_k"]


@dataclass(frozen=True)
class ExpertMatch:
    uid: str
    coords: tuple[int, ...]
    score: float
    value: Any  # what the DHT says about the expert (its server's address)


class GridBeamSearch:
    """Per sample, the ``k_best`` live experts by additive grid score.

    ``grid_scores[d][b][c]`` is sample ``b``'s score for coordinate ``c`` of dimension ``d``. Ties
    are broken by coordinates so results are deterministic.
    """

    def __init__(
        self,
        uid_prefix: str,
        grid_scores: Sequence[Sequence[Sequence[float]]],
        k_best: int,
        beam_size: int | None = None,
    ):
        if not grid_scores:
            raise ValueError("a grid has at least one dimension")
        self.uid_prefix = uid_prefix
        self.scores = grid_scores
        self.k_best = k_best
        self.beam_size = max(beam_size or k_best, k_best)
        self.batch_size = len(grid_scores[0])
        self.depth = 0
        # Per sample: (coords, score, value) of the partial IDs still in the beam.
        self._beams: list[list[tuple[tuple[int, ...], float, Any]]] = [
            [((), 0.0, None)] for _ in range(self.batch_size)
        ]

    @property
    def done(self) -> bool:
        return self.depth == len(self.scores)

    def keys(self) -> list[str]:
        """The prefix keys whose children the next step needs (deduplicated across samples)."""
        assert not self.done
        return sorted({prefix_key(self.uid_prefix, coords) for beam in self._beams for coords, _, _ in beam})

    def advance(self, children: Mapping[str, Mapping[int, Any]]) -> None:
        """Extend every beam by one dimension using the live children of each key (missing = none)."""
        scores = self.scores[self.depth]
        last = self.depth == len(self.scores) - 1
        width = self.k_best if last else self.beam_size
        for sample, beam in enumerate(self._beams):
            row = scores[sample]
            candidates = (
                (coords + (coord,), score + float(row[coord]), value)
                for coords, score, _ in beam
                for coord, value in children.get(prefix_key(self.uid_prefix, coords), {}).items()
                if 0 <= coord < len(row)
            )
            self._beams[sample] = heapq.nsmallest(width, candidates, key=lambda item: (-item[1], item[0]))
        self.depth += 1

    def result(self) -> list[list[ExpertMatch]]:
        """Per sample, the best experts found, best first (fewer than ``k_best`` if fewer are live)."""
        assert self.done
        return [
            [ExpertMatch(uid_of(self.uid_prefix, coords), coords, score, value) for coords, score, value in beam]
            for beam in self._beams
        ]


def uid_of(prefix: str, coords: Sequence[int]) -> str:
    return UID_DELIMITER.join([prefix, *map(str, coords)])


def exhaustive_top_k(
    uid_prefix: str, live: Mapping[tuple[int, ...], Any], grid_scores: Sequence[Sequence[Sequence[float]]], k: int
) -> list[list[ExpertMatch]]:
    """Reference answer: score every live expert, keep the ``k`` best per sample."""
    results = []
    for sample in range(len(grid_scores[0])):
        scored = [
            (sum(float(grid_scores[d][sample][c]) for d, c in enumerate(coords)), coords, value)
            for coords, value in live.items()
        ]
        best = heapq.nsmallest(k, scored, key=lambda item: (-item[0], item[1]))
        results.append([ExpertMatch(uid_of(uid_prefix, coords), coords, score, value) for score, coords, value in best])
    return results


async def find_best_experts(
    dht: Any,
    uid_prefix: str,
    grid_scores: Sequence[Sequence[Sequence[float]]],
    k_best: int,
    beam_size: int | None = None,
    *,
    timeout: float = DHT_TIMEOUT,
) -> list[list[ExpertMatch]]:
    """Run a ``GridBeamSearch`` against the DHT; prefixes nobody answers for count as empty."""
    search = GridBeamSearch(uid_prefix, grid_scores, k_best, beam_size)
    children: dict[str, dict[int, Any]] = {}

    async def fetch(key: str) -> None:
        children[key] = await fetch_children(dht, key)

    with trio.move_on_after(timeout):
        while not search.done:
            async with trio.open_nursery() as nursery:
                for key in search.keys():
                    if key not in children:
                        nursery.start_soon(fetch, key)
            search.advance(children)
    if not search.done:  # out of time: finish with what we know (unknown prefixes have no children)
        while not search.done:
            search.advance(children)
    return search.result()
