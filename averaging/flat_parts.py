"""A peer's tensors as one flat float32 vector for the all-reduce, and the averages written back.

Plain functions on tensors (no I/O); ``averaging/allreduce.py`` runs them in worker threads.
"""

from __future__ import annotations

import bisect
import itertools

import torch


def flat_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    if len(tensors) != 1:
        return None
    tensor = tensors[0].detach()
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return tensor.view(-1)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])


def write_back(tensors: list[torch.Tensor], averaged: list[tuple[int, torch.Tensor]]) -> None:
    """Copy averaged ``(flat offset, values)`` pieces straight into the caller's tensors (converting
    the dtype if needed); what no piece covers keeps its local values."""
    if not all(t.is_contiguous() for t in tensors):  # no flat views of these: go through a flat copy
        flat = flatten(tensors)
        for start, values in averaged:
            copy_into(flat, start, values)
        unflatten_into(flat, tensors)
        return
    ends = list(itertools.accumulate(t.numel() for t in tensors))
    with torch.no_grad():
        for start, values in averaged:
            done = 0
            index = bisect.bisect_right(ends, start)
            while done < values.numel():
                tensor = tensors[index]
                offset = start + done - (ends[index] - tensor.numel())
                count = min(values.numel() - done, tensor.numel() - offset)
                tensor.detach().view(-1)[offset : offset + count].copy_(values[done : done + count])
                done += count
                index += 1


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(flat[offset : offset + n].view(tensor.shape).to(tensor.dtype))
            offset += n


def copy_into(output: torch.Tensor, start: int, values: torch.Tensor) -> None:
    output[start : start + values.numel()].copy_(values)
