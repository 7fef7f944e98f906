"""msgpack for the wire's own structures: handshake payloads, hellos and RPC headers.

Its own module, below both users (``secure_channel.py`` packs the handshake, ``rpc_protocol.py``
the call headers), so that neither imports the other for it.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .framing import MAX_RECORD_PLAINTEXT

__all__ = ["packb", "unpackb"]


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(data: bytes | memoryview, max_size: int = MAX_RECORD_PLAINTEXT) -> Any:
    """Unpack msgpack from an untrusted peer with explicit limits on every container."""
    if len(data) > max_size:
        raise ValueError(f"msgpack document of {len(data)} bytes exceeds the limit of {max_size}")
    return msgpack.unpackb(
        data,
        raw=False,
        use_list=True,
        strict_map_key=False,
        max_str_len=max_size,
        max_bin_len=max_size,
        max_array_len=max_size // 2,
        max_map_len=max_size // 4,
        max_ext_len=0,
    )
