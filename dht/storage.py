"""A node's local record store: expirations, newer-wins, dictionary values and hard caps.

Plain object, no I/O: the clock is passed in, so tests drive expiry without sleeping.

Rules (the same for every node, so replicas converge):
- A store whose expiration is later than what is held replaces it; an earlier or equal one is
  refused (storing the very same record again is accepted, so retries are idempotent).
- Under one key, either a plain value or a dictionary of subkeys lives. A subkey store competes with
  a plain value by expiration, and a plain store competes with the dictionary's latest subkey.
- Expired records disappear (lazily on access, and in expiration order on every store).
- Caps on records, bytes and subkeys per key: when full, the soonest-expiring record is evicted if
  the new one outlives it, otherwise the new one is refused. A flood of short-lived junk therefore
  cannot push out long-lived records.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["StoredValue", "Found", "RecordStore", "merge_found", "found_expiration"]

# 100k records of ~100 bytes is ~10 MB: a laptop volunteer does not notice; the byte cap bounds the
# worst case of large values.
MAX_RECORDS = 100_000
MAX_STORAGE_BYTES = 64 << 20
# Matchmaking groups and expert grids put at most a few hundred subkeys under one key; this also
# bounds one get reply to MAX_SUBKEYS * MAX_VALUE_BYTES.
MAX_SUBKEYS = 256


@dataclass(frozen=True, slots=True)
class StoredValue:
    value: bytes
    expiration_time: float


# What a get yields: a plain value, or a dictionary subkey -> value.
Found = StoredValue | dict[bytes, StoredValue]


def found_expiration(found: Found) -> float:
    if isinstance(found, StoredValue):
        return found.expiration_time
    return max((item.expiration_time for item in found.values()), default=float("-inf"))


def merge_found(a: Found | None, b: Found | None) -> Found | None:
    """Combine two answers for one key the way storage would: newest plain value, merged subkeys."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, dict) and isinstance(b, dict):
        merged = dict(a)
        for subkey, item in b.items():
            if subkey not in merged or merged[subkey].expiration_time < item.expiration_time:
                merged[subkey] = item
        return merged
    return a if found_expiration(a) >= found_expiration(b) else b


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
        self.clock = clock
        self._plain: dict[bytes, StoredValue] = {}
        self._dicts: dict[bytes, dict[bytes, StoredValue]] = {}
        self._expiry: list[tuple[float, int, bytes, bytes | None]] = []  # lazy: stale entries skipped
        self._sequence = itertools.count()
        self._records = 0
        self._bytes = 0

    def __len__(self) -> int:
        """Number of live-or-not-yet-purged records (each subkey counts as one)."""
        return self._records

    @property
    def nbytes(self) -> int:
        return self._bytes

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
    def store(self, key: bytes, subkey: bytes | None, value: bytes, expiration_time: float) -> bool:
        """Store one record; False if refused (expired, older than held, or no room)."""
        now = self.clock()
        self._purge_expired(now)
        if expiration_time <= now:
            return False
        current = self._current(key, subkey)
        if current is not None:
            if current.expiration_time == expiration_time and current.value == value:
                return True
            if current.expiration_time >= expiration_time:
                return False
        # The other kind under the same key must be older than the new record.
        if subkey is None and key in self._dicts:
            if found_expiration(self._dicts[key]) >= expiration_time:
                return False
        if subkey is not None and key in self._plain:
            if self._plain[key].expiration_time >= expiration_time:
                return False
        size = self._size(key, subkey, value)
        if subkey is not None and current is None and len(self._dicts.get(key, ())) >= self.max_subkeys:
            if not self._evict_from_key(key, expiration_time):
                return False
        if not self._make_room(size - (self._size(key, subkey, current.value) if current else 0), expiration_time):
            return False
        if subkey is None:
            if key in self._dicts:
                for old in list(self._dicts[key]):
                    self._remove(key, old)
            if current is not None:
                self._remove(key, None)
            self._plain[key] = StoredValue(value, expiration_time)
        else:
            if key in self._plain:
                self._remove(key, None)
            if current is not None:
                self._remove(key, subkey)
            self._dicts.setdefault(key, {})[subkey] = StoredValue(value, expiration_time)
        self._records += 1
        self._bytes += size
        heapq.heappush(self._expiry, (expiration_time, next(self._sequence), key, subkey))
        return True

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _size(key: bytes, subkey: bytes | None, value: bytes) -> int:
        return len(key) + len(subkey or b"") + len(value)

    def _current(self, key: bytes, subkey: bytes | None) -> StoredValue | None:
        if subkey is None:
            return self._plain.get(key)
        return self._dicts.get(key, {}).get(subkey)

    def _remove(self, key: bytes, subkey: bytes | None) -> None:
        if subkey is None:
            item = self._plain.pop(key, None)
        else:
            subkeys = self._dicts.get(key)
            item = subkeys.pop(subkey, None) if subkeys is not None else None
            if subkeys is not None and not subkeys:
                del self._dicts[key]
        if item is not None:
            self._records -= 1
            self._bytes -= self._size(key, subkey, item.value)

    def _is_live_entry(self, entry: tuple[float, int, bytes, bytes | None]) -> bool:
        expiration_time, _, key, subkey = entry
        current = self._current(key, subkey)
        return current is not None and current.expiration_time == expiration_time

    def _purge_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            entry = heapq.heappop(self._expiry)
            if self._is_live_entry(entry):
                self._remove(entry[2], entry[3])
        if len(self._expiry) > 2 * self._records + 1024:  # stale entries from replaced records
            self._expiry = [entry for entry in self._expiry if self._is_live_entry(entry)]
            heapq.heapify(self._expiry)

    def _make_room(self, extra_bytes: int, expiration_time: float) -> bool:
        while self._records + 1 > self.max_records or self._bytes + extra_bytes > self.max_bytes:
            while self._expiry and not self._is_live_entry(self._expiry[0]):
                heapq.heappop(self._expiry)
            if not self._expiry or self._expiry[0][0] >= expiration_time:
                return False
            _, _, key, subkey = heapq.heappop(self._expiry)
            self._remove(key, subkey)
        return True

    def _evict_from_key(self, key: bytes, expiration_time: float) -> bool:
        subkeys = self._dicts[key]
        victim = min(subkeys, key=lambda s: subkeys[s].expiration_time)
        if subkeys[victim].expiration_time >= expiration_time:
            return False
        self._remove(key, victim)
        return True
