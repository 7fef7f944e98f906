"""What one node keeps and trusts: its ``RecordStore`` behind its validators.

Every record is validated when it is stored and again when it is read out (for a reply or for the
node's own get), so a record that slipped in before a validator existed, or was planted by a bug,
still never reaches a reader. Also turns wire-form answers into the ``DHTValue`` a caller sees.
"""

from __future__ import annotations

from typing import Any

from .records import DHTRecord, DHTValue, RecordError, unpack
from .storage import Found, RecordStore, StoredValue, merge_found
from .validation import RecordValidator

__all__ = ["LocalRecords", "as_records"]


class LocalRecords:
    def __init__(self, validator: RecordValidator, storage: RecordStore | None = None):
        self.validator = validator
        self.storage = storage if storage is not None else RecordStore()

    def store(self, record: DHTRecord) -> bool:
        """Validate and store one wire-form record; False if invalid, stale or out of room."""
        if not self.validator.validate(record):
            return False
        try:
            unpack(self.validator.strip(record))  # the inner value obeys the limits too
        except RecordError:
            return False
        return self.storage.store(record.key, record.subkey, record.value, record.expiration_time)

    def found(self, key: bytes) -> Found | None:
        """What storage holds for ``key``, re-validated."""
        found = self.storage.get(key)
        return None if found is None else self.validated(as_records(key, found))

    def validated(self, records: list[DHTRecord]) -> Found | None:
        """The valid ones among ``records`` (all of one key), merged."""
        result: Found | None = None
        for record in records:
            if self.validator.validate(record):
                item = StoredValue(record.value, record.expiration_time)
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


def as_records(key: bytes, found: Found) -> list[DHTRecord]:
    if isinstance(found, StoredValue):
        return [DHTRecord(key, None, found.value, found.expiration_time)]
    return [DHTRecord(key, subkey, item.value, item.expiration_time) for subkey, item in found.items()]


def _decode_subkey(subkey: bytes) -> Any:
    decoded = unpack(subkey, hashable=True)
    try:
        hash(decoded)
    except TypeError:  # a map as subkey: keep the encoding, which is hashable
        return subkey
    return decoded
