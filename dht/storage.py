"""A node's local record store: which record wins, what expires, and who loses room when full.

Plain object, no I/O: the clock is passed in, so tests drive expiry without sleeping.

Which record wins (the same rule on every node, so replicas converge; ``precedence``):
- Unsigned records: a later expiration replaces an earlier one; an earlier or equal one is refused
  (storing the very same record again is accepted, so retries are idempotent).
- Owner-signed records (their key or subkey names an owner; ``version`` is the signed version): the
  higher version wins whatever the expirations, so an owner can always replace, shorten or refresh
  what it signed. An older version is refused even after the newer one has gone (expired or
  evicted) until ``replay_horizon``: the time by which every older version has expired too.
- A signed record outranks an unsigned one. Under one key, either a plain value or a dictionary of
  subkeys lives; the two kinds compete by the same rule (a dictionary ranks as its best subkey), so
  nobody can lock a dictionary of signed subkeys with an unsigned plain value of long expiration.

Who loses room (caps on records and bytes in total, on subkeys per key):
- The writer (the peer that sent the store; None is this node itself) with the largest share of the
  store gives up its soonest-expiring record. A writer that floods the store is therefore always the
  largest and only ever evicts its own records; everyone else keeps being admitted.
- A writer evicting its own records keeps the old rule: a new record that would outlive none of them
  is refused, so a flood of short-lived junk cannot push out one's long-lived records.
The same rule applies within one dictionary when it is at ``max_subkeys``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "StoredValue",
    "Found",
    "Writer",
    "RecordStore",
    "ReplayGuards",
    "merge_found",
    "found_expiration",
    "precedence",
]

# 100k records of ~100 bytes is ~10 MB: a laptop volunteer does not notice; the byte cap bounds the
# worst case of large values.
MAX_RECORDS = 100_000
MAX_STORAGE_BYTES = 64 << 20
# Matchmaking groups and expert grids put at most a few hundred subkeys under one key; this also
# bounds one get reply to MAX_SUBKEYS * MAX_VALUE_BYTES.
MAX_SUBKEYS = 256

# The peer ID (bytes) of whoever sent a store request; None for this node's own stores.
Writer = bytes | None
_Slot = tuple[bytes, bytes | None]  # (key, subkey or None)
_Entry = tuple[float, int, bytes, bytes | None]  # (time, sequence, key, subkey) in a heap


@dataclass(frozen=True, slots=True)
class StoredValue:
    value: bytes
    expiration_time: float
    # The owner's signed version of an owner-signed record (higher is newer); None if unsigned.
    version: int | None = None


# What a get yields: a plain value, or a dictionary subkey -> value.
Found = StoredValue | dict[bytes, StoredValue]


def precedence(item: StoredValue) -> tuple:
    """Sort key of competing records: signed above unsigned, then newest version or expiration.
    A record that does not rank strictly higher than the one held is refused."""
    if item.version is None:
        return (0, item.expiration_time)
    return (1, item.version, item.expiration_time)


def found_precedence(found: Found) -> tuple:
    if isinstance(found, StoredValue):
        return precedence(found)
    return max((precedence(item) for item in found.values()), default=(-1,))


def found_expiration(found: Found) -> float:
    if isinstance(found, StoredValue):
        return found.expiration_time
    return max((item.expiration_time for item in found.values()), default=float("-inf"))


def merge_found(a: Found | None, b: Found | None) -> Found | None:
    """Combine two answers for one key the way storage would: the winning plain value, or the
    dictionaries merged subkey by subkey."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, dict) and isinstance(b, dict):
        merged = dict(a)
        for subkey, item in b.items():
            if subkey not in merged or precedence(merged[subkey]) < precedence(item):
                merged[subkey] = item
        return merged
    return a if found_precedence(a) >= found_precedence(b) else b


class ReplayGuards:
    """The newest owner-signed version seen per record slot, kept until its replay horizon (when
    every older version has expired too), so that an older version is refused even after the newer
    record has gone. At most ``capacity`` guards: when full, those that end soonest go first (their
    replays could only live briefly anyway)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._newest: dict[_Slot, tuple[int, float]] = {}  # slot -> (newest version, horizon)
        self._ends: list[tuple[float, _Slot]] = []  # lazy heap of (horizon, slot)

    def __len__(self) -> int:
        return len(self._newest)

    @property
    def heap_entries(self) -> int:
        """Entries of the horizon heap, stale ones (of extended guards) included: at most about
        twice the guards, so refreshing one record again and again does not grow it."""
        return len(self._ends)

    def refuses(self, slot: _Slot, version: int) -> bool:
        """Whether ``version`` is older than the newest one seen for ``slot`` (a replay)."""
        guard = self._newest.get(slot)
        return guard is not None and version < guard[0]

    def expire(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            horizon, slot = heapq.heappop(self._ends)
            guard = self._newest.get(slot)
            if guard is not None and guard[1] == horizon:
                del self._newest[slot]

    def guard(self, slot: _Slot, version: int, horizon: float) -> None:
        """``version`` of ``slot`` was accepted, so it is the newest seen: refuse older ones until
        ``horizon`` (or the later horizon already guarded)."""
        old = self._newest.get(slot)
        if old is not None and old[1] >= horizon:
            self._newest[slot] = (version, old[1])  # its heap entry stays valid
            return
        self._newest[slot] = (version, horizon)
        heapq.heappush(self._ends, (horizon, slot))
        if len(self._ends) > 2 * len(self._newest) + 1024:  # entries of extended guards
            self._ends = [(end, s) for s, (_, end) in self._newest.items()]
            heapq.heapify(self._ends)
        while len(self._newest) > self.capacity and self._ends:
            end, oldest = heapq.heappop(self._ends)
            if self._newest.get(oldest, (0, None))[1] == end:
                del self._newest[oldest]


class RecordStore:
    def __init__(
        self,
        *,
        max_records: int = MAX_RECORDS,
        max_bytes: int = MAX_STORAGE_BYTES,
        max_subkeys: int = MAX_SUBKEYS,
        clock: Callable[[], float] = time.time,
    ):
        self.max_records, self.max_bytes, self.max_subkeys = max_records, max_bytes, max_subkeys
        # Replay guards are far smaller than records and live at most a record's lifetime longer;
        # one per record slot the store can hold bounds them with the same number.
        self.replay_guards = ReplayGuards(max_records)
        self.clock = clock
        self._plain: dict[bytes, StoredValue] = {}
        self._dicts: dict[bytes, dict[bytes, StoredValue]] = {}
        self._held: dict[_Slot, tuple[int, Writer]] = {}  # slot -> (sequence of its heap entries, writer)
        self._expiry: list[_Entry] = []  # lazy: entries whose sequence is no longer held are skipped
        self._writer_expiry: dict[Writer, list[_Entry]] = {}  # the same, per writer (for eviction)
        self._usage: dict[Writer, list[int]] = {}  # writer -> [records, bytes, sequence of its share entry]
        self._shares: list[tuple[float, int, Writer]] = []  # lazy max-heap of (-share, sequence, writer)
        self._sequence = itertools.count()
        self._records = 0
        self._bytes = 0

    def __len__(self) -> int:
        """Number of live-or-not-yet-purged records (each subkey counts as one)."""
        return self._records

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def expiry_entries(self) -> int:
        """Entries of the expiry heap, stale ones (of replaced records) included: at most about
        twice the records, so replacing one record again and again does not grow it."""
        return len(self._expiry)

    def usage(self, writer: Writer) -> tuple[int, int]:
        """(records, bytes) held that ``writer`` stored."""
        records, nbytes, _ = self._usage.get(writer, (0, 0, 0))
        return records, nbytes

    # ------------------------------------------------------------------ reading
    def get(self, key: bytes) -> Found | None:
        now = self.clock()
        plain = self._plain.get(key)
        if plain is not None:
            if plain.expiration_time > now:
                return plain
            self._remove(key, None)
            return None
        subkeys = self._dicts.get(key)
        if subkeys is None:
            return None
        for subkey in [s for s, item in subkeys.items() if item.expiration_time <= now]:
            self._remove(key, subkey)
        live = self._dicts.get(key)
        return dict(live) if live else None

    # ------------------------------------------------------------------ writing
    def store(
        self,
        key: bytes,
        subkey: bytes | None,
        value: bytes,
        expiration_time: float,
        *,
        version: int | None = None,
        replay_horizon: float | None = None,
        writer: Writer = None,
    ) -> bool:
        """Store one record; False if refused (expired, outranked, a replay, or no room).

        ``version`` marks an owner-signed record (the caller has checked the signature);
        ``replay_horizon`` (default: ``expiration_time``) is when every older version of it has
        expired; ``writer`` is who sent it, for fair eviction.
        """
        now = self.clock()
        self._purge_expired(now)
        if expiration_time <= now:
            return False
        new = StoredValue(value, expiration_time, version)
        slot = (key, subkey)
        current = self._current(key, subkey)
        if current == new:
            return True
        if version is not None and self.replay_guards.refuses(slot, version):
            return False
        rank = precedence(new)
        if current is not None and precedence(current) >= rank:
            return False
        other: Found | None = self._dicts.get(key) if subkey is None else self._plain.get(key)
        if other and found_precedence(other) >= rank:
            return False
        # Outranked records go first, so the room they held counts for the new one; if the new one
        # is refused after all, they come back (a refused replacement must not delete its original).
        outranked = [(key, old) for old in self._dicts.get(key, ())] if subkey is None else [(key, None)]
        taken = [held for held in (self._take(*old) for old in [*outranked, slot]) if held is not None]
        admitted = True
        if subkey is not None and len(self._dicts.get(key, ())) >= self.max_subkeys:
            admitted = self._evict_from_key(key, expiration_time, writer)
        if admitted:
            admitted = self._make_room(self._size(key, subkey, value), expiration_time, writer)
        if not admitted:
            for old_slot, item, old_writer in taken:
                self._insert(old_slot, item, old_writer)
            return False
        self._insert(slot, new, writer)
        if version is not None:
            self.replay_guards.guard(slot, version, expiration_time if replay_horizon is None else replay_horizon)
        return True

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _size(key: bytes, subkey: bytes | None, value: bytes) -> int:
        return len(key) + len(subkey or b"") + len(value)

    def _current(self, key: bytes, subkey: bytes | None) -> StoredValue | None:
        if subkey is None:
            return self._plain.get(key)
        return self._dicts.get(key, {}).get(subkey)

    def _insert(self, slot: _Slot, item: StoredValue, writer: Writer) -> None:
        key, subkey = slot
        if subkey is None:
            self._plain[key] = item
        else:
            self._dicts.setdefault(key, {})[subkey] = item
        sequence = next(self._sequence)
        self._held[slot] = (sequence, writer)
        size = self._size(key, subkey, item.value)
        self._records += 1
        self._bytes += size
        usage = self._usage.setdefault(writer, [0, 0, 0])
        usage[0] += 1
        usage[1] += size
        self._note_share(writer, usage)
        entry = (item.expiration_time, sequence, key, subkey)
        heapq.heappush(self._expiry, entry)
        own = self._writer_expiry.setdefault(writer, [])
        heapq.heappush(own, entry)
        if len(own) > 2 * usage[0] + 64:  # stale entries of replaced records
            own[:] = [e for e in own if self._is_held(e)]
            heapq.heapify(own)

    def _take(self, key: bytes, subkey: bytes | None) -> tuple[_Slot, StoredValue, Writer] | None:
        """Remove a held record and return it with its writer (None if nothing is held there)."""
        item = self._current(key, subkey)
        if item is None:
            return None
        writer = self._held[(key, subkey)][1]
        self._remove(key, subkey)
        return (key, subkey), item, writer

    def _remove(self, key: bytes, subkey: bytes | None) -> None:
        if subkey is None:
            item = self._plain.pop(key, None)
        else:
            subkeys = self._dicts.get(key)
            item = subkeys.pop(subkey, None) if subkeys is not None else None
            if subkeys is not None and not subkeys:
                del self._dicts[key]
        if item is None:
            return
        _, writer = self._held.pop((key, subkey))
        size = self._size(key, subkey, item.value)
        self._records -= 1
        self._bytes -= size
        usage = self._usage[writer]
        usage[0] -= 1
        usage[1] -= size
        if usage[0] == 0:
            del self._usage[writer]
            del self._writer_expiry[writer]
        else:
            self._note_share(writer, usage)

    def _is_held(self, entry: _Entry) -> bool:
        held = self._held.get((entry[2], entry[3]))
        return held is not None and held[0] == entry[1]

    def _purge_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            entry = heapq.heappop(self._expiry)
            if self._is_held(entry):
                self._remove(entry[2], entry[3])
        if len(self._expiry) > 2 * self._records + 1024:  # stale entries from replaced records
            self._expiry = [entry for entry in self._expiry if self._is_held(entry)]
            heapq.heapify(self._expiry)
        self.replay_guards.expire(now)

    def _share(self, usage: list[int]) -> float:
        return max(usage[0] / self.max_records, usage[1] / self.max_bytes)

    def _note_share(self, writer: Writer, usage: list[int]) -> None:
        usage[2] = next(self._sequence)
        heapq.heappush(self._shares, (-self._share(usage), usage[2], writer))
        if len(self._shares) > 2 * len(self._usage) + 1024:  # entries of shares that changed since
            self._shares = [(-self._share(u), u[2], w) for w, u in self._usage.items()]
            heapq.heapify(self._shares)

    def _largest_writer(self, incoming: Writer) -> Writer:
        """The writer holding the largest share of the store (records or bytes, whichever is more);
        on a tie the incoming writer, so writers with equal shares never evict each other."""
        while True:
            negative_share, sequence, writer = self._shares[0]
            usage = self._usage.get(writer)
            if usage is not None and usage[2] == sequence:
                break
            heapq.heappop(self._shares)
        own = self._usage.get(incoming)
        return incoming if own is not None and self._share(own) >= -negative_share else writer

    def _make_room(self, extra_bytes: int, expiration_time: float, writer: Writer) -> bool:
        while self._records + 1 > self.max_records or self._bytes + extra_bytes > self.max_bytes:
            if not self._usage:
                return False  # larger than the whole store
            victim = self._largest_writer(writer)
            own = self._writer_expiry[victim]
            while not self._is_held(own[0]):
                heapq.heappop(own)
            if victim == writer and own[0][0] >= expiration_time:
                return False
            _, _, key, subkey = own[0]
            self._remove(key, subkey)
        return True

    def _evict_from_key(self, key: bytes, expiration_time: float, writer: Writer) -> bool:
        subkeys = self._dicts[key]
        counts: dict[Writer, int] = {}
        for subkey in subkeys:
            held_by = self._held[(key, subkey)][1]
            counts[held_by] = counts.get(held_by, 0) + 1
        victim = max(counts, key=lambda w: (counts[w], w == writer))
        victim_subkeys = [s for s in subkeys if self._held[(key, s)][1] == victim]
        soonest = min(victim_subkeys, key=lambda s: subkeys[s].expiration_time)
        if victim == writer and subkeys[soonest].expiration_time >= expiration_time:
            return False
        self._remove(key, soonest)
        return True
