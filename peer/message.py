"""What a call carries each way: a body (any packable value) and a payload of raw bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Message"]


@dataclass(frozen=True)
class Message:
    body: Any = None
    payload: bytes | bytearray | memoryview = b""
