"""Compression codecs: error bounds, wire sizes, adaptive choice, registry and hostile input.

Error bounds used below (``x`` the input, ``y`` the decoded part, eps32 = 2**-24 is float32's unit
roundoff, which covers the float32 arithmetic of encode and decode):
- none: exact.
- float16: round-to-nearest half precision has unit roundoff 2**-11 for normal numbers and an
  absolute error of at most half the subnormal spacing 2**-24 below 2**-14, so
  ``|y - x| <= 2**-11 * |x| + 2**-25`` for ``|x| <= 65504``.
- scaled_float16: the float16 error applies to ``(x - mean) / std`` and is scaled back by std:
  ``|y - x| <= 2**-11 * |x - mean| + 2**-25 * std + 4 * eps32 * (|x| + |mean|)``.
- uint8: rounding to the nearest of 256 levels ``scale = (max - min) / 255`` apart:
  ``|y - x| <= scale / 2 + 4 * eps32 * max|x|``.
- blockwise_8bit: rounding to the nearest multiple of ``scale_b = absmax_b / 127`` within the
  value's block b: ``|y - x| <= scale_b / 2 + 4 * eps32 * absmax_b``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest
import torch

from averaging.compression import (
    ADAPTIVE_THRESHOLD,
    BLOCK_SIZE,
    AdaptiveCodec,
    Codec,
    NoCompression,
    decode_part,
    get_codec,
    register_codec,
)

EPS32 = 2.0**-24
CODECS = ["none", "float16", "scaled_float16", "uint8", "blockwise_8bit", "adaptive"]
# Ragged on purpose: 3 full blocks and a tail of 517, plus the degenerate sizes.
SIZES = [0, 1, 5, BLOCK_SIZE, 3 * BLOCK_SIZE + 517]


def normal(numel: int, *, offset: float = 0.0, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * scale + offset


DATASETS = {
    "normal": dict(offset=0.0, scale=1.0),
    "offset_large_scale": dict(offset=3.0e4, scale=1.0e3),
    "tiny": dict(offset=0.0, scale=1.0e-6),
}


def through_msgpack(meta: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False)


def round_trip(codec: str | Codec, x: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    meta, payload = get_codec(codec).encode(x)
    wire_meta = through_msgpack(meta)
    y = decode_part(wire_meta, bytes(payload), x.numel())
    assert y.dtype == torch.float32 and y.shape == (x.numel(),)
    return y, wire_meta, len(bytes(payload))


def error_bound(codec: str, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |decoded - x|, as derived in the module docstring."""
    x = x.double()
    if codec == "none":
        return torch.zeros_like(x)
    if codec == "float16":
        return 2.0**-11 * x.abs() + 2.0**-25
    if codec == "scaled_float16":
        std, mean = torch.std_mean(x, correction=0)
        return 2.0**-11 * (x - mean).abs() + 2.0**-25 * std + 4 * EPS32 * (x.abs() + mean.abs())
    if codec == "uint8":
        scale = (x.max() - x.min()) / 255
        return scale / 2 + 4 * EPS32 * x.abs().max() + torch.zeros_like(x)
    if codec == "blockwise_8bit":
        n_blocks = -(-x.numel() // BLOCK_SIZE)
        padded = torch.nn.functional.pad(x, (0, n_blocks * BLOCK_SIZE - x.numel()))
        absmax = padded.view(n_blocks, BLOCK_SIZE).abs().amax(dim=1)
        per_value = absmax.repeat_interleave(BLOCK_SIZE)[: x.numel()]
        return per_value / 127 / 2 + 4 * EPS32 * per_value
    raise AssertionError(codec)


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("codec", ["none", "float16", "scaled_float16", "uint8", "blockwise_8bit"])
def test_error_within_bound(codec: str, numel: int, dataset: str) -> None:
    x = normal(numel, **DATASETS[dataset])
    y, meta, _ = round_trip(codec, x)
    assert meta["codec"] == codec
    if numel == 0:
        return
    error = (y.double() - x.double()).abs()
    bound = error_bound(codec, x)
    assert bool((error <= bound).all()), f"max excess {float((error - bound).max())}"
    if codec != "none":
        # The bound is not vacuous: the codec really is lossy at about the stated size.
        assert float(error.max()) > 0.01 * float(bound.max()) or numel <= 1


def test_none_is_exact_and_zero_copy() -> None:
    x = normal(1000)
    meta, payload = NoCompression().encode(x)
    assert meta == {"codec": "none"}
    assert bytes(payload) == x.numpy().tobytes()
    assert torch.equal(decode_part(meta, bytes(payload), 1000), x)


def test_float16_clamps_to_its_range() -> None:
    x = torch.tensor([1.0e6, -1.0e6, 70000.0, 1.0])
    y, _, _ = round_trip("float16", x)
    assert y.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


def test_scaled_float16_keeps_precision_where_float16_cannot() -> None:
    # An offset far beyond float16's range: plain float16 clamps it away, scaled float16 keeps it.
    x = normal(5000, offset=1.0e6, scale=10.0)
    y, _, _ = round_trip("scaled_float16", x)
    assert bool(((y.double() - x.double()).abs() <= error_bound("scaled_float16", x)).all())
    assert float((round_trip("float16", x)[0] - x).abs().max()) > 9e5


@pytest.mark.parametrize("codec", ["scaled_float16", "uint8", "blockwise_8bit"])
@pytest.mark.parametrize("value", [0.0, 3.25, -1.0e5])
def test_constant_parts_are_exact(codec: str, value: float) -> None:
    x = torch.full((3000,), value)
    y, _, _ = round_trip(codec, x)
    if codec == "blockwise_8bit" and value != 0.0:
        # value / (|value| / 127) * (|value| / 127) may be off by float32 rounding only.
        assert float((y - x).abs().max()) <= 4 * EPS32 * abs(value)
    else:
        assert torch.equal(y, x)


def test_uint8_handles_a_range_wider_than_float32() -> None:
    x = torch.tensor([-3.0e38, 0.0, 1.0e38, 3.0e38])
    y, meta, _ = round_trip("uint8", x)
    assert bool(torch.isfinite(y).all())
    scale = (3.0e38 + 3.0e38) / 255
    assert float((y.double() - x.double()).abs().max()) <= scale / 2 * (1 + 1e-6)
    assert meta["min"] == float(x[0]) and y[0] == x[0]


def test_blockwise_outlier_only_affects_its_own_block() -> None:
    x = normal(4 * BLOCK_SIZE)
    x[5] = 1.0e4
    y, _, _ = round_trip("blockwise_8bit", x)
    rest = slice(BLOCK_SIZE, None)
    assert float((y[rest] - x[rest]).abs().max()) <= float(x[rest].abs().max()) / 254 * (1 + 1e-5)
    # uint8 has one scale for the whole part, so the outlier coarsens everything.
    assert float((round_trip("uint8", x)[0][rest] - x[rest]).abs().max()) > 5.0


@pytest.mark.parametrize(
    "codec, size",
    [
        ("none", lambda n: 4 * n),
        ("float16", lambda n: 2 * n),
        ("scaled_float16", lambda n: 2 * n),
        ("uint8", lambda n: n),
        ("blockwise_8bit", lambda n: n + 4 * math.ceil(n / BLOCK_SIZE)),
    ],
)
@pytest.mark.parametrize("numel", [0, 1, BLOCK_SIZE, 100_003])
def test_wire_sizes(codec: str, size: Any, numel: int) -> None:
    _, _, payload_len = round_trip(codec, normal(numel))
    assert payload_len == size(numel) == get_codec(codec).payload_size(numel)


def test_eight_bit_codecs_are_about_four_times_smaller() -> None:
    x = normal(1 << 20)
    raw = len(bytes(get_codec("none").encode(x)[1]))
    assert raw / len(bytes(get_codec("uint8").encode(x)[1])) == 4.0
    assert 3.99 < raw / len(bytes(get_codec("blockwise_8bit").encode(x)[1])) < 4.0
    assert raw / len(bytes(get_codec("float16").encode(x)[1])) == 2.0


def test_meta_is_small_and_msgpack_native() -> None:
    for name in CODECS:
        meta, _ = get_codec(name).encode(normal(10_000))
        assert through_msgpack(meta) == meta
        assert len(msgpack.packb(meta, use_bin_type=True)) < 64


def test_adaptive_chooses_by_size() -> None:
    codec = get_codec("adaptive")
    assert isinstance(codec, AdaptiveCodec)
    assert codec.encode(normal(ADAPTIVE_THRESHOLD - 1))[0]["codec"] == "float16"
    assert codec.encode(normal(ADAPTIVE_THRESHOLD))[0]["codec"] == "blockwise_8bit"
    custom = AdaptiveCodec(threshold=10, small="none", large=get_codec("uint8"))
    for numel, expected in [(0, "none"), (9, "none"), (10, "uint8"), (1000, "uint8")]:
        x = normal(numel)
        y, meta, payload_len = round_trip(custom, x)
        assert meta["codec"] == expected
        assert payload_len == custom.payload_size(numel)
        assert bool(((y.double() - x.double()).abs() <= error_bound(expected, x)).all())


def test_peers_with_different_defaults_interoperate() -> None:
    # The sender's adaptive codec picked uint8; a receiver configured with another default decodes it.
    x = normal(500)
    meta, payload = AdaptiveCodec(threshold=0, large="uint8").encode(x)
    receiver = AdaptiveCodec(threshold=10**9, small="none")
    y = receiver.decode(through_msgpack(meta), bytes(payload), 500)
    assert torch.equal(y, decode_part(meta, payload, 500))
    assert float((y - x).abs().max()) <= float(error_bound("uint8", x).max())


def test_adaptive_refuses_nesting_and_adaptive_meta() -> None:
    with pytest.raises(ValueError, match="nest"):
        AdaptiveCodec(small="adaptive")
    with pytest.raises(ValueError, match="threshold"):
        AdaptiveCodec(threshold=-1)
    with pytest.raises(ValueError, match="not a wire codec"):
        decode_part({"codec": "adaptive"}, b"", 0)


def test_decoded_part_owns_its_memory() -> None:
    for name in ["none", "float16", "scaled_float16", "uint8", "blockwise_8bit"]:
        x = normal(3000)
        meta, payload = get_codec(name).encode(x)
        buffer = bytearray(payload)
        y = decode_part(meta, buffer, 3000)
        before = bytes(buffer)
        y.add_(1.0)  # in-place accumulation must not touch the receive buffer
        assert bytes(buffer) == before


def test_registry() -> None:
    codec = NoCompression()
    assert get_codec(codec) is codec
    assert isinstance(get_codec("none"), NoCompression)
    for name in [None, 3, "gzip", "", b"none"]:
        with pytest.raises(ValueError, match="unknown codec"):
            get_codec(name)  # type: ignore[arg-type]

    @register_codec
    class NegatingCodec(Codec):
        name: ClassVar[str] = "test_negate"

        def encode(self, tensor: torch.Tensor) -> tuple[dict, bytes]:
            return {"codec": self.name}, (-tensor.float()).numpy().tobytes()

        def decode(self, meta: dict, payload: Any, numel: int) -> torch.Tensor:
            return -torch.from_numpy(np.frombuffer(payload, dtype=np.float32, count=numel).copy())

        def payload_size(self, numel: int) -> int:
            return 4 * numel

    x = normal(10)
    assert torch.equal(round_trip("test_negate", x)[0], x)
    register_codec(NegatingCodec)  # registering the same class again is harmless

    class Impostor(NegatingCodec):
        name: ClassVar[str] = "none"

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Impostor)
    assert isinstance(get_codec("none"), NoCompression)


@pytest.mark.parametrize("codec", ["none", "float16", "scaled_float16", "uint8", "blockwise_8bit", "adaptive"])
@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([-float("inf")] * 3),
    ],
)
def test_encode_refuses_non_finite(codec: str, bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec(codec).encode(bad)


@pytest.mark.parametrize("position", [0, 7, 4095, 10_000, 12_344])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_found_anywhere_in_a_large_part(position: int, value: float) -> None:
    # The finiteness check relies on min/max reductions propagating NaN, also in vectorised lanes
    # and in the scalar tail of the reduction.
    x = normal(12_345)
    x[position] = value
    with pytest.raises(ValueError, match="NaN or infinite"):
        get_codec("none").encode(x)
    with pytest.raises(ValueError, match="NaN or infinite"):
        decode_part({"codec": "none"}, x.numpy().tobytes(), 12_345)


def test_encode_refuses_wrong_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="1-D"):
        get_codec("uint8").encode(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1-D"):
        get_codec("uint8").encode(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating point"):
        get_codec("uint8").encode(torch.arange(3))
    # Other float dtypes are accepted and converted.
    x = normal(100).double()
    assert torch.equal(round_trip("none", x)[0], x.float())


def encoded(codec: str, numel: int = 3000) -> tuple[dict, bytes]:
    meta, payload = get_codec(codec).encode(normal(numel))
    return meta, bytes(payload)


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


MALFORMED_META = [
    ("none", ["not a map"], "must be a map"),
    ("none", {}, "unknown codec"),
    ("none", {"codec": "zstd"}, "unknown codec"),
    ("none", {"codec": ["none"]}, "unknown codec"),
    ("none", {"codec": "none", "extra": 1}, "exactly the keys"),
    ("uint8", {"codec": "uint8", "min": 0.0}, "exactly the keys"),
    ("uint8", {"codec": "uint8", "min": 0, "scale": 0.1}, "must be float"),
    ("uint8", {"codec": "uint8", "min": "0", "scale": 0.1}, "must be float"),
    ("uint8", {"codec": "uint8", "min": 0.0, "scale": True}, "must be float"),
    ("uint8", {"codec": "uint8", "min": float("nan"), "scale": 0.1}, "finite"),
    ("uint8", {"codec": "uint8", "min": 0.0, "scale": float("inf")}, "finite"),
    ("uint8", {"codec": "uint8", "min": 0.0, "scale": -0.1}, "finite"),
    ("uint8", {"codec": "uint8", "min": -1e300, "scale": 0.1}, "finite"),
    ("uint8", {"codec": "uint8", "min": 3.0e38, "scale": 1.0e36}, "exceeds the float32 range"),
    ("scaled_float16", {"codec": "scaled_float16", "mean": 0.0, "std": -1.0}, "finite"),
    ("scaled_float16", {"codec": "scaled_float16", "mean": float("-inf"), "std": 1.0}, "finite"),
    ("scaled_float16", {"codec": "scaled_float16", "mean": 0.0}, "exactly the keys"),
    ("blockwise_8bit", {"codec": "blockwise_8bit", "scales": []}, "exactly the keys"),
]


@pytest.mark.parametrize("codec, meta, match", MALFORMED_META)
def test_malformed_meta_is_refused(codec: str, meta: Any, match: str) -> None:
    _, payload = encoded(codec)
    with pytest.raises(ValueError, match=match):
        decode_part(meta, payload, 3000)


def test_codec_refuses_meta_for_another_codec() -> None:
    meta, payload = encoded("float16")
    with pytest.raises(ValueError, match="meta is for codec"):
        get_codec("none").decode(meta, payload, 3000)


@pytest.mark.parametrize("codec", ["none", "float16", "scaled_float16", "uint8", "blockwise_8bit"])
def test_payload_length_must_match_numel(codec: str) -> None:
    meta, payload = encoded(codec)
    for wrong in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(ValueError, match="payload has"):
            decode_part(meta, wrong, 3000)
    for numel in (2999, 3001):
        with pytest.raises(ValueError, match="payload has"):
            decode_part(meta, payload, numel)
    for numel in (-1, True, 3000.0, None):
        with pytest.raises(ValueError, match="numel"):
            decode_part(meta, payload, numel)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes-like"):
        decode_part(meta, list(payload), 3000)


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0, 3.0e38])
def test_blockwise_scales_are_validated(bad_scale: float) -> None:
    meta, payload = encoded("blockwise_8bit", 2 * BLOCK_SIZE)
    hostile = f32(0.5, bad_scale) + payload[8:]
    with pytest.raises(ValueError, match="scale"):
        decode_part(meta, hostile, 2 * BLOCK_SIZE)


@pytest.mark.parametrize(
    "codec, dtype", [("none", np.float32), ("float16", np.float16), ("scaled_float16", np.float16)]
)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_float_payloads_are_refused(codec: str, dtype: Any, value: float) -> None:
    meta, payload = encoded(codec, 4)
    hostile = np.array([1.0, value, 2.0, 3.0], dtype=dtype).tobytes()
    with pytest.raises(ValueError, match="NaN or infinite"):
        decode_part(meta, hostile, 4)


def test_scaled_float16_overflow_on_decode_is_refused() -> None:
    # Each field is finite, but 65504 * 1e35 is not a float32.
    meta = {"codec": "scaled_float16", "mean": 0.0, "std": 1.0e35}
    with pytest.raises(ValueError, match="NaN or infinite"):
        decode_part(meta, np.array([65504.0], dtype=np.float16).tobytes(), 1)


def test_concurrent_use_from_threads() -> None:
    # Parts are encoded and decoded in worker threads; codecs must share no mutable state.
    parts = [normal(20_000 + i, offset=i, scale=1 + i, seed=i) for i in range(16)]
    jobs = [(codec, part) for codec in CODECS for part in parts]

    def work(job: tuple[str, torch.Tensor]) -> torch.Tensor:
        codec, part = job
        meta, payload = get_codec(codec).encode(part)
        return decode_part(through_msgpack(meta), bytes(payload), part.numel())

    serial = [work(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(work, jobs))
    assert all(torch.equal(a, b) for a, b in zip(serial, parallel, strict=True))


def test_none_decodes_into_a_supplied_buffer_and_its_payloads_can_land_in_place() -> None:
    codec = NoCompression()
    x = normal(100)
    out = torch.empty(100)
    assert codec.decode_into({"codec": "none"}, x.numpy().tobytes(), out) is out
    assert torch.equal(out, x)
    assert codec.in_place_numel({"codec": "none"}, 400) == 100
    assert codec.in_place_numel({"codec": "none"}, 402) is None  # not whole float32 values
    assert codec.in_place_numel({"codec": "none", "scale": 1.0}, 400) is None  # not this codec's meta
    assert get_codec("float16").in_place_numel({"codec": "float16"}, 400) is None  # must be decoded
    with pytest.raises(ValueError, match="expected exactly 400"):
        codec.decode_into({"codec": "none"}, x.numpy().tobytes()[:-4], out)


def test_encode_finite_is_encode_without_a_second_finiteness_pass() -> None:
    x = normal(100)
    meta, payload = NoCompression().encode_finite(x)
    assert meta == {"codec": "none"} and bytes(payload) == x.numpy().tobytes()
    for name in ["float16", "uint8", "adaptive"]:
        assert get_codec(name).encode_finite(x)[0] == get_codec(name).encode(x)[0]


@pytest.mark.parametrize("codec", ["none", "float16", "scaled_float16", "uint8", "blockwise_8bit"])
@pytest.mark.parametrize("numel", [0, 1, 2047, 2048, 5000])
def test_decode_into_fills_the_supplied_buffer_with_what_decode_returns(codec: str, numel: int) -> None:
    x = normal(numel)
    meta, payload = get_codec(codec).encode(x)
    out = torch.full((numel,), 7.0)
    assert get_codec(codec).decode_into(meta, bytes(payload), out) is out
    assert torch.equal(out, decode_part(meta, bytes(payload), numel))


def test_decode_into_leaves_the_finiteness_check_to_its_caller() -> None:
    payload = np.array([1.0, np.inf], dtype=np.float16).tobytes()
    out = torch.empty(2)
    get_codec("float16").decode_into({"codec": "float16"}, payload, out)
    assert not torch.isfinite(out).all()
    with pytest.raises(ValueError, match="NaN or infinite"):
        decode_part({"codec": "float16"}, payload, 2)
