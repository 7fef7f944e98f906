"""Keeping a node's routing table filled: bootstrap from initial peers, refresh stale buckets, and
find the swarm again after a link outage.

Joining is BitTorrent's (BEP 5): reach a known peer and look up our own ID. The lookup's path
fills the table from the far ranges to the near one, and the swarm's traffic fills it further:
every contact our lookups meet enters it, and so does every peer that calls us (a node behind NAT
is a client nobody calls: its own lookups and the refreshes below fill its far ranges). A table
that knows little beyond its nearest nodes still reads the swarm's size from their spread
(``RoutingTable.estimated_swarm_size``).

The paper (section 2.3) also refreshes every bucket farther away than our closest neighbour at
once. In a simulated swarm (``benchmarks/scale.py``'s DHT row) that cost 3x more at 512 nodes (192
connections a node once joined against 65, 0.53 CPU-s a join against 0.15) and 6x more at 2,048
(1.63 CPU-s against 0.27), and found no more keys after 30% of the nodes left: every one, either
way. Without it, 5,000 nodes joined at 0.40 CPU-s a join and found every key.

Afterwards any bucket that for ``refresh_interval`` no lookup went to and no new contact entered
(``RoutingTable.stale_buckets``) gets a lookup of a random ID in its range, so a range the traffic
leaves quiet is looked up then; and contacts evicted for silence (and the initial peers, while the
table is empty) are pinged again until one answers (``reconnect.py``); then a lookup of our own ID
refills the table.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import trio

from peer import PeerAddress, PeerHost, RPCError
from peer.host import ConnectError

from .config import DHTBootstrapError, DHTConfig
from .contacts import Contacts
from .lookup_driver import LookupDriver
from .reconnect import PROBE_MIN, LostContacts
from .routing import Contact, RoutingTable

__all__ = ["TableMaintenance"]

# Bootstrap retries, 0.2 s doubling up to 2 s: peers of a swarm often start together, so an initial
# peer may not be listening yet when we first dial it.
RETRY_INITIAL, RETRY_MAX = 0.2, 2.0


class TableMaintenance:
    def __init__(
        self,
        host: PeerHost,
        table: RoutingTable,
        contacts: Contacts,
        lookups: LookupDriver,
        *,
        node_id: int,
        config: DHTConfig,
    ):
        self.host = host
        self.table = table
        self.contacts = contacts
        self.lookups = lookups
        self.node_id = node_id
        self.config = config
        self.initial_peers: list[PeerAddress] = []

    async def bootstrap(self, initial_peers: Sequence[PeerAddress], timeout: float) -> None:
        """Meet the initial peers (retrying until the deadline), then fill the routing table.
        A peer that refused every connection for ``config.refused_grace`` is given up, so a
        mistyped or stopped initial peer fails within that, not the whole ``timeout``."""
        self.initial_peers = list(initial_peers)
        reached: list[Contact] = []
        failures: dict[str, str] = {str(address): "no answer yet" for address in initial_peers}
        refusing: set[str] = set()  # given up: nothing listens there
        start = trio.current_time()

        async def reach(address: PeerAddress) -> None:
            delay = RETRY_INITIAL
            only_refused = True
            while True:
                try:
                    contact = await self._ping_address(address)
                except (OSError, RPCError) as error:
                    failures[str(address)] = str(error).removeprefix(f"{address}: ")
                    if reached or "mismatch" in str(error):
                        return
                    only_refused = only_refused and isinstance(error, ConnectError) and error.refused
                    if only_refused and trio.current_time() - start >= self.config.refused_grace:
                        refusing.add(str(address))
                        return
                else:
                    reached.append(contact)
                    return
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)

        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for address in initial_peers:
                    nursery.start_soon(reach, address)
        if not reached:
            lines = "\n".join(f"  {address}: {reason}" for address, reason in failures.items())
            if len(refusing) == len(failures):
                raise DHTBootstrapError(
                    f"no initial DHT peer accepted a connection for {self.config.refused_grace:g} s"
                    f" (is it running, at that port?):\n{lines}"
                )
            raise DHTBootstrapError(f"could not reach any initial DHT peer within {timeout:g} s:\n{lines}")
        await self.lookups.run(self.node_id)

    async def _ping_address(self, address: PeerAddress, follow_relay: bool = True) -> Contact:
        """Reach the peer at ``address`` and add it to the table; a peer behind NAT (an initial peer
        on the same LAN, say) stands for its relay, which is added instead. Not ``contacts.call``:
        the address may not name a peer ID, and the connection's handshake is what tells us whom
        we reached."""
        if address.relay is not None:  # (a peer behind NAT by its relayed address: its relay at once)
            address = address.relay_address
            follow_relay = False
        if address.peer_id == self.host.peer_id:
            raise ConnectError(f"{address}: that is this peer")
        connection = await self.host.connect(address)
        await connection.call("dht.ping", timeout=self.config.rpc_timeout)
        announced = connection.remote_listen_address
        if announced is not None and announced.relay is not None:
            # behind NAT: a client of the DHT (``contacts.py``); its relay is public, and a server
            if not follow_relay:
                raise ConnectError(f"{address}: a relay that is itself reached through a relay")
            return await self._ping_address(announced.relay_address, follow_relay=False)
        contact = Contact(self.host.remote_node_id(connection), address)
        self.contacts.alive(contact)
        return contact

    async def refresh_forever(self) -> None:
        while True:
            await trio.sleep(self.config.refresh_check_period)
            for bucket in self.table.stale_buckets(self.config.refresh_interval):
                await self.lookups.run(random.randint(*bucket.range))

    async def reconnect_forever(self) -> None:
        """Ping lost contacts when they are due (and the initial peers while the table is empty);
        after any of them answers, look up our own ID through it to refill the table."""
        clock = self.contacts.health.clock
        initial: LostContacts[PeerAddress] = LostContacts(give_up_after=math.inf)
        while True:
            await trio.sleep(PROBE_MIN)
            await self._until_due(initial, clock)
            now = clock()
            if len(self.table) == 0:
                for address in self.initial_peers:
                    initial.lost(str(address), address, now)
            else:
                initial = LostContacts(give_up_after=math.inf)
            contacts, addresses = self.contacts.lost.due(now), initial.due(now)
            if not contacts and not addresses:
                continue
            if await self._reached_any(contacts, addresses):
                await self.lookups.run(self.node_id)

    async def _until_due(self, initial: LostContacts[PeerAddress], clock: Callable[[], float]) -> None:
        """Wait until a lost contact or initial peer is due, or a contact is evicted (which may
        also empty the table): a node that lost nobody sleeps rather than look every PROBE_MIN for
        nothing (in one simulation of N nodes, looking costs N wake-ups a simulated second)."""
        if len(self.table) == 0:
            return
        evicted = self.contacts.next_eviction()
        due = [at for at in (self.contacts.lost.next_due(), initial.next_due()) if at is not None]
        with trio.move_on_after(max(0.0, min(due) - clock()) if due else math.inf):
            await evicted.wait()

    async def _reached_any(self, contacts: list[Contact], addresses: list[PeerAddress]) -> bool:
        """Ping them all at once; whether any answered (each answer is back in the table)."""
        answered = []

        async def ping(contact: Contact) -> None:
            if await self.contacts.call(contact, "dht.ping", None) is not None:
                answered.append(contact)

        async def ping_address(address: PeerAddress) -> None:
            try:
                answered.append(await self._ping_address(address))
            except (OSError, RPCError):
                pass

        async with trio.open_nursery() as nursery:
            for contact in contacts:
                nursery.start_soon(ping, contact)
            for address in addresses:
                nursery.start_soon(ping_address, address)
        return bool(answered)
