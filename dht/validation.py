"""Record validators: who may write a record, and what shape its value must have.

A validator sees records in wire form (``DHTRecord``: encoded key, subkey, value, expiration). It
can wrap a value before it is stored (``sign``), check a record that arrives (``validate``) and
unwrap the value for the reader (``strip``). Every node runs the same validators on every record it
stores and on every record it returns or receives, so one dishonest node cannot make a forged record
reach an honest reader.

Composition (``CompositeValidator``) nests them by priority: lower-priority validators wrap first
(innermost), so the signature, which has the highest priority, covers what the others produced.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import msgpack

from peer import Identity
from peer.verified import VerifiedSignatureCache, default_signature_cache

from .records import CLOCK_SKEW, DHTRecord, RecordError, pack, unpack

__all__ = [
    "RecordValidator",
    "SignatureValidator",
    "SchemaValidator",
    "CompositeValidator",
    "owner_marker",
    "signed_version",
    "ValidationError",
]


class ValidationError(ValueError):
    """Raised by ``sign`` when a record cannot be made valid (e.g. it names someone else's key)."""


class RecordValidator:
    """Base: accepts everything and changes nothing."""

    priority: int = 0

    def sign(self, record: DHTRecord) -> bytes:
        """The value to put on the wire for ``record`` (default: unchanged)."""
        return record.value

    def validate(self, record: DHTRecord) -> bool:
        return True

    def strip(self, record: DHTRecord) -> bytes:
        """The inner value of a record that passed ``validate``."""
        return record.value

    def inner_if_valid(self, record: DHTRecord) -> bytes | None:
        """``strip(record)`` if ``validate(record)``, else None: both in one step where a validator
        can share their work (the default just calls both)."""
        return self.strip(record) if self.validate(record) else None

    def max_ttl(self, record: DHTRecord) -> float | None:
        """The longest lifetime (seconds) this validator allows ``record``; None: no opinion.

        Every node refuses a record whose expiration lies further ahead than the smallest of these
        (and ``MAX_TTL``), so a key namespace declares how long its records may live."""
        return None


# ---------------------------------------------------------------------- signed records
_OWNER_PATTERN = re.compile(rb"\[owner:([0-9a-f]{64})\]")


def owner_marker(public_key: bytes) -> str:
    """Put this string in a key or subkey (``f"experts.{owner_marker(pk)}"``) to make it writable only
    with the signature of ``public_key``'s owner."""
    if len(public_key) != 32:
        raise ValueError("an Ed25519 public key has 32 bytes")
    return f"[owner:{public_key.hex()}]"


def _owners(record: DHTRecord) -> set[bytes]:
    found = _OWNER_PATTERN.findall(record.key)
    if record.subkey is not None:
        found += _OWNER_PATTERN.findall(record.subkey)
    return {bytes.fromhex(text.decode()) for text in found}


def _signed_message(record: DHTRecord, inner: bytes, version: int) -> bytes:
    # The expiration is signed too: nobody can extend the life of someone else's record. The version
    # orders the owner's records (storage keeps the highest), so it is signed as well.
    return pack([b"peerd-dht-record/2", record.key, record.subkey, inner, record.expiration_time, version])


class SignatureValidator(RecordValidator):
    """Records whose key or subkey contains an owner marker must carry that owner's Ed25519
    signature over (key, subkey, value, expiration, version). Other records pass untouched.

    The wire value of a signed record is ``msgpack([inner_value, version, signature])``. The version
    is the signing time in nanoseconds, raised by one when the clock has not moved (or went back), so
    one signer's versions only grow: storage replaces an owner's record by its newer version whatever
    the expirations, and refuses replays of older ones. Being a time, it also tells every node when
    any older version must have expired (see ``LocalRecords``).

    Signatures are checked through ``signatures`` (default: the process's ``default_signature_cache``):
    a record is checked when stored, again when read out for every answer, and by every reader, so
    each of an N-writer dictionary's reads would otherwise cost N verifications. A record verified
    once, byte for byte the same, is answered from the cache; one that differs in any signed field
    or in its signature is verified afresh.
    """

    priority = 100  # outermost: signs what every other validator produced

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        clock: Callable[[], float] = time.time,
        signatures: VerifiedSignatureCache | None = None,
    ):
        self.identity = identity
        self.clock = clock
        self.signatures = signatures if signatures is not None else default_signature_cache()
        self._last_version = 0

    def next_version(self) -> int:
        """The signing time in ns, above every version this signer gave before; but never more
        than the clock skew every node tolerates ahead of now: after the wall clock is stepped back
        (NTP correcting a fast clock) counting on from the old versions would be "signed in the
        future" and refused everywhere. Restarting from now lets the nodes' replay guard, which
        holds the old versions only until they could have expired, refuse these for at most a
        record type's lifetime, instead of failing every store."""
        now = int(self.clock() * 1e9)
        following = self._last_version + 1
        if following > now + int(CLOCK_SKEW * 1e9) // 2:  # the clock went back: follow it
            following = now
        self._last_version = max(now, following)
        return self._last_version

    def sign(self, record: DHTRecord) -> bytes:
        owners = _owners(record)
        if not owners:
            return record.value
        if self.identity is None or owners != {self.identity.public_key}:
            raise ValidationError("the record names an owner key that is not ours; it cannot be signed")
        version = self.next_version()
        return pack([record.value, version, self.identity.sign(_signed_message(record, record.value, version))])

    def validate(self, record: DHTRecord) -> bool:
        owners = _owners(record)
        if not owners:
            return True
        if len(owners) != 1:
            return False
        envelope = _envelope(record.value)
        if envelope is None:
            return False
        inner, version, signature = envelope
        return self.signatures.verify(next(iter(owners)), signature, _signed_message(record, inner, version))

    def strip(self, record: DHTRecord) -> bytes:
        if not _owners(record):
            return record.value
        envelope = _envelope(record.value)
        if envelope is None:
            raise RecordError("signed record without a signature envelope")
        return envelope[0]

    def inner_if_valid(self, record: DHTRecord) -> bytes | None:
        # ``validate`` and ``strip`` in one pass: the owner markers are searched and the envelope
        # decoded once, not twice, for every record stored or read.
        owners = _owners(record)
        if not owners:
            return record.value
        if len(owners) != 1:
            return None
        envelope = _envelope(record.value)
        if envelope is None:
            return None
        inner, version, signature = envelope
        valid = self.signatures.verify(next(iter(owners)), signature, _signed_message(record, inner, version))
        return inner if valid else None


def signed_version(record: DHTRecord) -> int | None:
    """The signed version of an owner-marked record in wire form (check ``validate`` first), else None."""
    if not _owners(record):
        return None
    envelope = _envelope(record.value)
    return None if envelope is None else envelope[1]


# A version is a time in ns: 0 up to 2**63 (the year 2262) keeps it a msgpack int64 on every node.
_MAX_VERSION = 2**63 - 1


def _envelope(value: bytes) -> tuple[bytes, int, bytes] | None:
    try:
        decoded = msgpack.unpackb(value, raw=False, max_array_len=3, max_map_len=0, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if (
        isinstance(decoded, list)
        and len(decoded) == 3
        and isinstance(decoded[0], bytes)
        and type(decoded[1]) is int
        and 0 <= decoded[1] <= _MAX_VERSION
        and isinstance(decoded[2], bytes)
        and len(decoded[2]) == 64
    ):
        return decoded[0], decoded[1], decoded[2]
    return None


# ---------------------------------------------------------------------- schemas
class SchemaValidator(RecordValidator):
    """Values (and optionally subkeys) under keys that are strings starting with ``prefix`` must pass
    ``value_check`` (a type, a tuple of types, or a predicate on the decoded object)."""

    priority = 10

    def __init__(self, prefix: str, value_check: Any, subkey_check: Any = None):
        self.prefix = prefix
        self.value_check = _as_predicate(value_check)
        self.subkey_check = _as_predicate(subkey_check) if subkey_check is not None else None

    def _applies(self, record: DHTRecord) -> bool:
        try:
            key = unpack(record.key)
        except RecordError:
            return False
        return isinstance(key, str) and key.startswith(self.prefix)

    def validate(self, record: DHTRecord) -> bool:
        if not self._applies(record):
            return True
        try:
            if not self.value_check(unpack(record.value)):
                return False
            if self.subkey_check is not None:
                if record.subkey is None or not self.subkey_check(unpack(record.subkey, hashable=True)):
                    return False
        except RecordError:
            return False
        except Exception:  # a user predicate that raises rejects, it does not crash the handler
            return False
        return True


def _as_predicate(check: Any) -> Callable[[Any], bool]:
    if isinstance(check, type) or (isinstance(check, tuple) and all(isinstance(t, type) for t in check)):
        return lambda obj: isinstance(obj, check)
    if callable(check):
        return check
    raise TypeError(f"a schema check is a type, a tuple of types or a predicate, not {check!r}")


# ---------------------------------------------------------------------- composition
class CompositeValidator(RecordValidator):
    """Several validators as one: sign in ascending priority, validate and strip in descending."""

    def __init__(self, validators: Iterable[RecordValidator] = ()):
        self.validators: list[RecordValidator] = []
        self.generation = 0  # moves with every validator added: verdicts remembered before are stale
        for validator in validators:
            self.add(validator)

    def add(self, validator: RecordValidator) -> None:
        if isinstance(validator, CompositeValidator):
            for inner in validator.validators:
                self.add(inner)
            return
        self.validators.append(validator)
        self.validators.sort(key=lambda v: v.priority)
        self.generation += 1

    def sign(self, record: DHTRecord) -> bytes:
        value = record.value
        for validator in self.validators:
            value = validator.sign(replace(record, value=value))
        return value

    def validate(self, record: DHTRecord) -> bool:
        return self.inner_if_valid(record) is not None

    def inner_if_valid(self, record: DHTRecord) -> bytes | None:
        """Validated and stripped from the outermost validator in: each sees what the one outside
        it stripped (None, if any refuses)."""
        value: bytes | None = record.value
        try:
            for validator in reversed(self.validators):
                if value is not record.value:
                    record = replace(record, value=value)
                value = validator.inner_if_valid(record)
                if value is None:
                    return None
        except RecordError:
            return None
        return value

    def strip(self, record: DHTRecord) -> bytes:
        value = record.value
        for validator in reversed(self.validators):
            value = validator.strip(replace(record, value=value))
        return value

    def max_ttl(self, record: DHTRecord) -> float | None:
        limits = [limit for v in self.validators if (limit := v.max_ttl(record)) is not None]
        return min(limits, default=None)
