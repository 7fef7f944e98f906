"""Flat views of a peer's tensors and the parts they are cut into, for the all-reduce.

Plain functions on tensors (no I/O); ``averaging/allreduce.py`` runs them in worker threads.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch

from peer.tensors import all_finite, tensor_bytes

from .compression import NoCompression, get_codec
from .reduction import ContributionRejected

# Uncompressed float32 parts ("none") skip the codec calls and their worker threads: a part is sent
# as a byte view of the flattened tensor (already checked finite as a whole) and received by one
# copy into a reused buffer; finiteness is checked where the values are used.
RAW_META = {"codec": NoCompression.name}


def encode_shard(codec_name: str, averaged: torch.Tensor, part_sizes: list[int]) -> list[tuple[dict, Any]]:
    """The averaged shard as parts ready to send (raises ValueError for non-finite values)."""
    codec = get_codec(codec_name)
    raw = isinstance(codec, NoCompression)
    if raw and not all_finite(averaged):
        raise ValueError("the average contains NaN or infinite values")
    parts, offset = [], 0
    for size in part_sizes:
        part = averaged[offset : offset + size]
        parts.append((RAW_META, tensor_bytes(part)) if raw else codec.encode(part))
        offset += size
    return parts


def decode_shard(parts: list[tuple[dict, Any]], part_sizes: list[int]) -> torch.Tensor:
    """The values that receivers of ``encode_shard``'s parts end up with."""
    values = [decode(meta, payload, size) for (meta, payload), size in zip(parts, part_sizes, strict=True)]
    return torch.cat(values) if values else torch.empty(0, dtype=torch.float32)


def check_finite(parts: list[torch.Tensor]) -> None:
    if not all(all_finite(values) for values in parts):
        raise ContributionRejected("the reducer sent NaN or infinite values")


def decode(meta, payload, numel: int) -> torch.Tensor:
    if not (isinstance(meta, dict) and isinstance(meta.get("codec"), str)):
        raise ContributionRejected("part metadata must name its codec")
    values = get_codec(meta["codec"]).decode(meta, payload, numel)
    if values.numel() != numel:
        raise ContributionRejected(f"part decoded to {values.numel()} values, expected {numel}")
    return values


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
