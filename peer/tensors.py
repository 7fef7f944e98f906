"""The tensor wire format: a small msgpack-able header next to the tensor's raw bytes.

A tensor travels as ``{"dtype": "float32", "shape": [2, 3]}`` plus its bytes in row-major order and
the host's byte order (little-endian: peerd runs on x86-64 and aarch64). The header is the only
thing the receiver interprets, so it is validated field by field before any memory is allocated;
nothing that came from the network is unpickled, ``torch.load``-ed or eval-ed.

Both directions avoid copies where that is safe: ``tensor_to_wire`` hands out a view of the
tensor's own memory, and ``tensor_from_wire`` builds the tensor on top of a writable receive buffer.
An immutable ``bytes`` payload is copied instead, because a tensor aliasing it could later be
written in place (an optimizer step, an in-place average) and corrupt an object Python assumes
never changes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .buffers import byte_view
from .rpc_protocol import MAX_PAYLOAD

__all__ = [
    "DTYPES",
    "MAX_NDIM",
    "MAX_NUMEL",
    "all_finite",
    "all_finite_serial",
    "tensor_bytes",
    "tensor_from_wire",
    "tensor_to_wire",
]

# Wire names are torch's own names without the "torch." prefix. Complex, quantized and the exotic
# float8 types are left out until something needs them: every entry is attack surface.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_WIRE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_HEADER_KEYS = frozenset({"dtype", "shape"})

# Model tensors have at most 5 dimensions (Conv3d weights); 8 leaves headroom while keeping a
# hostile header from describing a shape that is expensive to even validate.
MAX_NDIM = 8
# One RPC message carries at most MAX_PAYLOAD bytes (256 MiB), so no single tensor on the wire can
# hold more elements than that many one-byte values.
MAX_NUMEL = MAX_PAYLOAD


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat ``"B"`` view sharing its memory (numpy has no
    bfloat16, but every dtype views as uint8 for free)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def all_finite(values: torch.Tensor) -> bool:
    """Whether no value is NaN or infinite, in one read-only pass.

    torch's min/max reductions propagate NaN, so two finite extremes prove every value finite
    without the temporary mask that ``torch.isfinite(values).all()`` allocates and fills; on 16M
    float32 values that mask made the check ~15x slower."""
    if values.numel() == 0:
        return True
    lo, hi = torch.aminmax(values)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def all_finite_serial(values: torch.Tensor) -> bool:
    """``all_finite`` computed on the calling thread alone (numpy's reductions start no OpenMP
    team), for checks on an event loop whose process does its tensor work on another thread
    (``worker_threads.ComputeThread``). CPU tensors only."""
    if values.numel() == 0:
        return True
    flat = values.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:  # (numpy has no bfloat16: all-ones exponent bits are Inf or NaN)
        exponents = np.bitwise_and(flat.view(torch.int16).numpy(), 0x7F80)
        return not bool((exponents == 0x7F80).any())
    if not flat.is_floating_point():
        return True
    array = flat.numpy()
    if array.dtype == np.float16:  # (numpy's float16 min and max are scalar loops: ~10x slower)
        return bool(np.isfinite(array).all())
    return math.isfinite(float(array.min())) and math.isfinite(float(array.max()))


def tensor_to_wire(tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """Return ``(header, payload)`` for ``tensor``; the payload is a flat byte view of its memory.

    A contiguous CPU tensor is not copied: the view aliases its storage (and keeps it alive), so
    the caller must not modify the tensor until the bytes have been sent. CUDA and non-contiguous
    tensors are copied once into a contiguous CPU tensor first.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    name = _WIRE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} cannot be sent; supported: {', '.join(DTYPES)}")
    if tensor.layout != torch.strided:
        raise ValueError(f"only dense tensors can be sent, not {tensor.layout}")
    shape = list(tensor.shape)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return {"dtype": name, "shape": shape}, tensor_bytes(flat)


def tensor_from_wire(header: Any, payload: Any, *, max_numel: int = MAX_NUMEL) -> torch.Tensor:
    """Build the tensor described by an untrusted ``header`` from its raw ``payload``.

    ``payload`` may be ``bytes``, ``bytearray`` or a (C-contiguous) ``memoryview``. A writable
    buffer is used in place, so the tensor aliases it: the caller must not reuse that buffer while
    the tensor is alive. A read-only buffer is copied into memory the tensor owns. Raises
    ``ValueError`` naming the problem when the header or the payload length is wrong.
    """
    dtype, shape, numel = _parse_header(header, max_numel)
    view = byte_view(payload)
    itemsize = dtype.itemsize
    if view.nbytes != numel * itemsize:
        raise ValueError(
            f"tensor payload has {view.nbytes} bytes but shape {shape} of {_WIRE_NAMES[dtype]} needs {numel * itemsize}"
        )
    if numel == 0:
        # torch.frombuffer refuses zero-length buffers.
        return torch.empty(shape, dtype=dtype)
    buffer = bytearray(view) if view.readonly else view
    tensor = torch.frombuffer(buffer, dtype=dtype)
    if tensor.data_ptr() % itemsize:
        # A view at an odd offset inside a receive buffer: vectorised kernels may assume natural
        # alignment, so pay for one copy rather than rely on the CPU tolerating unaligned loads.
        tensor = tensor.clone()
    if dtype == torch.bool and bool((tensor.view(torch.uint8).numpy() > 1).any()):  # (numpy: no OpenMP team here)
        # torch assumes bool bytes are 0 or 1; other values make comparisons and sums misbehave.
        raise ValueError("bool tensor payload holds bytes other than 0 and 1")
    return tensor.view(shape)


def _parse_header(header: Any, max_numel: int) -> tuple[torch.dtype, list[int], int]:
    if not isinstance(header, dict):
        raise ValueError(f"tensor header must be a map, not {type(header).__name__}")
    if header.keys() != _HEADER_KEYS:
        raise ValueError(
            f"tensor header must have exactly the keys {sorted(_HEADER_KEYS)}, got {sorted(map(repr, header))[:8]}"
        )
    name = header["dtype"]
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"unsupported tensor dtype {name!r}; supported: {', '.join(DTYPES)}")
    shape = header["shape"]
    if not isinstance(shape, list):
        raise ValueError(f"tensor shape must be a list, not {type(shape).__name__}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor has {len(shape)} dimensions, more than the limit of {MAX_NDIM}")
    for dim in shape:
        # bool is an int subclass; True is not a size.
        if type(dim) is not int or dim < 0:
            raise ValueError(f"tensor shape must be non-negative integers, got {shape!r}")
        if dim > max_numel:
            # Also bounds shapes like [0, 10**30] whose product is 0 but that torch cannot represent.
            raise ValueError(f"tensor dimension {dim} exceeds the limit of {max_numel} elements")
    numel = math.prod(shape)
    if numel > max_numel:
        raise ValueError(f"tensor of shape {shape} has {numel} elements, more than the limit of {max_numel}")
    return DTYPES[name], shape, numel
