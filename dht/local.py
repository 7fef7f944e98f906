"""What one node keeps and trusts: its ``RecordStore`` behind its validators and lifetime caps.

Every record is validated when it is stored and again when it is read out (for a reply or for the
node's own get), so a record that slipped in before a validator existed, or was planted by a bug,
still never reaches a reader. Also turns wire-form answers into the ``DHTValue`` a caller sees.

A popular dictionary (matchmaking declarations, progress records) is read by every peer of the
swarm, again and again, and each read brings back the same records: the verdict on a record (its
signed version and its lifetime cap, or refused) is remembered by a digest of everything it
consists of, so that reading it again costs a hash and the lifetime arithmetic, not its decoding
and the validators' work. The memory is bounded (``VERDICTS`` records, oldest forgotten first) and
starts over whenever a validator is added or the lifetime caps are replaced; validators must
therefore judge a record by its bytes alone (a schema check with state of its own would be
remembered at its first answer).

Lifetimes: a record may expire at most its namespace's cap (``lifetimes``, the validators'
``max_ttl``, ``MAX_TTL``) ahead of now. An owner-signed record is bounded from its signing time
(its version) as well: then every older version of it has expired by ``signed at + cap + skew``,
which tells storage how long to keep refusing replays of them after the newest has gone.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from .lifetimes import DEFAULT_TTL_CAPS, key_ttl_cap
from .records import CLOCK_SKEW, MAX_TTL, DHTRecord, DHTValue, RecordError, unpack
from .storage import Found, RecordStore, StoredValue, Writer, merge_found, precedence
from .validation import RecordValidator, signed_version

__all__ = ["LocalRecords", "as_records"]

# The built-in caps depend on the key alone and every record is checked on each store and read:
# remembering the answer per key saves decoding the key once per cap. Bounded: cleared when full.
_KEY_CAP_CACHE_SIZE = 4096
VERDICTS = 4096  # remembered record verdicts per node (about 170 bytes each)
_REFUSED = (None, -1.0)


class LocalRecords:
    def __init__(self, validator: RecordValidator, storage: RecordStore | None = None):
        self.validator = validator
        self.storage = storage if storage is not None else RecordStore()
        self.lifetimes = DEFAULT_TTL_CAPS  # caps by key namespace, on top of the validators' own
        self._key_caps: dict[bytes, float | None] = {}
        self._verdicts: dict[bytes, tuple[int | None, float]] = {}  # digest -> (version, cap) or _REFUSED
        self._generation: tuple[int, int] | None = None  # (the validators' generation, the caps table's id)

    def now(self) -> float:
        """The wall clock records live by here (the storage's: ``time.time`` unless the node was
        given another clock)."""
        return self.storage.clock()

    def max_ttl(self, record: DHTRecord) -> float:
        """The longest lifetime ``record``'s namespace allows (seconds)."""
        key_cap = self._key_caps.get(record.key, -1.0)
        if key_cap == -1.0:
            if len(self._key_caps) >= _KEY_CAP_CACHE_SIZE:
                self._key_caps.clear()
            key_cap = self._key_caps[record.key] = key_ttl_cap(record.key, self.lifetimes)
        limits = (self.validator.max_ttl(record), key_cap)
        return min([MAX_TTL, *(limit for limit in limits if limit is not None)])

    def lifetime_error(self, record: DHTRecord, now: float) -> str | None:
        """Why ``record`` may not live as long as it asks (None if it may)."""
        return self._lifetime_error(record, now, signed_version(record))

    def _lifetime_error(self, record: DHTRecord, now: float, version: int | None) -> str | None:
        """``lifetime_error`` with ``record``'s ``signed_version`` already worked out."""
        limit = self.max_ttl(record)
        if record.expiration_time > now + limit + CLOCK_SKEW:
            ahead = record.expiration_time - now
            return f"expires {ahead:.0f} s ahead; records under this key live at most {limit:g} s"
        if version is not None:
            signed_at = version / 1e9
            # A version from the future would lock its owner out of its own record until then.
            if signed_at > now + CLOCK_SKEW:
                return "signed in the future"
            if record.expiration_time > signed_at + limit + CLOCK_SKEW:
                return f"expires more than {limit:g} s after it was signed"
        return None

    def check_lifetime(self, record: DHTRecord, now: float) -> None:
        """Raise ValueError if no node would accept ``record``'s expiration (for our own stores)."""
        error = self.lifetime_error(record, now)
        if error is not None:
            raise ValueError(error)

    def acceptable(self, record: DHTRecord) -> bool:
        """Valid under the validators, and its inner value and subkey decode within the limits:
        what a reader will ``decode`` must not be able to fail, wherever the record came from."""
        try:
            inner = self.validator.inner_if_valid(record)
            if inner is None:
                return False
            unpack(inner)
            if record.subkey is not None:
                unpack(record.subkey, hashable=True)
        except RecordError:
            return False
        return True

    def verdict(self, record: DHTRecord) -> tuple[int | None, float] | None:
        """``(signed version, lifetime cap)`` of an ``acceptable`` record, None for any other:
        remembered, so the same record read again is not validated again."""
        generation = (getattr(self.validator, "generation", 0), id(self.lifetimes))
        if generation != self._generation:
            self._verdicts.clear()
            self._key_caps.clear()
            self._generation = generation
        digest = _digest(record)
        known = self._verdicts.get(digest)
        if known is None:
            known = (signed_version(record), self.max_ttl(record)) if self.acceptable(record) else _REFUSED
            if len(self._verdicts) >= VERDICTS:
                del self._verdicts[next(iter(self._verdicts))]
            self._verdicts[digest] = known
        return None if known is _REFUSED else known

    def _outlives(self, record: DHTRecord, now: float, version: int | None, limit: float) -> bool:
        """``_lifetime_error`` for a record whose version and cap are known: does it ask too much?"""
        if record.expiration_time > now + limit + CLOCK_SKEW:
            return True
        if version is None:
            return False
        signed_at = version / 1e9
        return signed_at > now + CLOCK_SKEW or record.expiration_time > signed_at + limit + CLOCK_SKEW

    def store(self, record: DHTRecord, writer: Writer = None) -> bool:
        """Validate and store one wire-form record sent by ``writer`` (None: this node); False if
        invalid, too long-lived, outranked, a replay, or out of room."""
        verdict = self.verdict(record)
        if verdict is None:
            return False
        version, limit = verdict
        if self._outlives(record, self.storage.clock(), version, limit):
            return False
        horizon = None if version is None else version / 1e9 + limit + CLOCK_SKEW
        return self.storage.store(
            record.key,
            record.subkey,
            record.value,
            record.expiration_time,
            version=version,
            replay_horizon=horizon,
            writer=writer,
        )

    def found(self, key: bytes) -> Found | None:
        """What storage holds for ``key``, re-validated."""
        found = self.storage.get(key)
        return None if found is None else self.validated(as_records(key, found))

    def validated(self, records: list[DHTRecord]) -> Found | None:
        """The valid ones among ``records`` (all of one key), merged."""
        now = self.storage.clock()
        kept: list[tuple[DHTRecord, StoredValue]] = []
        for record in records:
            verdict = self.verdict(record)
            if verdict is None:
                continue
            version, limit = verdict
            if not self._outlives(record, now, version, limit):
                kept.append((record, StoredValue(record.value, record.expiration_time, version)))
        if kept and all(record.subkey is not None for record, _ in kept):
            entries: dict[bytes, StoredValue] = {}  # a dictionary's entries, merged in place: O(n)
            for record, item in kept:
                held = entries.get(record.subkey)
                if held is None or precedence(held) < precedence(item):
                    entries[record.subkey] = item
            return entries
        result: Found | None = None
        for record, item in kept:
            result = merge_found(result, item if record.subkey is None else {record.subkey: item})
        return result

    def decode(self, key: bytes, found: Found) -> DHTValue:
        """Validated wire-form records -> the caller's objects (validator envelopes removed)."""
        if isinstance(found, StoredValue):
            inner = self.validator.strip(DHTRecord(key, None, found.value, found.expiration_time))
            return DHTValue(unpack(inner), found.expiration_time)
        items: dict[Any, DHTValue] = {}
        for subkey, item in found.items():
            inner = self.validator.strip(DHTRecord(key, subkey, item.value, item.expiration_time))
            items[_decode_subkey(subkey)] = DHTValue(unpack(inner), item.expiration_time)
        return DHTValue(items, max(item.expiration_time for item in found.values()))


def _digest(record: DHTRecord) -> bytes:
    """A digest of every part of ``record``, each length-prefixed so no two records share one."""
    digest = hashlib.blake2b(digest_size=32)  # a collision would pass a forgery as verified
    subkey = b"" if record.subkey is None else record.subkey
    flag = b"\x00" if record.subkey is None else b"\x01"
    digest.update(struct.pack(">IId", len(record.key), len(subkey), record.expiration_time))
    digest.update(flag)
    digest.update(record.key)
    digest.update(subkey)
    digest.update(record.value)
    return digest.digest()


def as_records(key: bytes, found: Found) -> list[DHTRecord]:
    if isinstance(found, StoredValue):  # versions travel inside signed values: nothing is lost
        return [DHTRecord(key, None, found.value, found.expiration_time)]
    return [DHTRecord(key, subkey, item.value, item.expiration_time) for subkey, item in found.items()]


def _decode_subkey(subkey: bytes) -> Any:
    decoded = unpack(subkey, hashable=True)
    try:
        hash(decoded)
    except TypeError:  # a map as subkey: keep the encoding, which is hashable
        return subkey
    return decoded
