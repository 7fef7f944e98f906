"""The shapes of RPC headers (``rpc_protocol.py`` has the wire format), checked before any call
state is touched, sans I/O."""

from __future__ import annotations

from typing import Any

from .framing import ProtocolError

__all__ = ["OPEN", "DATA", "END", "ERROR", "CANCEL", "CREDIT", "UNARY", "RESULT", "GOAWAY", "check", "validate"]

OPEN, DATA, END, ERROR, CANCEL, CREDIT, UNARY, RESULT, GOAWAY = 1, 2, 3, 4, 5, 6, 7, 8, 9

MAX_METHOD_NAME = 256

# Items in a header of each kind.
_SHAPES = {OPEN: 5, DATA: 4, END: 2, ERROR: 4, CANCEL: 2, CREDIT: 3, UNARY: 6, RESULT: 4, GOAWAY: 2}


def check(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(f"malformed RPC header: {what}")


def validate(kind: Any, header: list, max_payload: int) -> int:
    """Check the shape of a header; return its payload length."""
    # (The messages are formatted only on failure: this runs for every message received.)
    size = _SHAPES.get(kind) if type(kind) is int else None
    if size is None:
        check(False, f"unknown message kind {kind!r}")
    if len(header) != size:
        check(False, f"kind {kind} needs {size} items, got {len(header)}")
    if kind in (OPEN, UNARY):
        method, timeout = header[2], header[3]
        check(isinstance(method, str) and 0 < len(method) <= MAX_METHOD_NAME, "bad method name")
        check(timeout is None or (isinstance(timeout, (int, float)) and timeout > 0), "bad timeout")
    if kind == OPEN:
        check(type(header[4]) is int and 0 <= header[4] < 1 << 63, "bad message limit")
    if kind == ERROR:
        check(isinstance(header[2], str) and isinstance(header[3], str), "bad error fields")
    if kind == CREDIT:
        check(type(header[2]) is int and 0 < header[2] <= 1 << 40, "bad credit")
    if kind in (DATA, RESULT, UNARY):
        payload_len = header[-1]
        check(type(payload_len) is int and 0 <= payload_len, "bad payload length")
        if payload_len > max_payload:
            raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
        return payload_len
    return 0
