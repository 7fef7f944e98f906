"""Streamed fragments: local updates' outer step cut into fragments whose rounds take turns.

Streaming DiLoCo (Douillard et al., 2025) syncs a model not all at once every H inner steps but a
fragment at a time: each of P fragments every H steps, their rounds staggered H/P steps apart. The
bytes per H steps stay the same; what changes is that no more than 1/P of the model is ever in
flight, the uplink carries a steady stream of 1/P-sized rounds instead of a model-sized burst
every H steps (which a slow uplink must finish before the next burst), and with overlapped rounds
a fragment's average lands H/P steps after its delta was taken instead of H.

How peerd does it (``LocalUpdatesOptimizer(fragments=P)``, ``peerd join --fragments P``):
- The parameter tensors are dealt into P fragments of about equal size, whole tensors, the
  largest first into the lightest fragment (``deal_fragments``). The paper cuts by layers and
  found strided fragments (layers p, p+P, ...) best; dealing by size interleaves a stack of equal
  blocks the same way, and keeps fragments even when one tensor (an embedding) is large.
- A round (an epoch) is H/P inner steps; round e averages and steps fragment e mod P only, each
  fragment with its own start, pseudo-gradient, momentum, codec error feedback and averager (its
  own DHT key, so that a group's members always average the same fragment).
- Merging: a fragment averaged while the next round ran lands as every overlapped round's outer
  step does (``OuterStep.apply_delayed``): the outer step from the fragment's start, plus all the
  local progress made since its delta was taken. The paper mixes the averaged fragment with the
  local one instead (alpha 0.5); keeping all of the progress is what overlapped rounds here have
  always done, and it needs no second copy of the fragment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.worker_threads import run_blocking

from .averager import GroupAverager
from .contribution_scores import HeldOutGradient
from .error_feedback import ErrorFeedback
from .outer_step import OuterStep, cut_into_views
from .replica import AveragingRecord, average_once

__all__ = ["OuterFragments", "RoundFragment", "deal_fragments", "fragment_reference"]


def deal_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of tensors of ``sizes`` dealt into ``count`` fragments of about equal total size
    (largest first, each to the lightest fragment so far), each fragment in its tensors' order.
    One fragment is every tensor in order. Every peer deals the same model the same way."""
    if count < 1 or count > len(sizes):
        raise ValueError(f"{count} fragments of a model of {len(sizes)} parameter tensors: give 1 to {len(sizes)}")
    fragments: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(count), key=lambda f: (totals[f], f))
        fragments[lightest].append(index)
        totals[lightest] += sizes[index]
    return [sorted(fragment) for fragment in fragments]


class OuterFragments:
    """One ``OuterStep`` per fragment, and the whole model's start, momentum and start averaging
    across them, in the model's order (what newcomers download is the same whatever the fragments)."""

    def __init__(self, params: list[torch.Tensor], count: int, *, lr: float, momentum: float, nesterov: bool = True):
        self.groups = deal_fragments([p.numel() for p in params], count)
        self.steps = [
            OuterStep([params[i] for i in group], lr=lr, momentum=momentum, nesterov=nesterov) for group in self.groups
        ]

    def _joined(self, name: str) -> list[torch.Tensor]:
        """The steps' ``name`` tensors (one per parameter, or none), in the parameters' order."""
        placed = [
            (index, tensor)
            for group, step in zip(self.groups, self.steps, strict=True)
            for index, tensor in zip(group, getattr(step, name), strict=False)
        ]
        return [tensor for _, tensor in sorted(placed, key=lambda pair: pair[0])]

    @property
    def params(self) -> list[torch.Tensor]:
        return self._joined("params")

    @property
    def start(self) -> list[torch.Tensor]:
        return self._joined("start")

    @property
    def momentum(self) -> list[torch.Tensor]:
        return self._joined("momentum")

    def start_fragments(self, count: int) -> list[list[torch.Tensor]]:
        """The averaged copy of the whole start cut into ``count`` pieces (``cut_into_views``)."""
        return cut_into_views(self._joined("start_average"), count)

    def copy_start_for_averaging(self) -> None:
        for step in self.steps:
            step.copy_start_for_averaging()

    def move_to_averaged_start(self) -> None:
        for step in self.steps:
            step.move_to_averaged_start()

    def reset_params_to_start(self) -> None:
        for step in self.steps:
            step.reset_params_to_start()


def fragment_reference(held_out: HeldOutGradient, outer: OuterFragments, index: int) -> list[torch.Tensor]:
    """Fragment ``index``'s part of the held-out gradient at the shared start: what the deltas of
    its rounds are scored against (``contribution_scores.py``)."""
    gradient = held_out(outer.start)
    return [gradient[i] for i in outer.groups[index]]


@dataclass(frozen=True)
class RoundFragment:
    """What one round moves (``local_rounds.OuterMoves``): a fragment's outer step, its averager,
    and its codec's error feedback (None: none). ``owed_in_params``: a sparse codec's unsent
    progress goes back into the fragment's parameters after each outer step (``local_updates.py``)."""

    step: OuterStep
    averager: GroupAverager
    feedback: ErrorFeedback | None
    owed_in_params: bool

    def compute_deltas(self) -> None:
        self.step.compute_deltas()

    def compute_deltas_and_anchor(self) -> list[torch.Tensor]:
        return self.step.compute_deltas_and_anchor()

    def apply(self) -> None:
        self.step.apply()
        self._keep_owed()

    def apply_delayed(self, anchor: list[torch.Tensor]) -> None:
        self.step.apply_delayed(anchor)
        self._keep_owed()

    def _keep_owed(self) -> None:
        if self.owed_in_params and self.feedback is not None:
            self.feedback.move_into(self.step.params)

    async def average(self, epoch: int, weight: float) -> AveragingRecord:
        """Average the fragment's deltas with a group (on failure they stay this peer's own), the
        error feedback's residual added first; ``settle`` after."""
        feedback, deltas = self.feedback, self.step.deltas
        if feedback is not None:
            await run_blocking(feedback.add_residual, deltas)
        fallback = "applying the local delta alone"
        if feedback is not None and feedback.codec.sparse:
            fallback = "keeping this peer's progress"  # in its start or its parameters: ``settle``
        return await average_once(self.averager, epoch=epoch, weight=weight, fallback=fallback)

    async def settle(self, record: AveragingRecord, keep_owed: bool) -> None:
        """What the error feedback keeps of the round ``record`` says: what its encoding dropped,
        or, ``keep_owed`` (a sparse round that averaged nothing while others train on), all of it:
        the round then applies nothing, and the start stays where the others' is."""
        feedback = self.feedback
        if feedback is None:
            return
        if keep_owed and not record.averaged:
            await run_blocking(feedback.owe_all, self.step.deltas)
        else:
            await run_blocking(feedback.settle, record.result, self.step.deltas)
