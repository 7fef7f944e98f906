"""How long each kind of record may live: a cap per key namespace, below the global ``MAX_TTL``.

A record that outlives its purpose is a liability: an attacker who may write one for a day can
squat on it for a day. So a namespace declares the longest lifetime its records need (``TTLCap``,
a validator), and every node refuses a store whose expiration lies further ahead than that (plus
``CLOCK_SKEW``), and drops such records from answers.

Refused, not clipped: the expiration of a signed record is covered by its owner's signature, so a
node that shortened it would hold a record that no longer verifies. A writer asking for more than
its namespace allows has a bug, and ``DHTNode.store`` raises ``ValueError`` to say so.

The swarm's own record types are capped here, on every node, whatever validators an application
adds: a bootstrap node that never trains must refuse a day-long progress record as firmly as a
trainer does. The patterns name the keys the upper layers write (imports only go downward, so the
numbers are restated; ``tests/dht/test_dht_storage.py`` checks each caller's TTL fits its cap).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .records import DHTRecord, RecordError, unpack
from .validation import RecordValidator

__all__ = ["TTLCap", "DEFAULT_TTL_CAPS", "key_ttl_cap"]


class TTLCap(RecordValidator):
    """Records under string keys that match ``pattern`` (``re.search``) live at most ``limit`` seconds."""

    def __init__(self, pattern: str, limit: float):
        if not limit > 0:
            raise ValueError("a TTL cap is a positive number of seconds")
        self.pattern = re.compile(pattern)
        self.limit = float(limit)

    def max_ttl(self, record: DHTRecord) -> float | None:
        try:
            key = unpack(record.key)
        except RecordError:
            return None
        if isinstance(key, str) and self.pattern.search(key):
            return self.limit
        return None

    def __repr__(self) -> str:
        return f"TTLCap({self.pattern.pattern!r}, {self.limit:g})"


def key_ttl_cap(key: bytes, caps: Iterable[TTLCap]) -> float | None:
    """The smallest limit of ``caps`` that applies to records under ``key`` (None: none does);
    what ``CompositeValidator(caps).max_ttl`` gives, with the key decoded once instead of per cap."""
    try:
        decoded = unpack(key)
    except RecordError:
        return None
    if not isinstance(decoded, str):
        return None
    return min((cap.limit for cap in caps if cap.pattern.search(decoded)), default=None)


DEFAULT_TTL_CAPS: tuple[TTLCap, ...] = (
    # "{prefix}.progress" and its cells: averaging.progress.PROGRESS_TTL is 15 s, refreshed at least
    # every second while training; four times that leaves slack and clears a dead peer within a minute.
    TTLCap(r"\.progress(\.cells\d+\.\d+)?$", 60.0),
    # "{prefix}.matchmaking": declarations live for the matchmaking timeout plus 1 s (3-5 s by
    # default); a round that waits longer than five minutes for its group has failed anyway.
    TTLCap(r"\.matchmaking$", 300.0),
    # "{prefix}.state_donors.{shard}": averaging.state_sharing.DONOR_TTL is 180 s; 5 minutes admits
    # a longer lifetime, not much more (an offer outlives its donor by its lifetime).
    TTLCap(r"\.state_donors\.\d+$", 300.0),
    # Expert grid keys end with the UID delimiter ("ffn.", "ffn.3."): heartbeats live
    # max(moe.announce.HEARTBEAT_TTL = 45 s, 3 x heartbeat period); 10 minutes admits periods up to
    # 200 s, far slower than the 15 s default.
    TTLCap(r"\.$", 600.0),
)
