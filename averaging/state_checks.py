"""What a newcomer checks in a donor's state before loading it, sans I/O.

A donor is any peer that announced itself, so its state is a claim like any other. A newcomer once
loaded NaN parameters at epoch 10**9 from a hostile donor and spread that epoch to running peers.
Before anything is loaded:

- shapes and dtypes match the newcomer's own tensors (checked as the bytes arrive,
  ``state_sharing.py``);
- every value is finite and within MAGNITUDE_GROWTH times the largest magnitude of the newcomer's
  own tensor of that place (freshly initialised for a newcomer), or MAGNITUDE_FLOOR for tensors that
  start at zero (biases, optimizer moments, step counts);
- where more than one donor is announced, a second donor (a witness) sends a random sample of the
  same tensors, and the two must agree within DONOR_AGREEMENT: honest replicas stay close (state
  averaging pulls them together every few epochs), while a donor serving another model, or the
  model scaled or sign-flipped, disagrees with any honest witness. A donor that fails either check
  is skipped and the next one tried.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

__all__ = ["DONOR_AGREEMENT", "MAGNITUDE_FLOOR", "MAGNITUDE_GROWTH", "check_state", "sample_indices", "disagreement"]

# Trained weights stay within a few orders of magnitude of their initial scale (weight decay and
# normalisation hold them; a Linear layer's init bound is 1/sqrt(fan_in), and its trained weights
# rarely exceed 50 times that). 1000 times leaves room for any sane run; the values that wreck a
# model (1e30, whose square is infinite in float32) are far beyond.
MAGNITUDE_GROWTH = 1e3
# Tensors that start at zero carry no scale of their own. 2**24 is where float32 stops counting
# whole numbers (a step counter beyond it no longer increments), so no sane value is larger.
MAGNITUDE_FLOOR = float(1 << 24)
# Relative distance ||a - b|| / (||a|| + ||b||): 0 for equal states, 1 for opposite ones, about 0.7
# for two unrelated random models. Honest replicas between two state averagings differ by a few
# epochs of differently averaged steps, a few percent.
DONOR_AGREEMENT = 0.25
# A witness sends about this share of the state's values (at least one tensor): enough values
# to catch a donor that changed its state wholesale, at a fraction of a second download.
WITNESS_SHARE = 0.125


def check_state(received: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless every received tensor is finite and within bounds of its reference."""
    for index, (tensor, mine) in enumerate(zip(received, reference, strict=True)):
        if tensor.is_floating_point() or tensor.is_complex():
            if not torch.isfinite(tensor).all():
                raise ValueError(f"the donor's tensor {index} holds NaN or Inf")
        if tensor.numel() == 0:
            continue
        largest = float(tensor.detach().abs().max())
        scale = float(mine.detach().abs().max()) if mine.numel() else 0.0
        bound = max(MAGNITUDE_GROWTH * scale, MAGNITUDE_FLOOR)
        if largest > bound:
            raise ValueError(f"the donor's tensor {index} reaches {largest:.3g}, beyond the bound {bound:.3g}")


def sample_indices(sizes: Sequence[int], rng: random.Random) -> list[int]:
    """A random set of tensor indices holding about WITNESS_SHARE of all values (at least one)."""
    order = list(range(len(sizes)))
    rng.shuffle(order)
    budget = WITNESS_SHARE * sum(sizes)
    chosen, taken = [], 0
    for index in order:
        if chosen and taken + sizes[index] > budget:
            continue
        chosen.append(index)
        taken += sizes[index]
    return sorted(chosen)


def disagreement(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> float:
    """||a - b|| / (||a|| + ||b||) over all the tensors together (0 when both are zero)."""
    difference = total_a = total_b = 0.0
    for a, b in zip(ours, theirs, strict=True):
        a64, b64 = a.detach().double(), b.detach().double()
        difference += float((a64 - b64).square().sum())
        total_a += float(a64.square().sum())
        total_b += float(b64.square().sum())
    scale = math.sqrt(total_a) + math.sqrt(total_b)
    return 0.0 if scale == 0 else math.sqrt(difference) / scale
