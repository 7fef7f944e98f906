"""The tensor wire format: round trips, zero-copy rules (``peer/buffers.py``'s byte views) and
refusal of malformed headers."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from peer.tensors import DTYPES, MAX_NDIM, all_finite, all_finite_serial, tensor_from_wire, tensor_to_wire

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3), (2, 1, 4, 3)]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)


def through_msgpack(header: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    tensor = sample(DTYPES[name], shape)
    header, payload = tensor_to_wire(tensor)
    assert header == {"dtype": name, "shape": list(shape)}
    assert payload.nbytes == tensor.numel() * tensor.element_size()
    for wire_payload in (bytes(payload), bytearray(payload)):
        out = tensor_from_wire(through_msgpack(header), wire_payload)
        assert out.dtype == tensor.dtype and out.shape == tensor.shape
        assert torch.equal(out, tensor)


def test_to_wire_is_zero_copy_for_contiguous_cpu_tensors() -> None:
    tensor = torch.arange(6, dtype=torch.float32)
    _, payload = tensor_to_wire(tensor)
    tensor[0] = 42.0  # the view aliases the tensor's storage
    assert torch.frombuffer(bytearray(payload), dtype=torch.float32)[0] == 42.0


def test_bfloat16_bytes_are_the_raw_bits() -> None:
    tensor = torch.tensor([1.0, -2.5, 3.0e38], dtype=torch.bfloat16)
    _, payload = tensor_to_wire(tensor)
    assert bytes(payload) == tensor.view(torch.int16).numpy().tobytes()


def test_non_contiguous_input() -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    for tensor in (base.t(), base[:, ::2], base[1:3, 2:5].t(), base.expand(2, 4, 6)):
        assert not tensor.is_contiguous()
        header, payload = tensor_to_wire(tensor)
        assert torch.equal(tensor_from_wire(header, bytes(payload)), tensor)


def test_requires_grad_input_is_detached() -> None:
    tensor = torch.randn(3, requires_grad=True)
    header, payload = tensor_to_wire(tensor)
    out = tensor_from_wire(header, bytes(payload))
    assert not out.requires_grad and torch.equal(out, tensor.detach())


def test_bytes_payload_is_copied_not_aliased() -> None:
    payload = torch.arange(4, dtype=torch.int32).numpy().tobytes()
    out = tensor_from_wire({"dtype": "int32", "shape": [4]}, payload)
    out += 100  # must not write into the immutable bytes object
    assert payload == torch.arange(4, dtype=torch.int32).numpy().tobytes()
    assert out.tolist() == [100, 101, 102, 103]


def test_bytearray_payload_is_aliased() -> None:
    payload = bytearray(torch.arange(4, dtype=torch.int32).numpy().tobytes())
    out = tensor_from_wire({"dtype": "int32", "shape": [2, 2]}, payload)
    payload[0] = 7  # the tensor is a view of the receive buffer
    assert out[0, 0] == 7


def test_memoryview_payloads() -> None:
    data = torch.arange(5, dtype=torch.float64).numpy().tobytes()
    header = {"dtype": "float64", "shape": [5]}
    read_only = tensor_from_wire(header, memoryview(data))
    read_only += 1  # copied, so this is allowed
    assert data == torch.arange(5, dtype=torch.float64).numpy().tobytes()
    # A writable view at an odd offset inside a bigger receive buffer: the result must still be
    # a correctly aligned tensor with the right values.
    buffer = bytearray(1) + bytearray(data)
    unaligned = tensor_from_wire(header, memoryview(buffer)[1:])
    assert unaligned.data_ptr() % 8 == 0
    assert unaligned.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_cuda_tensor_is_moved_to_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tensor = torch.randn(3, 4, device="cuda")
    header, payload = tensor_to_wire(tensor)
    assert torch.equal(tensor_from_wire(header, bytes(payload)), tensor.cpu())


def test_unsupported_tensors_are_refused_on_send() -> None:
    with pytest.raises(ValueError, match="dtype"):
        tensor_to_wire(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="dense"):
        tensor_to_wire(torch.zeros(2, 2).to_sparse())
    with pytest.raises(TypeError):
        tensor_to_wire([1.0, 2.0])  # type: ignore[arg-type]


GOOD = {"dtype": "float32", "shape": [2, 3]}
GOOD_PAYLOAD = bytes(24)


@pytest.mark.parametrize(
    "header, match",
    [
        ([("dtype", "float32"), ("shape", [2, 3])], "must be a map"),
        ({"dtype": "float32"}, "exactly the keys"),
        ({**GOOD, "codec": "none"}, "exactly the keys"),
        ({"dtype": "complex64", "shape": [2, 3]}, "unsupported tensor dtype"),
        ({"dtype": "torch.float32", "shape": [2, 3]}, "unsupported tensor dtype"),
        ({"dtype": b"float32", "shape": [2, 3]}, "unsupported tensor dtype"),
        ({"dtype": None, "shape": [2, 3]}, "unsupported tensor dtype"),
        ({"dtype": "float32", "shape": (2, 3)}, "must be a list"),
        ({"dtype": "float32", "shape": 6}, "must be a list"),
        ({"dtype": "float32", "shape": [2, -3]}, "non-negative integers"),
        ({"dtype": "float32", "shape": [2.0, 3]}, "non-negative integers"),
        ({"dtype": "float32", "shape": [True, 6]}, "non-negative integers"),
        ({"dtype": "float32", "shape": ["2", 3]}, "non-negative integers"),
        ({"dtype": "float32", "shape": [1] * (MAX_NDIM + 1)}, "dimensions"),
        ({"dtype": "float32", "shape": [0, 10**30]}, "exceeds the limit"),
    ],
)
def test_malformed_headers_are_refused(header: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tensor_from_wire(header, GOOD_PAYLOAD)


def test_numel_limit() -> None:
    tensor_from_wire(GOOD, GOOD_PAYLOAD, max_numel=6)
    with pytest.raises(ValueError, match="more than the limit"):
        tensor_from_wire(GOOD, GOOD_PAYLOAD, max_numel=5)
    # A huge claimed shape is refused before anything is allocated.
    with pytest.raises(ValueError, match="more than the limit"):
        tensor_from_wire({"dtype": "uint8", "shape": [1 << 20, 1 << 20]}, b"")


@pytest.mark.parametrize("payload", [bytes(23), bytes(25), b"", bytes(6)])
def test_wrong_payload_length_is_refused(payload: bytes) -> None:
    with pytest.raises(ValueError, match="payload has"):
        tensor_from_wire(GOOD, payload)


def test_empty_tensor_needs_an_empty_payload() -> None:
    assert tensor_from_wire({"dtype": "int64", "shape": [0, 5]}, b"").shape == (0, 5)
    with pytest.raises(ValueError, match="payload has"):
        tensor_from_wire({"dtype": "int64", "shape": [0, 5]}, b"\0")


def test_payload_must_be_bytes_like() -> None:
    with pytest.raises(ValueError, match="bytes-like"):
        tensor_from_wire(GOOD, "x" * 24)
    with pytest.raises(ValueError, match="bytes-like"):
        tensor_from_wire(GOOD, None)
    with pytest.raises(ValueError, match="contiguous"):
        tensor_from_wire(GOOD, memoryview(bytearray(48))[::2])


def test_bool_payload_must_hold_zero_or_one() -> None:
    assert tensor_from_wire({"dtype": "bool", "shape": [3]}, b"\x00\x01\x01").tolist() == [False, True, True]
    with pytest.raises(ValueError, match="bool"):
        tensor_from_wire({"dtype": "bool", "shape": [3]}, b"\x00\x02\x01")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
def test_the_serial_finiteness_check_agrees_with_the_parallel_one(dtype, bad):
    values = torch.randn(70_000).to(dtype)  # (past torch's grain: its check would go parallel)
    if bad is not None:
        values[54_321] = bad
    assert all_finite_serial(values) == all_finite(values) == (bad is None)
    assert all_finite_serial(values[:0]) and all_finite_serial(torch.arange(5))
    assert all_finite_serial(values.view(7, 10_000)) == (bad is None)
