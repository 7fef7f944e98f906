"""Expert announcements in the DHT: who serves which expert, kept alive by a heartbeat.

Layout (Hivemind's): for an expert ``ffn.3.7`` served at ADDR, the dictionary at key ``ffn.`` gets
subkey ``3`` and the dictionary at ``ffn.3.`` gets subkey ``7``, each with value ADDR and an
expiration a few heartbeats ahead. A client can then walk the grid one dimension at a time
(``beam_search``) asking only "which children of this prefix are alive?", and a server that
vanishes drops out of the grid when its last announcement expires. Many servers write under the
same keys with different subkeys; the DHT merges them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import trio

from dht.peer_dictionary import dictionary_entries
from peer import PeerAddress

from .protocol import UID_DELIMITER, split_uid

__all__ = [
    "HEARTBEAT_PERIOD",
    "HEARTBEAT_TTL",
    "DHT_TIMEOUT",
    "prefix_key",
    "announcement_records",
    "declare_experts",
    "run_heartbeat",
    "get_expert_addresses",
]

log = logging.getLogger("peerd.moe")

# Re-announce every 15 s, valid for 45 s: a server survives two lost heartbeats, and a dead one
# leaves the grid within 45 s (clients also mask failures immediately, so this only bounds waste).
HEARTBEAT_PERIOD = 15.0
HEARTBEAT_TTL = 45.0
# One batch of DHT reads or writes: a DHT lookup's own deadline (dht.DHTConfig.lookup_timeout).
DHT_TIMEOUT = 10.0


def prefix_key(prefix: str, coords: Sequence[int]) -> str:
    """The DHT key listing the live children of a partial expert ID: ``("ffn", (3,))`` -> ``"ffn.3."``."""
    return UID_DELIMITER.join([prefix, *map(str, coords)]) + UID_DELIMITER


def announcement_records(uids: Iterable[str], address: str) -> list[tuple[str, int, str]]:
    """``(key, subkey, value)`` for every prefix of every expert ID, without duplicates."""
    records: dict[tuple[str, int], str] = {}
    for uid in uids:
        prefix, coords = split_uid(uid)
        for depth, coord in enumerate(coords):
            records[(prefix_key(prefix, coords[:depth]), coord)] = address
    return [(key, subkey, value) for (key, subkey), value in records.items()]


async def declare_experts(dht, uids: Iterable[str], address: PeerAddress | str, expiration_time: float) -> int:
    """Store every announcement concurrently; returns how many the DHT accepted."""
    records = announcement_records(uids, str(address))
    accepted = 0

    async def store(key: str, subkey: int, value: str) -> None:
        nonlocal accepted
        try:
            if await dht.store(key, value, expiration_time, subkey=subkey):
                accepted += 1
        except Exception as error:  # one failed store must not stop the heartbeat
            log.warning("announcing %s/%s failed: %r", key, subkey, error)

    with trio.move_on_after(DHT_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for record in records:
                nursery.start_soon(store, *record)
    return accepted


async def run_heartbeat(
    dht,
    uids: Sequence[str],
    address: PeerAddress | str,
    *,
    period: float = HEARTBEAT_PERIOD,
    ttl: float = HEARTBEAT_TTL,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Announce ``uids`` now (``task_status.started`` once the first round is stored) and every
    ``period`` seconds until cancelled."""
    started = False
    while True:
        accepted = await declare_experts(dht, uids, address, time.time() + ttl)
        if not accepted:
            log.warning("no DHT peer accepted the announcement of %d experts", len(uids))
        if not started:
            task_status.started()
            started = True
        await trio.sleep(period)


async def get_expert_addresses(dht, uids: Sequence[str]) -> dict[str, PeerAddress | None]:
    """Where each expert is served according to the DHT (None if not announced or expired)."""
    result: dict[str, PeerAddress | None] = dict.fromkeys(uids)
    wanted: dict[str, list[tuple[str, int]]] = {}
    for uid in uids:
        prefix, coords = split_uid(uid)
        wanted.setdefault(prefix_key(prefix, coords[:-1]), []).append((uid, coords[-1]))

    async def fetch(key: str) -> None:
        children = await fetch_children(dht, key)
        for uid, coord in wanted[key]:
            result[uid] = children.get(coord)

    with trio.move_on_after(DHT_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for key in wanted:
                nursery.start_soon(fetch, key)
    return result


async def fetch_children(dht, key: str) -> dict[int, PeerAddress]:
    """Live children of a prefix key, ignoring entries that are not well-formed (the DHT is open to all)."""
    try:
        found = await dht.get(key, latest=True)
    except Exception as error:
        log.debug("DHT get %s failed: %r", key, error)
        return {}
    return dict(dictionary_entries(found, _coordinate, _address))


def _coordinate(subkey: Any) -> int:
    if type(subkey) is not int or subkey < 0:
        raise ValueError("an expert grid coordinate is a non-negative integer")
    return subkey


def _address(coordinate: int, value: Any) -> PeerAddress:
    if not isinstance(value, str):
        raise TypeError("an expert announcement is an address string")
    return PeerAddress.parse(value)
