"""What expert calls look like on the wire, and expert IDs.

A call carries several tensors in one payload: the body lists their headers
(``{"dtype", "shape"}``, see ``peer.tensors``) and the payload is their bytes back to back, each
starting at a multiple of ``ALIGNMENT`` so the receiver can view them in place. One tensor is sent
without any copy; several are copied once into a single buffer.

Methods (unary):
- ``moe.forward``  ``{"uid", "tensors": [inputs], "grad": bool, "token": int}`` -> ``{"tensors": [outputs]}``
- ``moe.backward`` ``{"uid", "tensors": [inputs, grad_outputs], "token": int}`` -> ``{"tensors": [grad_inputs]}``
- ``moe.info``     ``{"uid"}`` -> ``{"sample_shape", "dtype", "max_batch_size"}``

``grad`` asks the server to keep the forward's graph for the backward with the same ``token``
(chosen by the caller, unique per call, scoped to the calling peer).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from peer.buffers import byte_view
from peer.tensors import DTYPES, MAX_NDIM, tensor_from_wire, tensor_to_wire

__all__ = [
    "ALIGNMENT",
    "MAX_TENSORS",
    "pack_tensors",
    "unpack_tensors",
    "expand_expert_pattern",
    "split_uid",
    "UID_DELIMITER",
]

# 64 bytes: a cache line and the widest SIMD load, so views into the payload never need a copy for
# alignment.
ALIGNMENT = 64
# Expert calls carry at most inputs and their gradients; 8 leaves room without letting a header list
# thousands of tensors.
MAX_TENSORS = 8
UID_DELIMITER = "."
_PREFIX_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def _padded(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def pack_tensors(tensors: list[torch.Tensor]) -> tuple[list[dict[str, Any]], memoryview | bytearray]:
    """Headers plus one payload holding every tensor (a zero-copy view when there is only one)."""
    wired = [tensor_to_wire(t) for t in tensors]
    headers = [header for header, _ in wired]
    if len(wired) == 1:
        return headers, wired[0][1]
    buffer = bytearray(sum(_padded(len(view)) for _, view in wired))
    offset = 0
    for _, view in wired:
        buffer[offset : offset + len(view)] = view
        offset += _padded(len(view))
    return headers, buffer


def unpack_tensors(headers: Any, payload: Any, *, max_numel: int) -> list[torch.Tensor]:
    """Tensors from untrusted headers and payload; ValueError says what is wrong."""
    if not isinstance(headers, list) or not 1 <= len(headers) <= MAX_TENSORS:
        raise ValueError(f"'tensors' must be a list of 1 to {MAX_TENSORS} tensor headers")
    view = byte_view(payload)
    if len(headers) == 1:
        return [tensor_from_wire(headers[0], view, max_numel=max_numel)]
    tensors, offset = [], 0
    for header in headers:
        size = _nbytes(header, max_numel)
        if offset + size > len(view):
            raise ValueError(f"payload of {len(view)} bytes is too short for the tensors described")
        tensors.append(tensor_from_wire(header, view[offset : offset + size], max_numel=max_numel))
        offset += _padded(size)
    if offset < len(view) - ALIGNMENT:
        raise ValueError("payload has trailing bytes that no tensor header describes")
    return tensors


def _nbytes(header: Any, max_numel: int) -> int:
    """Byte size a header claims, checked enough to slice safely; ``tensor_from_wire`` checks the rest."""
    if not isinstance(header, dict) or header.get("dtype") not in DTYPES or not isinstance(header.get("shape"), list):
        raise ValueError(f"bad tensor header {str(header)[:80]}")
    shape = header["shape"]
    if len(shape) > MAX_NDIM or any(type(d) is not int or not 0 <= d <= max_numel for d in shape):
        raise ValueError(f"bad tensor shape {str(shape)[:80]}")
    numel = math.prod(shape)
    if numel > max_numel:
        raise ValueError(f"tensor of shape {shape} has more than {max_numel} elements")
    return numel * DTYPES[header["dtype"]].itemsize


def split_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """``"ffn.3.7"`` -> ``("ffn", (3, 7))``; ValueError for anything else."""
    if not isinstance(uid, str):
        raise ValueError(f"expert ID must be a string, got {type(uid).__name__}")
    prefix, *coords = uid.split(UID_DELIMITER)
    if not _PREFIX_RE.match(prefix) or not coords or not all(c.isdigit() and len(c) < 10 for c in coords):
        raise ValueError(f"bad expert ID {uid!r}: expected PREFIX.i.j... with non-negative integer coordinates")
    return prefix, tuple(int(c) for c in coords)


def expand_expert_pattern(pattern: str) -> list[str]:
    """``'ffn.[0:4].[0:2]'`` -> ``['ffn.0.0', 'ffn.0.1', 'ffn.1.0', ...]``; plain integers stay fixed.

    Ranges are Python-style half-open slices, as in Hivemind's ``--expert_pattern``.
    """
    prefix, *parts = pattern.split(UID_DELIMITER)
    if not _PREFIX_RE.match(prefix) or not parts:
        raise ValueError(f"bad expert pattern {pattern!r}: expected PREFIX.[a:b].[c:d] (or integers)")
    choices: list[range] = []
    for part in parts:
        match = re.fullmatch(r"\[(\d+):(\d+)\]|(\d+)", part)
        if match is None:
            raise ValueError(f"bad expert pattern {pattern!r}: {part!r} is neither [a:b] nor an integer")
        if match.group(3) is not None:
            choices.append(range(int(match.group(3)), int(match.group(3)) + 1))
        else:
            start, stop = int(match.group(1)), int(match.group(2))
            if stop <= start:
                raise ValueError(f"bad expert pattern {pattern!r}: empty range {part!r}")
            choices.append(range(start, stop))
    uids = [prefix]
    for choice in choices:
        uids = [f"{uid}{UID_DELIMITER}{i}" for uid in uids for i in choice]
    return uids
