"""What ``RPCProtocol`` reports about incoming messages: one event per message that completes.

The driver (``peer/rpc.py``) acts on each: start a handler, wake a caller, queue stream data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CallOpened",
    "StreamData",
    "StreamEnd",
    "CallResult",
    "CallFailed",
    "CallCancelled",
    "CreditGranted",
    "PeerLeaving",
]


@dataclass(frozen=True)
class CallOpened:
    call_id: int
    method: str
    timeout: float | None
    unary: bool
    body: Any = None
    payload: bytes | bytearray = b""


@dataclass(frozen=True)
class StreamData:
    call_id: int
    body: Any
    payload: bytes | bytearray
    cost: int


@dataclass(frozen=True)
class StreamEnd:
    call_id: int


@dataclass(frozen=True)
class CallResult:
    call_id: int
    body: Any
    payload: bytes | bytearray


@dataclass(frozen=True)
class CallFailed:
    call_id: int
    type_name: str
    message: str


@dataclass(frozen=True)
class CallCancelled:
    call_id: int


@dataclass(frozen=True)
class CreditGranted:
    call_id: int
    nbytes: int


@dataclass(frozen=True)
class PeerLeaving:
    """The peer opens no more calls on this connection (it found it idle, or answers our leaving)."""
