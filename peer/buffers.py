"""Byte views of payloads: the one place that turns a bytes-like object into a flat memoryview.

Payloads cross the wire as raw bytes and are read without copying, so every layer needs the same
view: contiguous, one-dimensional, format ``"B"``. A payload that cannot be viewed that way is
refused with ValueError (remote input must never raise anything else).
"""

from __future__ import annotations

from typing import Any

__all__ = ["byte_view"]


def byte_view(payload: Any, expected_size: int | None = None) -> memoryview:
    """A flat ``"B"`` view of ``payload`` sharing its memory; ValueError if it is not a contiguous
    bytes-like object, or (with ``expected_size``) does not hold exactly that many bytes."""
    try:
        view = memoryview(payload)
    except TypeError:
        raise ValueError(f"payload must be a bytes-like object, not {type(payload).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("payload must be a contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if expected_size is not None and view.nbytes != expected_size:
        raise ValueError(f"payload has {view.nbytes} bytes, expected exactly {expected_size}")
    return view
