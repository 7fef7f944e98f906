"""Expert announcements in the DHT: who serves which expert, kept alive by a heartbeat.

Layout (Hivemind's, with owners): for an expert ``ffn.3.7`` served at ADDR by peer P, the dictionary
at key ``ffn.`` gets subkey ``[3, peer_subkey(P)]`` and the dictionary at ``ffn.3.`` gets subkey
``[7, peer_subkey(P)]``, each with value ADDR and an expiration a few heartbeats ahead. A client can
then walk the grid one dimension at a time (``beam_search``) asking only "which children of this
prefix are alive?", and a server that vanishes drops out of the grid when its last announcement
expires. Many servers write under the same keys with different subkeys; the DHT merges them.

The owner marker in the subkey makes each announcement P's own: only P's signature can write it,
and P's newest heartbeat replaces its older one whatever their expirations. Without it anyone could
overwrite coordinate 7 with their own address for a day. An address that does not name P (pinned
to another peer) is dropped; an unpinned one is pinned to P, so a client dialing it checks that P
answers. Several servers may announce one coordinate (replicas, or an impostor of a free ID); a
client picks among them at random, so none of them can draw all of its traffic by announcing often.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

from dht.peer_dictionary import dictionary_entries, peer_subkey, subkey_peer
from peer import PeerAddress, PeerID

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
    "fetch_children",
    "pick_servers",
    "announcement_subkey",
    "announced_address",
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
    owner = peer_subkey(dht.host.identity.public_key)
    accepted = 0

    async def store(key: str, coordinate: int, value: str) -> None:
        nonlocal accepted
        try:
            if await dht.store(key, value, expiration_time, subkey=[coordinate, owner]):
                accepted += 1
        except Exception as error:  # one failed store must not stop the heartbeat
            log.warning("announcing %s/%s failed: %r", key, coordinate, error)

    with trio.move_on_after(DHT_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for record in records:
                nursery.start_soon(store, *record)
    return accepted


async def run_heartbeat(
    dht,
    uids: Sequence[str],
    address: PeerAddress | str | Callable[[], PeerAddress | str],
    *,
    period: float = HEARTBEAT_PERIOD,
    ttl: float = HEARTBEAT_TTL,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Announce ``uids`` now (``task_status.started`` once the first round is stored) and every
    ``period`` seconds until cancelled. A callable ``address`` is asked at every round (a peer
    behind NAT announces its relayed address, which changes with its relays)."""
    started = False
    while True:
        current = address() if callable(address) else address
        accepted = await declare_experts(dht, uids, current, dht.clock.time() + ttl)
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
    return pick_servers(dictionary_entries(found, announcement_subkey, announced_address, now=dht.clock.time()))


def pick_servers(entries: Iterable[tuple[tuple[int, PeerID], PeerAddress]]) -> dict[int, PeerAddress]:
    """One server per coordinate, chosen at random among those that announced it."""
    servers: dict[int, list[PeerAddress]] = {}
    for (coordinate, _), address in entries:
        servers.setdefault(coordinate, []).append(address)
    return {coordinate: random.choice(addresses) for coordinate, addresses in servers.items()}


def announcement_subkey(subkey: Any) -> tuple[int, PeerID]:
    """``(coordinate, announcing peer)`` from a subkey ``[coordinate, peer_subkey]`` (a tuple once decoded)."""
    if not isinstance(subkey, tuple) or len(subkey) != 2:
        raise ValueError("an expert announcement's subkey is [coordinate, owner]")
    coordinate, owner = subkey
    if type(coordinate) is not int or coordinate < 0:
        raise ValueError("an expert grid coordinate is a non-negative integer")
    return coordinate, subkey_peer(owner)


def announced_address(subkey: tuple[int, PeerID], value: Any) -> PeerAddress:
    """The announcing peer's address, pinned to it; an address of another peer raises ValueError."""
    if not isinstance(value, str):
        raise TypeError("an expert announcement is an address string")
    address, owner = PeerAddress.parse(value), subkey[1]
    if address.peer_id is not None and address.peer_id != owner:
        raise ValueError("an expert server announces its own address")
    return PeerAddress(address.host, address.port, owner, address.relay)
