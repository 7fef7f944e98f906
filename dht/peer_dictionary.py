"""Reading a DHT dictionary that many peers write into, one subkey each.

Matchmaking declarations, progress records, state donors and expert announcements all live under
one key, with every writer under its own subkey. The DHT is open to everyone, so what a get
returns may hold entries anyone wrote: subkeys that name no peer, values of the wrong shape, or
records that expired after the node that answered last purged its store. Every reader drops those
the same way, here; what counts as well-formed is each reader's own parser.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from peer import PeerID

from .records import DHTValue

__all__ = ["MALFORMED", "dictionary_entries", "peer_entries", "peer_subkey"]

Subkey = TypeVar("Subkey")
Value = TypeVar("Value")

# What a parser raises for an entry that is not well-formed. KeyError too, so that a parser may
# index a map it got from the network (``body["address"]``) and let a missing field drop the entry.
MALFORMED = (ValueError, TypeError, KeyError)


def dictionary_entries(
    found: DHTValue | None,
    parse_subkey: Callable[[Any], Subkey],
    parse_value: Callable[[Subkey, Any], Value],
    *,
    now: float | None = None,
) -> Iterator[tuple[Subkey, Value]]:
    """``(subkey, value)`` for every unexpired, well-formed entry of a dictionary value.

    ``found`` is what ``get`` returned for the key: None, or a plain value where a dictionary was
    expected, yields nothing. ``parse_subkey`` and ``parse_value`` return the parsed form or raise
    one of ``MALFORMED`` to drop the entry. ``now`` is the wall clock (``time.time()``) that DHT
    expirations count in; an entry expiring exactly now is expired, as the stores treat it.
    """
    if found is None or not isinstance(found.value, dict):
        return
    now = time.time() if now is None else now
    for raw_subkey, item in found.value.items():
        if not isinstance(item, DHTValue) or not item.expiration_time > now:
            continue
        try:
            subkey = parse_subkey(raw_subkey)
            value = parse_value(subkey, item.value)
        except MALFORMED:
            continue
        yield subkey, value


def peer_entries(
    found: DHTValue | None, parse_value: Callable[[PeerID, Any], Value], *, now: float | None = None
) -> Iterator[tuple[PeerID, Value]]:
    """``dictionary_entries`` of a dictionary whose subkeys are peer IDs (in their byte form)."""
    return dictionary_entries(found, peer_subkey, parse_value, now=now)


def peer_subkey(raw: Any) -> PeerID:
    """A peer ID from a subkey; only bytes qualify (``bytes()`` would also take a list of ints)."""
    if not isinstance(raw, bytes):
        raise TypeError(f"a peer subkey is bytes, got {type(raw).__name__}")
    return PeerID(raw)
