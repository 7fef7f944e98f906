"""Per-part compression codecs for tensors being averaged.

The all-reduce streams flat float32 tensors in parts; each part is encoded by a ``Codec`` into a
small msgpack-able ``meta`` dict and a raw byte payload. The meta always names the codec that
produced it (``{"codec": "uint8", ...}``) and the receiver decodes with the codec that name
selects, not with its own configured default, so peers configured differently still interoperate.

Decoding treats meta and payload as hostile: the codec must be known, the meta must have exactly
the expected keys with the expected types, the payload must be exactly as long as ``numel``
implies, and every scale must be finite. ``decode`` returns finite float32 only, so a lying peer
can shift an average but never poison it with NaN or inf; ``decode_into`` (which fills a buffer
the caller supplies, e.g. one reused from round to round) leaves that one check to its caller,
which makes it once where it uses the values instead of twice.

All work is vectorised torch/numpy code without Python loops over elements or blocks, and codecs
hold no mutable state, so parts can be encoded and decoded concurrently in worker threads
(``trio.to_thread.run_sync``). Payloads are read with ``numpy.frombuffer``, which accepts read-only
``bytes`` without the warning (and the process-global warning filter) that ``torch.frombuffer``
would need.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

from peer.buffers import byte_view
from peer.tensors import all_finite, tensor_bytes

__all__ = [
    "AdaptiveCodec",
    "Blockwise8BitCodec",
    "Codec",
    "Float16Codec",
    "NoCompression",
    "ScaledFloat16Codec",
    "Uniform8BitCodec",
    "codec_names",
    "codec_of",
    "decode_part",
    "get_codec",
    "register_codec",
]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT16_MAX = float(torch.finfo(torch.float16).max)
# 256 levels of an unsigned byte: 255 steps between the part's minimum and maximum.
UINT8_STEPS = 255
# Symmetric int8 range: -127..127 keeps zero exact and the scale one division (bitsandbytes'
# blockwise quantisation uses the same absmax / 127 convention).
INT8_LEVEL = 127
# bitsandbytes' blockwise 8-bit optimizers use blocks of 2048: one float32 scale per block adds
# 4 / 2048 = 0.2% to the payload while a single outlier only coarsens its own 2048 neighbours.
BLOCK_SIZE = 2048
# Below 64 Ki values (256 KiB of float32) a part is cheap to send at 16 bits and 8-bit error is not
# worth it; hivemind's SizeAdaptiveCompression uses the same default threshold.
ADAPTIVE_THRESHOLD = 65536

_REGISTRY: dict[str, type[Codec]] = {}


class Codec(ABC):
    """Encodes one flat float32 part into ``(meta, payload)`` and back.

    ``meta`` holds only msgpack-native values (str, float, int) and always ``meta["codec"] ==
    name``. ``decode`` returns a new 1-D float32 tensor of ``numel`` values that owns its memory
    (the caller may accumulate into it in place).
    """

    name: ClassVar[str]

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        """Encode a 1-D float part; raises ``ValueError`` for non-finite values."""

    @abstractmethod
    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        """Decode an untrusted ``(meta, payload)`` into ``numel`` float32 values or raise ``ValueError``."""

    @abstractmethod
    def payload_size(self, numel: int) -> int:
        """Bytes of payload that ``encode`` produces for a part of ``numel`` values."""

    # Whether ``encode_finite`` is only a view of the part (no pass over its values), so a caller
    # may run it on the event loop instead of paying for a worker thread.
    encodes_as_view: ClassVar[bool] = False

    # Whether decoded parts are zero outside the values the sender chose, and a reducer's average
    # of them is sent back chosen the same way (``sparse_codec.py``): what the returned average
    # leaves out reached no one, and error feedback keeps it.
    sparse: ClassVar[bool] = False

    def reply_codec(self, checked: bool) -> Codec:
        """The codec a reducer replies with when the senders send with this one: the same,
        except where a checked round needs replies its checks can bound (``sparse_codec.py``)."""
        return self

    def encode_finite(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        """``encode`` for a contiguous 1-D float32 CPU part the caller has already checked finite
        (e.g. as part of a larger tensor): codecs that can skip their own finiteness pass do."""
        return self.encode(tensor)

    def in_place_numel(self, meta: Any, nbytes: int) -> int | None:
        """How many float32 values a payload of ``nbytes`` with this (untrusted) ``meta`` is, if
        its bytes are exactly those values: then it can be received straight into the float32
        buffer the values belong in and needs no decoding at all. None if it must be decoded."""
        return None

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        """Decode an untrusted ``(meta, payload)`` into the contiguous float32 tensor ``out`` and
        return the values (``out`` itself, or a tensor the caller owns). The values may still be
        non-finite: the caller checks them where it uses them."""
        return self.decode(meta, payload, out.numel())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Make ``cls`` decodable and selectable by ``cls.name``; usable as a class decorator.

    Registering another class under a taken name is refused: peers would silently decode that
    name differently.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a non-empty string 'name'")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"codec name {name!r} is already registered by {existing.__name__}")
    _REGISTRY[name] = cls
    return cls


def get_codec(name_or_codec: str | Codec) -> Codec:
    """A codec instance: ``name_or_codec`` itself, or the registered codec of that name with defaults."""
    if isinstance(name_or_codec, Codec):
        return name_or_codec
    if not isinstance(name_or_codec, str) or name_or_codec not in _REGISTRY:
        raise ValueError(f"unknown codec {name_or_codec!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name_or_codec]()


def codec_names() -> list[str]:
    """The names of every registered codec, sorted."""
    return sorted(_REGISTRY)


def codec_of(meta: Any) -> Codec:
    """The codec an (untrusted) part meta names: parts are decoded with the sender's choice."""
    if not isinstance(meta, dict):
        raise ValueError(f"codec meta must be a map, not {type(meta).__name__}")
    return get_codec(meta.get("codec"))


def decode_part(meta: Any, payload: Any, numel: int) -> torch.Tensor:
    """Decode a part with the codec its (untrusted) meta names; see ``Codec.decode``."""
    return codec_of(meta).decode(meta, payload, numel)


@register_codec
class NoCompression(Codec):
    """Raw float32: exact, 4 bytes per value. The payload is a view of the part, not a copy."""

    name = "none"
    encodes_as_view = True
    META: ClassVar[dict[str, str]] = {"codec": name}

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        return self.encode_finite(_prepare(tensor))

    def encode_finite(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        return {"codec": self.name}, tensor_bytes(tensor)

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        return _finite_or_raise(self.decode_into(meta, payload, _empty(numel)), self.name)

    def in_place_numel(self, meta: Any, nbytes: int) -> int | None:
        if meta != self.META or nbytes <= 0 or nbytes % 4:
            return None
        return nbytes // 4

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        _check_meta(meta, self.name, {})
        view = byte_view(payload, self.payload_size(out.numel()))
        return _fill(out, _from_buffer(view, np.float32, out.numel(), 0))

    def payload_size(self, numel: int) -> int:
        return 4 * numel


@register_codec
class Float16Codec(Codec):
    """IEEE half precision: relative error <= 2**-11; values beyond +-65504 are clamped to it."""

    name = "float16"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        part = _prepare(tensor)
        half = part.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
        return {"codec": self.name}, tensor_bytes(half)

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        return _finite_or_raise(self.decode_into(meta, payload, _empty(numel)), self.name)

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        _check_meta(meta, self.name, {})
        view = byte_view(payload, self.payload_size(out.numel()))
        return _fill(out, _from_buffer(view, np.float16, out.numel(), 0))

    def payload_size(self, numel: int) -> int:
        return 2 * numel


@register_codec
class ScaledFloat16Codec(Codec):
    """Float16 of the standardised part, ``(x - mean) / std``, with mean and std in the meta.

    Standardising first uses float16's precision where the values are rather than around zero:
    a part with a large common offset keeps relative precision 2**-11 of its spread, not of its
    offset, and parts whose magnitude is far outside float16's range lose nothing to clamping.
    """

    name = "scaled_float16"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        part = _prepare(tensor)
        if part.numel() == 0:
            return {"codec": self.name, "mean": 0.0, "std": 0.0}, b""
        std, mean = torch.std_mean(part, correction=0)
        mean_f, std_f = float(mean), float(std)
        if not (math.isfinite(mean_f) and math.isfinite(std_f)):
            # The part is finite but its spread overflows float32 (values near +-3e38).
            raise ValueError("scaled_float16: the part's spread exceeds the float32 range; use another codec")
        # A constant part has std 0: every standardised value is 0 and decodes to the mean.
        normalised = (part - mean_f) / (std_f if std_f > 0 else 1.0)
        half = normalised.clamp_(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
        return {"codec": self.name, "mean": mean_f, "std": std_f}, tensor_bytes(half)

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        return _finite_or_raise(self.decode_into(meta, payload, _empty(numel)), self.name)

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        _check_meta(meta, self.name, {"mean": float, "std": float})
        mean, std = meta["mean"], meta["std"]
        _check_scalar(self.name, "mean", mean, minimum=-FLOAT32_MAX)
        _check_scalar(self.name, "std", std, minimum=0.0)
        view = byte_view(payload, self.payload_size(out.numel()))
        return _fill(out, _from_buffer(view, np.float16, out.numel(), 0)).mul_(std).add_(mean)

    def payload_size(self, numel: int) -> int:
        return 2 * numel


@register_codec
class Uniform8BitCodec(Codec):
    """256 evenly spaced levels between the part's min and max: error <= (max - min) / 255 / 2.

    The meta holds ``min`` and the step ``scale``; value ``q`` decodes to ``min + q * scale``.
    """

    name = "uint8"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        part = _prepare(tensor)
        if part.numel() == 0:
            return {"codec": self.name, "min": 0.0, "scale": 0.0}, b""
        lo_t, hi_t = torch.aminmax(part)
        lo, hi = float(lo_t), float(hi_t)
        # The step is rounded to float32 so that both sides compute with exactly the same value.
        scale = _to_float32((hi - lo) / UINT8_STEPS)
        work = part.double() if _needs_float64(hi - lo) else part
        levels = (work - lo).div_(scale if scale > 0 else 1.0).round_().clamp_(0, UINT8_STEPS)
        return {"codec": self.name, "min": lo, "scale": scale}, tensor_bytes(levels.to(torch.uint8))

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        # Finite by the checks in decode_into, up to a rounding at the very edge of the float32 range.
        return _finite_or_raise(self.decode_into(meta, payload, _empty(numel)), self.name)

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        _check_meta(meta, self.name, {"min": float, "scale": float})
        lo, scale = meta["min"], meta["scale"]
        _check_scalar(self.name, "min", lo, minimum=-FLOAT32_MAX)
        _check_scalar(self.name, "scale", scale, minimum=0.0)
        if lo + UINT8_STEPS * scale > FLOAT32_MAX:
            raise ValueError(f"{self.name}: min + 255 * scale exceeds the float32 range")
        view = byte_view(payload, self.payload_size(out.numel()))
        levels = _fill(out, _from_buffer(view, np.uint8, out.numel(), 0))
        if _needs_float64(UINT8_STEPS * scale):
            # Only for parts spanning more than float32's range: q * scale would overflow in float32.
            return out.copy_(levels.double().mul_(scale).add_(lo))
        return levels.mul_(scale).add_(lo)

    def payload_size(self, numel: int) -> int:
        return numel


@register_codec
class Blockwise8BitCodec(Codec):
    """Int8 per block of 2048 values, scaled by the block's absmax: error <= absmax / 127 / 2.

    The payload is the float32 scale of every block (``ceil(numel / 2048)`` of them) followed by
    ``numel`` int8 values. An outlier only costs precision within its own block, unlike ``uint8``
    whose single scale spans the whole part.
    """

    name = "blockwise_8bit"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        part = _prepare(tensor)
        numel = part.numel()
        full, n_blocks = numel // BLOCK_SIZE, _n_blocks(numel)
        out = torch.empty(self.payload_size(numel), dtype=torch.uint8)
        scales = out[: 4 * n_blocks].view(torch.float32)
        values = out[4 * n_blocks :].view(torch.int8)
        # Full blocks as one 2-D view, the ragged tail (if any) as one more block: no padding copy.
        head = part[: full * BLOCK_SIZE].view(full, BLOCK_SIZE)
        tail = part[full * BLOCK_SIZE :]
        torch.amax(head.abs(), dim=1, out=scales[:full])
        if tail.numel():
            scales[full] = tail.abs().max()
        scales.div_(INT8_LEVEL)
        # All-zero blocks have scale 0; dividing them by 1 keeps them exactly 0.
        divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
        values[: full * BLOCK_SIZE].view(full, BLOCK_SIZE).copy_(_quantise_int8(head / divisors[:full, None]))
        if tail.numel():
            values[full * BLOCK_SIZE :].copy_(_quantise_int8(tail / divisors[full]))
        return {"codec": self.name}, tensor_bytes(out)

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        # Finite by construction: int8 levels times scales checked to stay within float32.
        return self.decode_into(meta, payload, _empty(numel))

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        _check_meta(meta, self.name, {})
        numel = out.numel()
        view = byte_view(payload, self.payload_size(numel))
        n_blocks, full = _n_blocks(numel), numel // BLOCK_SIZE
        scales = _fill(_empty(n_blocks), _from_buffer(view, np.float32, n_blocks, 0))
        # Negative scales are refused too: the encoder never makes them, and they would hide a bug.
        if not all_finite(scales) or bool((scales < 0).any()):
            raise ValueError(f"{self.name}: block scales must be finite and non-negative")
        if n_blocks and float(scales.max()) * (INT8_LEVEL + 1) > FLOAT32_MAX:
            raise ValueError(f"{self.name}: a block scale exceeds the float32 range")
        _fill(out, _from_buffer(view, np.int8, numel, 4 * n_blocks))
        # Full blocks as one 2-D view, the ragged tail (if any) as one more block, as in encode.
        out[: full * BLOCK_SIZE].view(full, BLOCK_SIZE).mul_(scales[:full, None])
        if numel > full * BLOCK_SIZE:
            out[full * BLOCK_SIZE :].mul_(scales[full])
        return out

    def payload_size(self, numel: int) -> int:
        return 4 * _n_blocks(numel) + numel


@register_codec
class AdaptiveCodec(Codec):
    """Small parts with one codec, large parts with another.

    The meta is the chosen codec's own meta, so it names that codec (never "adaptive") and any
    peer decodes it without knowing this peer's threshold.
    """

    name = "adaptive"

    def __init__(
        self,
        threshold: int = ADAPTIVE_THRESHOLD,
        small: str | Codec = "float16",
        large: str | Codec = "blockwise_8bit",
    ):
        if type(threshold) is not int or threshold < 0:
            raise ValueError(f"threshold must be a non-negative int, got {threshold!r}")
        self.threshold = threshold
        self.small = get_codec(small)
        self.large = get_codec(large)
        if isinstance(self.small, AdaptiveCodec) or isinstance(self.large, AdaptiveCodec):
            raise ValueError("an adaptive codec cannot nest another adaptive codec")

    def choose(self, numel: int) -> Codec:
        """The codec used for a part of ``numel`` values."""
        return self.small if numel < self.threshold else self.large

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        return self.choose(tensor.numel()).encode(tensor)

    def encode_finite(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        return self.choose(tensor.numel()).encode_finite(tensor)

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        if not isinstance(meta, dict):
            raise ValueError(f"codec meta must be a map, not {type(meta).__name__}")
        if meta.get("codec") == self.name:
            # Never produced by encode; refusing it also rules out unbounded self-dispatch.
            raise ValueError("'adaptive' is not a wire codec: the meta must name the codec that was used")
        return decode_part(meta, payload, numel)

    def payload_size(self, numel: int) -> int:
        return self.choose(numel).payload_size(numel)

    def __repr__(self) -> str:
        return f"AdaptiveCodec(threshold={self.threshold}, small={self.small!r}, large={self.large!r})"


def _prepare(tensor: torch.Tensor) -> torch.Tensor:
    """The part as contiguous 1-D float32 on the CPU; refuses non-finite values."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"a part must be 1-D, got shape {list(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"a part must be floating point, got {tensor.dtype}")
    part = tensor.detach().to("cpu", torch.float32).contiguous()
    if not all_finite(part):
        raise ValueError("cannot encode a part with NaN or infinite values")
    return part


def _quantise_int8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.round_().clamp_(-INT8_LEVEL, INT8_LEVEL).to(torch.int8)


def _n_blocks(numel: int) -> int:
    return -(-numel // BLOCK_SIZE)


def _to_float32(value: float) -> float:
    return float(np.float32(value))


def _needs_float64(span: float) -> bool:
    return not span <= FLOAT32_MAX


def _check_numel(numel: Any) -> int:
    if type(numel) is not int or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    return numel


def _check_meta(meta: Any, name: str, fields: dict[str, type]) -> None:
    if not isinstance(meta, dict):
        raise ValueError(f"{name}: codec meta must be a map, not {type(meta).__name__}")
    expected = {"codec", *fields}
    if meta.keys() != expected:
        raise ValueError(
            f"{name}: codec meta must have exactly the keys {sorted(expected)}, got {sorted(map(repr, meta))[:8]}"
        )
    if meta["codec"] != name:
        raise ValueError(f"{name}: meta is for codec {meta['codec']!r}")
    for key, kind in fields.items():
        if type(meta[key]) is not kind:
            raise ValueError(f"{name}: meta field {key!r} must be {kind.__name__}, not {type(meta[key]).__name__}")


def _check_scalar(name: str, key: str, value: float, *, minimum: float) -> None:
    if not (math.isfinite(value) and minimum <= value <= FLOAT32_MAX):
        raise ValueError(f"{name}: meta field {key!r} = {value!r} is not a finite float32 value >= {minimum}")


def _from_buffer(view: memoryview, dtype: type, count: int, offset: int) -> np.ndarray:
    """A read-only numpy view of ``count`` values at ``offset``; callers copy out of it."""
    return np.frombuffer(view, dtype=dtype, count=count, offset=offset)


def _empty(numel: Any) -> torch.Tensor:
    return torch.empty(_check_numel(numel), dtype=torch.float32)


def _fill(out: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """``out`` (contiguous float32) holding ``values``: numpy converts while it copies.

    Filling a torch tensor through a numpy view is one pass; ``ndarray.astype`` was measured 5-10x
    slower for multi-MiB parts because every fresh numpy allocation page-faults.
    """
    out.numpy()[:] = values
    return out


def _finite_or_raise(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not all_finite(tensor):
        raise ValueError(f"{name}: payload decodes to NaN or infinite values")
    return tensor


# The sparse codecs register themselves under their names; importing them here makes every name a
# part's meta may carry known wherever parts are decoded.
from . import sparse_codec  # noqa: E402, F401
