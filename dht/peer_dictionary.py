"""Reading a DHT dictionary that many peers write into, one owner-signed subkey each.

Matchmaking declarations, progress records, state donors and expert announcements all live under
one key, with every writer under its own subkey. A writer's subkey carries its owner marker
(``peer_subkey``): every node refuses a store under it unless the marked key signed it, and the
owner's newest signature replaces its older records whatever their expirations. So nobody can write,
squat on or extend another peer's entry; a reader learns whose entry it is from the subkey
(``subkey_peer``) and trusts no peer ID that a value claims.

The DHT is open to everyone, so what a get returns may still hold entries anyone wrote: subkeys
that name no owner (such as a plain peer ID, which nobody signs and so anyone could have written),
values of the wrong shape, or records that expired after the node that answered last purged its
store. Every reader drops those the same way, here; what counts as well-formed is each reader's own
parser, which also drops a value whose claims (an address pinned to another peer) disagree with its
signer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from peer import PeerID

from .records import DHTValue
from .validation import owner_marker

__all__ = ["MALFORMED", "dictionary_entries", "peer_entries", "peer_subkey", "subkey_peer"]

Subkey = TypeVar("Subkey")
Value = TypeVar("Value")

# What a parser raises for an entry that is not well-formed. KeyError too, so that a parser may
# index a map it got from the network (``body["address"]``) and let a missing field drop the entry.
MALFORMED = (ValueError, TypeError, KeyError)

# The whole subkey is one owner marker (``validation.owner_marker``): a subkey that merely contains
# one, next to other text, would let the same owner hold many entries that readers count as one.
_PEER_SUBKEY = re.compile(r"\[owner:([0-9a-f]{64})\]")


def peer_subkey(public_key: bytes) -> str:
    """The subkey under which the holder of ``public_key`` writes its own entry of a dictionary.
    The DHT node signs it with its identity, so pass the node's own key (``dht.host.identity``)."""
    return owner_marker(public_key)


def subkey_peer(raw: Any) -> PeerID:
    """The peer whose signature a ``peer_subkey`` demands (the DHT checked it before we see it)."""
    if not isinstance(raw, str):
        raise TypeError(f"a peer subkey is an owner marker string, got {type(raw).__name__}")
    match = _PEER_SUBKEY.fullmatch(raw)
    if match is None:
        raise ValueError("the subkey is not an owner marker")
    return PeerID.from_public_key(bytes.fromhex(match[1]))


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
    """``dictionary_entries`` of a dictionary whose subkeys are ``peer_subkey``s: each entry comes
    with the peer that signed it, and ``parse_value(peer, value)`` checks the value against it."""
    return dictionary_entries(found, subkey_peer, parse_value, now=now)
