"""Store and get: a record's replicas live on the k peers nearest to its key.

A store looks up the key's k nearest peers and sends each the record, pipelined: a peer that answers
while it is among the k nearest known gets the record at once instead of after the whole lookup; a
key looked up within the last minute goes straight to the holders that lookup found (``dht/holders.py``). A
get returns the local copy or looks the key up along disjoint paths (any one that finds it wins),
and with ``cache_on_path`` sends what it found to the nearest peer on the path that lacked it
(Kademlia's caching, section 2.3 of the paper).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import trio

from . import wire
from .background import Background
from .config import DHTConfig
from .contacts import Contacts
from .holders import HolderCache
from .local import LocalRecords, as_records
from .lookup_driver import LookupDriver
from .records import MAX_KEY_BYTES, MAX_VALUE_BYTES, DHTRecord, DHTValue, key_id, pack
from .routing import Contact
from .storage import merge_found

__all__ = ["Replicas", "StoreTally"]


class StoreTally:
    """The holders' answers to one store that waits for a majority: ``settled`` once more than
    half of those sent to accepted, or all answered (this node's own copy counts as one; so does a
    peer the lookup sent to before it found nearer ones). Sends are counted (``sent``) as they start
    and the tally is decided only once the caller has started them all (``all_sent``), so that
    a majority of the first few is not taken for one of all."""

    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.accepted = 0
        self.settled = trio.Event()
        self._all_sent = False
        # Holders that failed before the store knew the key's holders (its lookup still ran): the
        # store drops them once it has remembered the holders, as it does a plain store's.
        self.failed: list[Contact] = []
        self.holders_known = False

    def started(self, sends: int) -> None:
        self.sent += sends

    def answer(self, accepted: int, answered: int) -> None:
        self.accepted += accepted
        self.answered += answered
        self._decide()

    def all_sent(self) -> None:
        self._all_sent = True
        self._decide()

    def _decide(self) -> None:
        if self._all_sent and (2 * self.accepted > self.sent or self.answered >= self.sent):
            self.settled.set()


class Replicas:
    def __init__(
        self,
        lookups: LookupDriver,
        contacts: Contacts,
        records: LocalRecords,
        background: Background,
        *,
        node_id: int,
        config: DHTConfig,
        client_mode: bool,
    ):
        self.lookups = lookups
        self.contacts = contacts
        self.records = records
        self._background = background
        self.node_id = node_id
        self.config = config
        self.client_mode = client_mode  # a client keeps no records, not even its own
        self.holders = HolderCache()

    async def store(
        self, key: Any, value: Any, expiration_time: float, subkey: Any = None, *, majority: bool = False
    ) -> bool:
        """Store ``value`` under ``key`` (or under ``subkey`` of the dictionary at ``key``) on the k
        nearest peers until ``expiration_time`` (wall-clock seconds). True if at least one accepted.

        ``majority``: return once most of the holders accepted (or all answered), the sends to the
        rest carrying on in the node's background. A holder that left the swarm answers nothing,
        and a store that waits for every holder then takes the whole RPC timeout whenever one of
        the key's k holders has gone: with churn, a third of the stores of a busy key."""
        record = DHTRecord(pack(key), None if subkey is None else pack(subkey), pack(value), float(expiration_time))
        if len(record.key) > MAX_KEY_BYTES or len(record.subkey or b"") > MAX_KEY_BYTES:
            raise ValueError(f"keys and subkeys are limited to {MAX_KEY_BYTES} bytes")
        record = replace(record, value=self.records.validator.sign(record))
        if len(record.value) > MAX_VALUE_BYTES:
            raise ValueError(f"values are limited to {MAX_VALUE_BYTES} bytes (got {len(record.value)})")
        now = self.records.now()
        self.records.check_lifetime(record, now)  # other nodes would refuse it silently
        if record.expiration_time <= now:
            return False
        target = key_id(record.key)
        k = self.config.k
        outcomes: list[bool] = []
        unanswered: list[Contact] = []
        sent: set[bytes] = set()
        tally = StoreTally() if majority else None
        looked_up_at = trio.current_time()
        async with trio.open_nursery() as nursery:

            def send_to(contact: Contact) -> None:
                if contact.id in sent:
                    return
                sent.add(contact.id)
                if tally is None or not self._background.start_soon(self._send_tallied, contact, record, tally):
                    nursery.start_soon(self.send, contact, [record], outcomes, unanswered)
                else:
                    tally.started(1)

            nearest = self.holders.holders(target, looked_up_at)
            if nearest is not None:  # with the peers our table has met since that belong among them
                nearest = self.holders.admit(target, self.contacts.nearest(target, k), k)
            if nearest is None:
                # A peer later pushed out of the k nearest keeps an extra copy, as a path cache would.
                result = await self.lookups.run(
                    target,
                    on_answer=lambda contact, search: send_to(contact) if search.among_nearest(contact) else None,
                )
                nearest = result.nearest[:k]
                if not result.timed_out:
                    self.holders.remember(target, nearest, looked_up_at, k)
            for contact in nearest:
                send_to(contact)
            if not self.client_mode and (len(nearest) < k or self.node_id ^ target < nearest[-1].long_id ^ target):
                outcomes.append(self.records.store(record))
        if unanswered:
            self.holders.lost(target, unanswered)  # gone or refusing: the others still hold the key
        if tally is not None:
            tally.holders_known = True
            if tally.failed:
                self.holders.lost(target, tally.failed)
            tally.started(len(outcomes))  # (the sends that were not tallied, and our own copy)
            tally.answer(sum(outcomes), len(outcomes))
            tally.all_sent()
            await tally.settled.wait()
            return tally.accepted > 0
        return any(outcomes)

    async def _send_tallied(self, contact: Contact, record: DHTRecord, tally: StoreTally) -> None:
        """``send`` for a store that returns once a majority accepted: the holder's answer goes to
        ``tally``, and a holder that answered nothing, or kept nothing of it, is no longer
        remembered as one (once the store has remembered the key's holders)."""
        outcomes: list[bool] = []
        unanswered: list[Contact] = []
        try:
            await self.send(contact, [record], outcomes, unanswered)
        finally:
            tally.answer(any(outcomes), 1)
        if unanswered and tally.holders_known:
            self.holders.lost(key_id(record.key), unanswered)
        else:
            tally.failed.extend(unanswered)

    async def send(
        self, contact: Contact, records: list[DHTRecord], outcomes: list[bool], unanswered: list[Contact] | None = None
    ) -> None:
        """``dht.store`` ``records`` on ``contact`` in batches; one outcome per batch (False once one
        gets no answer, and the rest are not sent). ``contact`` goes on ``unanswered`` when a batch
        got no answer or none of it was accepted."""
        for start in range(0, len(records), wire.MAX_RECORDS_PER_STORE):
            batch = records[start : start + wire.MAX_RECORDS_PER_STORE]
            reply = await self.contacts.call(contact, "dht.store", [wire.encode_record(r) for r in batch])
            if reply is None or not isinstance(reply.body, list):
                outcomes.append(False)
                if unanswered is not None:
                    unanswered.append(contact)
                return
            accepted = any(result is True for result in reply.body)
            if not accepted and unanswered is not None:
                unanswered.append(contact)  # a holder that keeps nothing of ours is no holder to remember
            outcomes.append(accepted)

    def _many_holders(self) -> bool:
        """Whether the swarm is large enough for reads to draw a few of a key's holders."""
        return self.contacts.table.estimated_swarm_size() > self.config.draw_reads_above

    async def get(self, key: Any, latest: bool = False) -> DHTValue | None:
        """The value under ``key``: the first valid one found, or with ``latest`` the newest (merged
        across ``latest_read_holders`` of the k nearest peers, a random draw for each read, dealt
        among the disjoint paths, once the swarm is larger than ``draw_reads_above``; across all k
        in a smaller one). None if nobody holds a live value."""
        key_bytes = pack(key)
        if len(key_bytes) > MAX_KEY_BYTES:
            raise ValueError(f"keys are limited to {MAX_KEY_BYTES} bytes")
        local = None if self.client_mode else self.records.found(key_bytes)
        if local is not None and not latest:
            return self.records.decode(key_bytes, local)
        target = key_id(key_bytes)
        # (no holders remembered from here: the k nearest merged over disjoint paths include whatever a
        # poisoned path made up, and stores would then go to those alone)
        result = await self.lookups.run(
            target,
            key_bytes,
            stop_on_value=not latest,
            paths=self.config.disjoint_paths,
            quorum=self.config.latest_read_holders if latest and self._many_holders() else None,
        )
        found = merge_found(local, result.found)
        if found is None:
            return None
        if result.found is not None and self.config.cache_on_path and result.missing:
            nearest_missing = min(result.missing, key=lambda c: c.long_id ^ target)
            self._background.start_soon(self.send, nearest_missing, as_records(key_bytes, found), [])
        return self.records.decode(key_bytes, found)
