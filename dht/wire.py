"""DHT message bodies: encoding, and strict parsing of everything that arrives from the network.

Requests and replies are checked field by field (types, sizes, counts, expirations); anything else
raises ``BadRequest`` on the serving side, or ``RecordError`` on the calling side, before any of it
touches storage or the routing table.

    dht.ping   body: None                              reply: None
    dht.find   body: [target(20 bytes), key | None(, known)]
                                                       reply: body [[peer_id, host, port, nonce], ...],
                                                              payload msgpack(found) or empty
    dht.store  body: [[key, subkey|None, value, expiration], ...]   reply: [accepted: bool, ...]

``found`` is ``[0, value, expiration]`` for a plain value, ``[1, [[subkey, value, expiration], ...]]``
for a dictionary. ``known`` (optional) is the ``entry_digest``s of the dictionary entries the asker
already holds, concatenated: the holder leaves those out of its answer (``[1, []]`` when it holds
nothing newer). A lookup of a dictionary asks about k holders, each of which holds nearly the same
entries: without it a read of a key with n entries moved and checked k * n of them.

A contact's ``nonce`` is its node-ID puzzle solution: a contact whose nonce does not solve the puzzle
for its peer ID at the run's difficulty is dropped, like any malformed entry. A contact behind a
relay has ``RELAY_HOST/RELAY_ID`` as its host and the relay's port.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from peer import BadRequest, NodeIDProof, PeerAddress, PeerID
from peer.node_id import NONCE_BYTES

from .records import MAX_KEY_BYTES, MAX_VALUE_BYTES, DHTRecord, RecordError, check_expiration, pack, unpack
from .routing import Contact
from .storage import MAX_SUBKEYS, Found, StoredValue

__all__ = [
    "MAX_RECORDS_PER_STORE",
    "MAX_CONTACTS_PER_REPLY",
    "parse_find_request",
    "parse_store_request",
    "encode_contacts",
    "parse_contacts",
    "contact_for",
    "encode_found",
    "entry_digest",
    "known_entries",
    "parse_found",
]

# One store request stays far below the RPC layer's 1 MiB header limit even with maximal values.
MAX_RECORDS_PER_STORE = 12
# A reply names at most k contacts; a little slack for a peer configured with a larger k.
MAX_CONTACTS_PER_REPLY = 64
# Reply payload: MAX_SUBKEYS records of maximal size plus framing.
MAX_FOUND_BYTES = 256 * (MAX_VALUE_BYTES + 2 * MAX_KEY_BYTES + 64)
_MAX_HOST = 255
# An entry's digest in a find's ``known``: a collision would only hide an entry from the asker that
# wrote it, since owner-signed subkeys are each their owner's alone.
ENTRY_DIGEST_BYTES = 8
# Contacts named in replies repeat constantly; reusing their objects skips re-deriving the peer ID
# text, integer ID and proof hashes on every reply. Bounded: cleared when full. Keyed by the nonce
# too, and the proof's work is compared with the difficulty on every use, so nodes of different
# runs in one process share it safely.
_CONTACT_CACHE: dict[tuple[bytes, str, int, bytes], Contact] = {}
_CONTACT_CACHE_SIZE = 100_000


def _bytes_field(value: Any, limit: int, name: str) -> bytes:
    if not isinstance(value, bytes):
        raise BadRequest(f"{name} must be bytes, got {type(value).__name__}")
    if not 0 < len(value) <= limit:
        raise BadRequest(f"{name} of {len(value)} bytes is outside 1..{limit}")
    return value


def _check_encoded(data: bytes, name: str) -> None:
    try:
        unpack(data, max_size=max(MAX_KEY_BYTES, MAX_VALUE_BYTES))
    except RecordError as error:
        raise BadRequest(f"{name}: {error}") from None


def parse_find_request(body: Any) -> tuple[int, bytes | None, frozenset[bytes]]:
    """``(target, key or None, the digests of the entries the asker already holds)``."""
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise BadRequest("dht.find takes [target, key or None, known entries (optional)]")
    target = body[0]
    if not isinstance(target, bytes) or len(target) != 20:
        raise BadRequest("target must be 20 bytes")
    key = None if body[1] is None else _bytes_field(body[1], MAX_KEY_BYTES, "key")
    known: frozenset[bytes] = frozenset()
    if len(body) == 3:
        raw = body[2]
        if not isinstance(raw, bytes) or len(raw) % ENTRY_DIGEST_BYTES or len(raw) > MAX_SUBKEYS * ENTRY_DIGEST_BYTES:
            raise BadRequest(f"known entries are at most {MAX_SUBKEYS} digests of {ENTRY_DIGEST_BYTES} bytes")
        known = frozenset(raw[i : i + ENTRY_DIGEST_BYTES] for i in range(0, len(raw), ENTRY_DIGEST_BYTES))
    return int.from_bytes(target, "big"), key, known


def parse_store_request(body: Any, now: float) -> list[DHTRecord]:
    if not isinstance(body, list) or not 0 < len(body) <= MAX_RECORDS_PER_STORE:
        raise BadRequest(f"dht.store takes a list of 1..{MAX_RECORDS_PER_STORE} records")
    records = []
    for item in body:
        if not isinstance(item, list) or len(item) != 4:
            raise BadRequest("a record is [key, subkey or None, value, expiration]")
        key = _bytes_field(item[0], MAX_KEY_BYTES, "key")
        subkey = None if item[1] is None else _bytes_field(item[1], MAX_KEY_BYTES, "subkey")
        value = _bytes_field(item[2], MAX_VALUE_BYTES, "value")
        try:
            expiration = check_expiration(item[3], now)
        except RecordError as error:
            raise BadRequest(str(error)) from None
        _check_encoded(key, "key")
        if subkey is not None:
            _check_encoded(subkey, "subkey")
        _check_encoded(value, "value")
        records.append(DHTRecord(key, subkey, value, expiration))
    return records


def encode_record(record: DHTRecord) -> list:
    return [record.key, record.subkey, record.value, record.expiration_time]


# ---------------------------------------------------------------------- contacts
def encode_contacts(contacts: list[Contact]) -> list:
    return [contact.wire_entry for contact in contacts]


def parse_contacts(body: Any, difficulty: int) -> list[Contact]:
    """Contacts from a find reply; malformed entries, those whose node-ID proof falls short of
    ``difficulty`` and those reached through a relay (peers behind NAT are clients of the DHT:
    ``contacts.py``) are skipped (a lie costs the liar its contacts, never us an error); too many is
    an error. One endpoint is one peer: a contact at an endpoint the reply already named is
    skipped, so a reply costs at most one dial per endpoint it names."""
    if not isinstance(body, list) or len(body) > MAX_CONTACTS_PER_REPLY:
        raise RecordError("a find reply is a list of at most 64 contacts")
    contacts = []
    endpoints: set[tuple[str, int]] = set()
    for item in body:
        if (
            isinstance(item, list)
            and len(item) == 4
            and isinstance(item[0], bytes)
            and len(item[0]) == 20
            and isinstance(item[1], str)
            and 0 < len(item[1]) <= _MAX_HOST
            and isinstance(item[2], int)
            and not isinstance(item[2], bool)
            and 0 < item[2] < 65536
            and isinstance(item[3], bytes)
            and len(item[3]) == NONCE_BYTES
        ):
            cache_key = (item[0], item[1], item[2], item[3])
            contact = _CONTACT_CACHE.get(cache_key)
            if contact is None:
                if len(_CONTACT_CACHE) >= _CONTACT_CACHE_SIZE:
                    _CONTACT_CACHE.clear()
                peer_id = PeerID(item[0])
                proof = NodeIDProof(peer_id, item[3])
                host, _, relay_text = item[1].partition("/")
                try:
                    relay = PeerID.from_string(relay_text) if relay_text else None
                except ValueError:
                    continue
                contact = _CONTACT_CACHE[cache_key] = Contact(proof, PeerAddress(host, item[2], peer_id, relay))
            if contact.proof.satisfies(difficulty) and contact.address.relay is None:
                endpoint = (contact.address.host, contact.address.port)
                if endpoint in endpoints:
                    continue
                endpoints.add(endpoint)
                contacts.append(contact)
    return contacts


def contact_for(proof: NodeIDProof, address: PeerAddress) -> Contact:
    """The contact of ``proof`` at ``address`` (a peer's own hello), from the same cache as the
    contacts replies name: every request to or from a peer would otherwise build it anew. The
    caller checks the proof against the difficulty, as for any contact."""
    host = address.host if address.relay is None else f"{address.host}/{address.relay}"
    cache_key = (proof.peer_id.to_bytes(), host, address.port, proof.nonce)
    contact = _CONTACT_CACHE.get(cache_key)
    if contact is None:
        if len(_CONTACT_CACHE) >= _CONTACT_CACHE_SIZE:
            _CONTACT_CACHE.clear()
        contact = _CONTACT_CACHE[cache_key] = Contact(proof, address)
    return contact


# ---------------------------------------------------------------------- found values
def entry_digest(subkey: bytes, item: StoredValue) -> bytes:
    """What identifies one dictionary entry as held: its subkey, value and expiration."""
    digest = hashlib.blake2b(digest_size=ENTRY_DIGEST_BYTES, person=b"peerd-dht-entry")
    digest.update(struct.pack(">Id", len(subkey), item.expiration_time))
    digest.update(subkey)
    digest.update(item.value)
    return digest.digest()


def known_entries(found: Found | None) -> bytes:
    """A find's ``known`` for what the asker holds of a dictionary (b"" for anything else)."""
    if not isinstance(found, dict):
        return b""
    return b"".join(entry_digest(subkey, item) for subkey, item in list(found.items())[:MAX_SUBKEYS])


def encode_found(found: Found, known: frozenset[bytes] = frozenset()) -> bytes:
    """A find's payload: ``found``, without the dictionary entries the asker holds already."""
    if isinstance(found, StoredValue):
        return pack([0, found.value, found.expiration_time])
    entries = [
        [subkey, item.value, item.expiration_time]
        for subkey, item in found.items()
        if not known or entry_digest(subkey, item) not in known
    ]
    return pack([1, entries])


def parse_found(key: bytes, payload: bytes, now: float) -> list[DHTRecord]:
    """Records from a find reply's payload (unvalidated: the caller runs its validators)."""
    if not payload:
        return []
    decoded = unpack(bytes(payload), max_size=MAX_FOUND_BYTES)
    if not isinstance(decoded, list) or len(decoded) not in (2, 3) or decoded[0] not in (0, 1):
        raise RecordError("malformed found value")
    if decoded[0] == 0:
        entries = [[None, *decoded[1:]]]
    else:
        entries = decoded[1]
        if not isinstance(entries, list):
            raise RecordError("malformed dictionary value")
    records = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 3:
            raise RecordError("malformed record")
        subkey, value, expiration = entry
        if subkey is not None and not (isinstance(subkey, bytes) and 0 < len(subkey) <= MAX_KEY_BYTES):
            raise RecordError("malformed subkey")
        if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
            raise RecordError("malformed value")
        expiration = check_expiration(expiration, now)
        if expiration > now:
            records.append(DHTRecord(key, subkey, value, expiration))
    return records
