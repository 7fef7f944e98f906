"""State sharing: a newcomer downloads tensors and metadata from a peer that already has them.

Donors announce themselves in the DHT (subkey = the donor's owner-signed ``peer_subkey``, value =
its own address and the version of its state) after their averaging rounds, under one of
``DONOR_SHARDS`` keys ``{prefix}.state_donors.{i}`` picked by a hash of the donor's peer ID
(``donor_shard``). One key for the whole swarm would put every donor's store on its k holders and
hand every newcomer every donor's offer: O(N) both, the hottest key of a large swarm. A newcomer
reads shards in a random order, a few at a time, until it holds ``DONORS_WANTED`` offers (in a
small swarm: all of them), orders them newest version first, and tries equals in random order:
random, so that a wave of newcomers spreads over all donors instead of all hitting the first one.
A donor stores its offer after its first round, then once a third of its lifetime has passed, not
after every round, and off the round's path (``announce_soon``: in a task of the host's, so that no
caller's step waits on the DHT): the offer stays listed through a failed refresh
(``DonorAnnouncer``). A newcomer that finds no offer yet (a swarm's first offers may still be on
their way) reads again, less often each time, until its deadline.

The transfer is one stream: a header (metadata and the tensors' wire headers), then one message per
tensor with its raw bytes. The newcomer validates every header against the tensors it expects, so
a donor cannot make it allocate or load anything of another shape, then checks the values and
compares them with a second donor's sample (``state_checks.py``) before anything is loaded; a
donor whose state fails is skipped and the next one tried. A witness's sample comes on a second
stream method: the newcomer names the tensors it wants, the donor sends those the same way.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import trio

from dht.peer_dictionary import peer_entries, peer_subkey
from peer import Busy, ConnectError, NodeIDProof, PeerAddress, PeerHost, PeerID, RPCError
from peer.tensors import tensor_from_wire, tensor_to_wire
from peer.worker_threads import run_blocking

from .cells import bucket_of
from .group import is_counter
from .state_checks import DONOR_AGREEMENT, WITNESS_SHARE, check_state, disagreement, sample_indices

__all__ = [
    "DONOR_SHARDS",
    "DonorAnnouncer",
    "DonorOffer",
    "StateOwner",
    "StateSharing",
    "StateUnavailable",
    "donor_shard",
]

log = logging.getLogger("peerd.averaging")

# A donor that has not averaged for this long is probably gone; the announcement expires with it.
DONOR_TTL = 180.0
# A donor stores its offer again once this much of its lifetime has passed (or when its address
# changed), at the end of its first averaging round past that. Every peer is a donor, and a store
# costs a lookup and k stores: refreshing every 30 s is up to a fifth of a peer's DHT requests a
# round in the simulated swarm. A minute apart, an offer outlives a refresh that fails (or a round
# that fails before it) as long as rounds end within a minute of each other.
DONOR_REFRESH = DONOR_TTL / 3
# Offers are spread over this many keys. Sixteen shards of a 1,000-peer swarm hold ~60 offers each;
# a swarm of a few peers leaves most shards empty, and a newcomer then reads them all.
DONOR_SHARDS = 16
# A newcomer reads this many shards, then twice as many more at a time, until it holds DONORS_WANTED
# offers: enough to find the newest state, a witness that agrees with it and fallbacks for donors
# that are busy or gone. A swarm of few donors is read whole in three waves of reads.
SHARDS_PER_READ = 4
DONORS_WANTED = 8
# A newcomer that finds no offer reads the shards again after this long, then twice as long each time.
DONOR_RETRY_S = 1.0
MAX_TENSORS = 10_000
# Each download being served pins a full copy of the state until it is sent. A newcomer needs one
# download at a time; a few donors' worth in total keeps a popular donor's memory bounded.
MAX_SERVES_PER_PEER = 1
MAX_SERVES = 4
# A serve that has not finished by then is dropped with its copy: a reader that stops reading must
# not pin it. Ten minutes moves several GB even over a 100 Mbit/s link.
SERVE_DEADLINE = 600.0
# A candidate's state is compared with at most this many witnesses, each a download: it is taken
# once one agrees, and given up on when every witness that answered disagrees (even one: with one
# honest and one lying donor and nobody to break the tie, a newcomer loads neither and trains on
# from its own parameters at the swarm's epoch, which the next parameter averaging pulls in).
MAX_WITNESSES = 2
# A witness that has not sent its sample by then (cut off, or behind a dead pooled connection) is
# passed over: its sample is an eighth of the state, a few seconds at most on a volunteer's link for
# the models that train on CPUs, and a newcomer must not spend its whole download deadline on it.
WITNESS_TIMEOUT = 5.0


class StateUnavailable(RuntimeError):
    """No donor could send state before the deadline."""


class StateOwner(Protocol):
    """What a donor serves from: its tensors, held still while they are copied, and the metadata
    a newcomer learns with them. The version it announces is passed to ``announce``."""

    def locked_tensors(self) -> AbstractAsyncContextManager[Sequence[torch.Tensor]]: ...

    def state_metadata(self) -> Any: ...


@dataclass(frozen=True)
class DonorOffer:
    """One donor's announcement: where to download from, the version of its state, and its DHT
    node ID (proved by the offer's node-ID nonce: it places the offer in its shard)."""

    address: PeerAddress
    version: int
    node_id: bytes = b""

    @classmethod
    def from_wire(cls, peer: PeerID, body: Any, difficulty: int) -> DonorOffer:
        """Raises ValueError, TypeError or KeyError unless ``body`` is an offer made by ``peer``
        with its node-ID proof at the run's ``difficulty``."""
        address, version = PeerAddress.parse(body["address"]), body["version"]
        if address.peer_id != peer or not is_counter(version):
            raise ValueError("a donor offers its own address and an integer version")
        return cls(address, version, NodeIDProof.claimed(peer, body.get("nonce"), difficulty).node_id)


def donor_shard(node_id: bytes) -> int:
    """The shard a donor with DHT node ID ``node_id`` offers its state under. The node ID is the
    outcome of the donor's puzzle (``peer/node_id.py``), not of its free signing key: landing many
    identities in one shard, to be most of what a newcomer reads there, costs the puzzle times
    the shard count each; a reader drops an offer found in a shard that is not its owner's."""
    return bucket_of(node_id, DONOR_SHARDS, b"peerd-donors")


class DonorAnnouncer:
    """When a donor's offer needs storing again: at the first announcement, once ``refresh``
    seconds have passed since the last one that was stored, or when the address changed. Sans I/O:
    the caller stores, then calls ``stored``."""

    def __init__(self, refresh: float = DONOR_REFRESH):
        self.refresh = refresh
        self._last: tuple[float, str] | None = None  # (when, address) of the last stored offer

    def due(self, now: float, address: str) -> bool:
        return self._last is None or self._last[1] != address or now - self._last[0] >= self.refresh

    def stored(self, now: float, address: str) -> None:
        self._last = (now, address)


class StateSharing:
    def __init__(
        self,
        host: PeerHost,
        dht,
        prefix: str,
        owner: StateOwner,
        *,
        replicated: int | None = None,
        donor_refresh: float = DONOR_REFRESH,
    ):
        """``replicated``: how many of the owner's leading tensors honest replicas hold alike, the
        only ones a witness's sample is compared on (None: all). ``donor_refresh``: the seconds
        between stores of our offer (0: every announcement is stored)."""
        if replicated is not None and replicated < 0:
            raise ValueError(f"replicated must be a count of tensors, got {replicated}")
        self.replicated = replicated
        self.host = host
        self.dht = dht
        self.prefix = prefix
        self.owner = owner
        self.method = f"avg.state.{prefix}"
        self.sample_method = f"avg.state_sample.{prefix}"
        self._serving: dict[PeerID, int] = {}
        self._rng = random.Random()
        self._announcer = DonorAnnouncer(donor_refresh)
        self._announcing = False  # a store of our offer is on its way (one at a time)
        host.router.add_stream(self.method, self._serve_state)
        host.router.add_stream(self.sample_method, self._serve_sample)

    def key(self, shard: int) -> str:
        return f"{self.prefix}.state_donors.{shard}"

    def announce_soon(self, version: int) -> None:
        """Offer our state at ``version`` in a task of the host's, if our offer is due and none is
        being stored. A store is a lookup and k stores: a peer whose offer fell due would return
        from its round that much later than the others and start its next matchmaking after them
        (in the simulated swarm of 24 such a peer can find nobody left to group with)."""
        if self._announcing or self._offer_due() is None:
            return
        self._announcing = True
        try:
            self.host.start_soon(self._announce_in_background, version)
        except RuntimeError:  # the host is closing: no more offers
            self._announcing = False

    async def _announce_in_background(self, version: int) -> None:
        try:
            await self._store_offer(version)
        except Exception as error:  # (a store reports failure as False: this would be ours)
            log.warning("storing our donor offer failed: %r", error)
        finally:
            self._announcing = False

    async def announce(self, version: int) -> None:
        """Offer our state at ``version``, if our offer is due for storing again (``DonorAnnouncer``)
        and no store of it is on its way."""
        if self._announcing:
            return
        self._announcing = True
        try:
            await self._store_offer(version)
        finally:
            self._announcing = False

    def _offer_due(self) -> tuple[PeerAddress, float] | None:
        """Our address and the time, if our offer is due for storing again (``DonorAnnouncer``)."""
        address = self.host.public_address
        if address is None:
            return None  # client-mode peers cannot be dialed, so they cannot donate
        now = self.dht.clock.time()
        return (address, now) if self._announcer.due(now, str(address)) else None

    async def _store_offer(self, version: int) -> None:
        due = self._offer_due()
        if due is None:
            return
        address, now = due
        value = {"address": str(address), "version": int(version), "nonce": self.host.node_id.nonce}
        subkey = peer_subkey(self.dht.host.identity.public_key)
        if await self.dht.store(
            self.key(donor_shard(self.host.node_id.node_id)), value, now + DONOR_TTL, subkey=subkey
        ):
            self._announcer.stored(now, str(address))

    async def _serve_state(self, stream) -> None:
        await self._serve(stream, None)

    async def _serve_sample(self, stream) -> None:
        """A witness's part: the tensors a newcomer names, to compare with another donor's."""
        request = (await stream.receive()).body
        wanted = request.get("tensors") if isinstance(request, dict) else None
        if not (isinstance(wanted, list) and 0 < len(wanted) <= MAX_TENSORS and all(type(i) is int for i in wanted)):
            raise ValueError("a sample request names a list of tensor indices")
        await self._serve(stream, sorted(set(wanted)))

    async def _serve(self, stream, only: list[int] | None) -> None:
        peer = stream.peer
        if self._serving.get(peer, 0) >= MAX_SERVES_PER_PEER or sum(self._serving.values()) >= MAX_SERVES:
            raise Busy("this donor is serving as many state downloads as it can; try another donor")
        self._serving[peer] = self._serving.get(peer, 0) + 1
        try:
            with trio.move_on_after(SERVE_DEADLINE):
                await self._send_state(stream, only)
        finally:
            self._serving[peer] -= 1
            if not self._serving[peer]:
                del self._serving[peer]

    async def _send_state(self, stream, only: list[int] | None = None) -> None:
        async with self.owner.locked_tensors() as tensors:
            if only is not None:
                if only[-1] >= len(tensors) or only[0] < 0:
                    raise ValueError(f"this donor has {len(tensors)} tensors")
                # A witness's sample is a small share, not a second way to copy the whole state:
                # at most twice what sample_indices asks for, or the largest single tensor.
                sizes = [t.numel() for t in tensors]
                limit = max(2 * WITNESS_SHARE * sum(sizes), max(sizes))
                if sum(sizes[i] for i in only) > limit:
                    raise ValueError("a sample request may name about an eighth of the state, not more")
                tensors = [tensors[i] for i in only]
            # Copy under the lock (in a thread: may be large) so a concurrent round cannot tear it.
            snapshot = await run_blocking(lambda: [t.detach().to("cpu", copy=True) for t in tensors])
            metadata = self.owner.state_metadata()
        wires = [tensor_to_wire(t) for t in snapshot]
        await stream.send({"metadata": metadata, "tensors": [header for header, _ in wires]})
        for _, payload in wires:
            await stream.send(None, payload)

    async def donors(self) -> list[PeerAddress]:
        """Donors' addresses, best first, from as few shards as hold ``DONORS_WANTED`` offers."""
        shards = list(range(DONOR_SHARDS))
        self._rng.shuffle(shards)
        offers: dict[PeerID, DonorOffer] = {}
        parse = functools.partial(DonorOffer.from_wire, difficulty=self.host.node_id_difficulty)

        async def read(shard: int) -> None:
            found = await self.dht.get(self.key(shard), latest=True)
            for peer, offer in peer_entries(found, parse, now=self.dht.clock.time()):
                if peer != self.host.peer_id and donor_shard(offer.node_id) == shard:
                    offers[peer] = offer

        start, wave = 0, SHARDS_PER_READ
        while start < DONOR_SHARDS and len(offers) < DONORS_WANTED:
            async with trio.open_nursery() as nursery:
                for shard in shards[start : start + wave]:
                    nursery.start_soon(read, shard)
            start, wave = start + wave, 2 * wave  # (a small swarm reads all shards in three waves)
        return [offer.address for offer in self.order_donors(list(offers.values()))]

    @staticmethod
    def order_donors(offers: list[DonorOffer]) -> list[DonorOffer]:
        """Newest state first, load spread randomly among equals; older donors remain as fallbacks,
        so one offer claiming a huge version cannot leave a newcomer with no one else to try."""
        offers = list(offers)
        random.shuffle(offers)
        offers.sort(key=lambda offer: offer.version, reverse=True)
        return offers

    async def download(self, expected: Sequence[torch.Tensor], timeout: float) -> tuple[Any, list[torch.Tensor]]:
        """Metadata and tensors from some donor whose state passes the checks; raises
        StateUnavailable after ``timeout`` or when every donor failed them."""
        reasons: list[str] = []
        with trio.move_on_after(timeout):
            donors, pause = await self.donors(), DONOR_RETRY_S
            while not donors:
                await trio.sleep(pause)
                donors, pause = await self.donors(), 2 * pause
            for address in donors:
                try:
                    metadata, tensors = await self._download_from(address, expected, timeout)
                    await run_blocking(check_state, tensors, expected)
                    await self._witnessed(address, donors, tensors, expected, timeout)
                    return metadata, tensors
                except (RPCError, ConnectError, ValueError, trio.EndOfChannel) as error:
                    reasons.append(f"{address.peer_id}: {error}")
                    log.info("state from %s refused or failed: %s", address.peer_id, error)
        detail = "; ".join(reasons) if reasons else "no donor announced itself"
        raise StateUnavailable(f"could not load state from peers within {timeout:g} s ({detail})")

    async def _witnessed(
        self,
        donor: PeerAddress,
        donors: list[PeerAddress],
        tensors: list[torch.Tensor],
        expected: Sequence[torch.Tensor],
        timeout: float,
    ) -> None:
        """Compare a sample of ``tensors`` with other donors' until one agrees; raises ValueError
        if the witnesses that answered all disagree (none answering leaves nothing to compare)."""
        shared = tensors if self.replicated is None else tensors[: self.replicated]
        if not shared:
            return  # nothing that honest replicas hold alike: nothing to compare
        witnesses = [address for address in donors if address.peer_id != donor.peer_id]
        self._rng.shuffle(witnesses)
        disagreed: list[str] = []
        agreed = False

        async def ask(witness: PeerAddress, indices: list[int], scope: trio.CancelScope) -> None:
            # the witnesses are asked at once: one cut off or busy costs its deadline, not the sum
            nonlocal agreed
            try:
                with trio.fail_after(min(timeout, WITNESS_TIMEOUT)):
                    _, sample = await self._download_from(witness, [expected[i] for i in indices], timeout, indices)
            except (RPCError, ConnectError, ValueError, trio.EndOfChannel, trio.TooSlowError) as error:
                log.info("witness %s could not send a sample: %s", witness.peer_id, error or "no answer in time")
                return
            distance = await run_blocking(disagreement, [tensors[i] for i in indices], sample)
            if distance <= DONOR_AGREEMENT:
                agreed = True
                scope.cancel()
            else:
                disagreed.append(f"{witness.peer_id} ({distance:.2f})")

        async with trio.open_nursery() as nursery:
            for witness in witnesses[:MAX_WITNESSES]:
                indices = sample_indices([t.numel() for t in shared], self._rng)
                nursery.start_soon(ask, witness, indices, nursery.cancel_scope)
        if disagreed and not agreed:
            raise ValueError(f"its state disagrees with other donors': {', '.join(disagreed)}")

    async def _download_from(
        self,
        address: PeerAddress,
        expected: Sequence[torch.Tensor],
        timeout: float,
        only: list[int] | None = None,
    ) -> tuple[Any, list[torch.Tensor]]:
        connection = await self.host.connect(address)
        method = self.method if only is None else self.sample_method
        # A tensor message holds one of the tensors we expect, so the largest of them is the most
        # we accept: a donor cannot make us hold more per message than our own state needs.
        largest = max((t.numel() * t.element_size() for t in expected), default=0)
        async with connection.stream(method, timeout=timeout, max_message=largest) as stream:
            if only is not None:
                await stream.send({"tensors": only})
            header = (await stream.receive()).body
            if not (isinstance(header, dict) and isinstance(header.get("tensors"), list)):
                raise ValueError("malformed state header")
            headers = header["tensors"]
            if len(headers) != len(expected) or len(headers) > MAX_TENSORS:
                raise ValueError(f"donor sent {len(headers)} tensors, expected {len(expected)}")
            tensors = []
            for wire_header, template in zip(headers, expected, strict=True):
                payload = (await stream.receive()).payload
                tensor = tensor_from_wire(wire_header, payload, max_numel=template.numel())
                if tensor.shape != template.shape or tensor.dtype != template.dtype:
                    raise ValueError(f"donor tensor {tuple(tensor.shape)} {tensor.dtype} does not match ours")
                tensors.append(tensor)
            return header.get("metadata"), tensors
