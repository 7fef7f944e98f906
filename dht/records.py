"""What a DHT record is, how its parts are encoded, and the limits every node enforces.

Keys, subkeys and values are arbitrary msgpack-serialisable objects; on the wire and in storage
they travel as their msgpack encoding, so a node can store, compare and forward records without
understanding them. A key's place in the keyspace is a hash of its encoding: nobody chooses where
their keys land, as nobody chooses their node ID.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "DHTRecord",
    "DHTValue",
    "RecordError",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_DEPTH",
    "MAX_TTL",
    "CLOCK_SKEW",
    "pack",
    "unpack",
    "key_id",
    "check_expiration",
]

# Keys and subkeys name things (``experts.3.7``, a group key, a peer ID plus an owner marker of 72
# characters); 1 KiB leaves room for that and keeps routing messages small.
MAX_KEY_BYTES = 1024
# Values are announcements (addresses, bandwidths, progress counters), not data: 64 KiB is ample and
# keeps one record far below the RPC layer's 1 MiB header limit.
MAX_VALUE_BYTES = 64 * 1024
# Honest values are shallow; a limit far below msgpack's C stack (1024) and Python's recursion limit
# stops "deep nesting" payloads from costing more than their size.
MAX_DEPTH = 32
# A record lives at most a day; longer-lived facts are re-announced (heartbeats). This stops a peer
# from parking records that outlive everyone who could correct them.
MAX_TTL = 24 * 3600.0
# Volunteers' clocks are NTP-synced in the common case; 5 minutes tolerates a badly set laptop.
CLOCK_SKEW = 300.0
# Domain separation: a key hash never collides with a peer ID hash of the same bytes by design.
_KEY_HASH_PREFIX = b"peerd-dht-key\0"


class RecordError(ValueError):
    """A record part that breaks the limits (size, depth, type, expiration)."""


@dataclass(frozen=True, slots=True)
class DHTRecord:
    """One stored unit, in wire form: ``subkey`` is None for a plain (non-dictionary) value."""

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration_time: float


@dataclass(frozen=True, slots=True)
class DHTValue:
    """What a get returns: the decoded value (for dictionaries: subkey -> DHTValue) and when it expires."""

    value: Any
    expiration_time: float


def pack(obj: Any) -> bytes:
    """msgpack encoding of a key, subkey or value; raises TypeError for unserialisable objects."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_size: int = MAX_VALUE_BYTES, hashable: bool = False) -> Any:
    """Decode bytes that came from the network, with limits on size and nesting depth.

    ``hashable=True`` decodes arrays as tuples, so decoded subkeys can be dictionary keys.
    """
    if len(data) > max_size:
        raise RecordError(f"{len(data)} bytes exceeds the limit of {max_size}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=not hashable,
            strict_map_key=False,
            max_str_len=max_size,
            max_bin_len=max_size,
            max_array_len=max_size,
            max_map_len=max_size // 2,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as error:  # includes StackError, ExtraData
        raise RecordError(f"not a valid msgpack document: {error}") from None
    check_depth(obj)
    return obj


def check_depth(obj: Any, limit: int = MAX_DEPTH) -> None:
    """Raise RecordError if containers nest deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        else:
            continue
        if depth > limit:
            raise RecordError(f"nesting deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)


def key_id(key_bytes: bytes) -> int:
    """The 160-bit keyspace position of an encoded key."""
    return int.from_bytes(hashlib.sha256(_KEY_HASH_PREFIX + key_bytes).digest()[:20], "big")


def check_expiration(expiration_time: Any, now: float) -> float:
    """A finite number no further in the future than MAX_TTL (+ skew); the caller checks the past."""
    if isinstance(expiration_time, bool) or not isinstance(expiration_time, (int, float)):
        raise RecordError(f"expiration time must be a number, got {type(expiration_time).__name__}")
    expiration_time = float(expiration_time)
    if not math.isfinite(expiration_time):
        raise RecordError("expiration time must be finite")
    if expiration_time > now + MAX_TTL + CLOCK_SKEW:
        raise RecordError(f"expiration {expiration_time - now:.0f} s ahead exceeds the limit of {MAX_TTL:.0f} s")
    return expiration_time
