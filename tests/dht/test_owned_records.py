"""Records about a peer are that peer's alone, through real DHT nodes on 127.0.0.1.

For each per-peer record type (progress, matchmaking declaration, state donor offer, expert
announcement) an attacker identity sends stores by hand, as a hostile peer would, to every full
node: under the owner's marked subkey (with a day-long and with a short expiration, signed with the
attacker's key or not at all) and under the owner's plain peer ID (the layout readers used before).
Every node refuses the first kind; the second may be stored but no reader looks at it. The owner's
later short-lived re-store then wins everywhere, and readers see only the owner's records.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import trio

from averaging.group import AveragingMode
from averaging.matchmaking import Declaration, Matchmaker
from averaging.progress import PeerProgress, ProgressTracker
from averaging.state_sharing import DonorOffer, StateSharing, donor_shard
from dht.node import DHTNode
from dht.peer_dictionary import dictionary_entries, peer_entries, peer_subkey
from dht.records import MAX_TTL, DHTRecord, DHTValue, pack
from dht.validation import SignatureValidator
from moe.announce import announced_address, announcement_subkey, declare_experts, get_expert_addresses
from peer import LOCAL_DIFFICULTY, Identity, PeerAddress, PeerID, Router, open_peer_host

PREFIX = "owned"
ATTACKER_ADDRESS = "127.0.0.66:9"


@dataclass
class RecordType:
    """How one record type is written by its owner and read back, in the owner's own code paths."""

    # The key the owner's record is stored under.
    key: Callable[[DHTNode], str]
    # Publish the owner's record; ``n`` changes what it says, so a reader can tell which one it sees.
    publish: Callable[[DHTNode, int], Awaitable[None]]
    # What a reader makes of a get's answer: {peer: what its record says}.
    parse: Callable[[DHTValue | None], dict[PeerID, Any]]
    # What the owner's n-th record says, as ``parse`` reports it.
    says: Callable[[DHTNode, int], Any]
    # The owner's marked subkey, and the plain peer-ID subkey of the old layout.
    owned_subkey: Callable[[Identity], Any]
    plain_subkey: Callable[[Identity], Any]
    # A forger's value: the owner's record made to say what the attacker wants.
    forged: Callable[[DHTNode, Identity], Any]


async def publish_progress(node: DHTNode, n: int) -> None:
    await ProgressTracker(node, PREFIX).publish(PeerProgress(n, 10 * n, 1.0))


def declaration(node: DHTNode, n: int) -> Declaration:
    return Declaration(node.peer_id, node.address, 1.0, AveragingMode.NODE, "schema", n)


async def publish_declaration(node: DHTNode, n: int) -> None:
    # A fresh router: the matchmaker's join method would clash with the previous publish's.
    await Matchmaker(node.host, node, PREFIX, router=Router()).declare(declaration(node, n), timeout=5.0)


class NoState:
    """A donor in these tests only announces; nobody downloads."""


_donors: weakref.WeakKeyDictionary[DHTNode, StateSharing] = weakref.WeakKeyDictionary()


async def publish_donor(node: DHTNode, n: int) -> None:
    if node not in _donors:  # one per host: it registers the state download method
        _donors[node] = StateSharing(node.host, node, PREFIX, NoState(), donor_refresh=0.0)
    await _donors[node].announce(n)


def expert_address(node: DHTNode, n: int) -> PeerAddress:
    return PeerAddress("127.0.0.1", 1000 + n, node.peer_id)


async def publish_expert(node: DHTNode, n: int) -> None:
    assert await declare_experts(node, ["ffn.3"], expert_address(node, n), time.time() + 45)


def experts(found: DHTValue | None) -> dict[PeerID, Any]:
    return {peer: address for (_, peer), address in dictionary_entries(found, announcement_subkey, announced_address)}


RECORD_TYPES = {
    "progress": RecordType(
        key=lambda owner: f"{PREFIX}.progress",
        publish=publish_progress,
        parse=lambda found: {peer: p.epoch for peer, p in peer_entries(found, lambda _, b: PeerProgress.from_wire(b))},
        says=lambda node, n: n,
        owned_subkey=lambda identity: peer_subkey(identity.public_key),
        plain_subkey=lambda identity: identity.peer_id.to_bytes(),
        forged=lambda owner, attacker: {"epoch": 1_000_000, "samples": 0, "sps": 0.0},
    ),
    "matchmaking": RecordType(
        key=lambda owner: f"{PREFIX}.matchmaking",
        publish=publish_declaration,
        parse=lambda found: {peer: d.round for peer, d in peer_entries(found, Declaration.from_wire)},
        says=lambda node, n: n,
        owned_subkey=lambda identity: peer_subkey(identity.public_key),
        plain_subkey=lambda identity: identity.peer_id.to_bytes(),
        forged=lambda owner, attacker: {
            "address": f"{ATTACKER_ADDRESS}/{attacker.peer_id}",
            "bandwidth": 1e9,
            "mode": "node",
            "schema": "schema",
            "round": 1_000_000,
        },
    ),
    "state_donors": RecordType(
        key=lambda owner: f"{PREFIX}.state_donors.{donor_shard(owner.host.node_id.node_id)}",
        publish=publish_donor,
        parse=lambda found: {
            peer: o.version
            for peer, o in peer_entries(found, partial(DonorOffer.from_wire, difficulty=LOCAL_DIFFICULTY))
        },
        says=lambda node, n: n,
        owned_subkey=lambda identity: peer_subkey(identity.public_key),
        plain_subkey=lambda identity: identity.peer_id.to_bytes(),
        forged=lambda owner, attacker: {"address": f"{ATTACKER_ADDRESS}/{attacker.peer_id}", "version": 1_000_000},
    ),
    "experts": RecordType(
        key=lambda owner: "ffn.",
        publish=publish_expert,
        parse=experts,
        says=expert_address,
        owned_subkey=lambda identity: [3, peer_subkey(identity.public_key)],
        plain_subkey=lambda identity: 3,
        forged=lambda owner, attacker: f"{ATTACKER_ADDRESS}/{attacker.peer_id}",
    ),
}


@asynccontextmanager
async def three_nodes() -> AsyncIterator[tuple[DHTNode, DHTNode, DHTNode]]:
    """A storage node, the owner (a full node too) and a reader in client mode."""
    async with DHTNode.open() as storage, DHTNode.open(initial_peers=[storage.address]) as owner:
        async with DHTNode.open(initial_peers=[storage.address], client_mode=True) as reader:
            yield storage, owner, reader


async def send_store(nodes: list[DHTNode], sender: Identity, record: DHTRecord) -> list[bool]:
    """One ``dht.store`` per node, sent by hand: a hostile peer follows none of DHTNode's rules."""
    accepted = []
    async with open_peer_host(sender, listen=None) as host:
        for node in nodes:
            connection = await host.connect(node.address)
            reply = await connection.call(
                "dht.store", [[record.key, record.subkey, record.value, record.expiration_time]], timeout=10
            )
            accepted.append(reply.body == [True])
    return accepted


def forgeries(record: RecordType, owner: DHTNode, attacker: Identity) -> dict[str, DHTRecord]:
    """The attacker's stores under the owner's marked subkey, none of which any node may take."""
    key, value = pack(record.key(owner)), pack(record.forged(owner, attacker))
    owned = pack(record.owned_subkey(owner.host.identity))
    # A valid signature of the attacker's, made for its own marked subkey and moved to the owner's.
    own = DHTRecord(key, pack(record.owned_subkey(attacker)), value, 0.0)
    result = {}
    for name, expiration in (("a day", time.time() + MAX_TTL), ("30 s", time.time() + 30)):
        signed = SignatureValidator(attacker).sign(DHTRecord(own.key, own.subkey, value, expiration))
        result[f"signed by the attacker, {name}"] = DHTRecord(key, owned, signed, expiration)
        result[f"unsigned, {name}"] = DHTRecord(key, owned, value, expiration)
    return result


def local_view(node: DHTNode, key: str) -> DHTValue | None:
    """What ``node`` itself holds and would answer with for ``key``."""
    found = node.records.found(pack(key))
    return None if found is None else node.records.decode(pack(key), found)


async def everyone_sees(
    record: RecordType, owner: DHTNode, nodes: list[DHTNode], reader: DHTNode
) -> list[dict[PeerID, Any]]:
    key = record.key(owner)
    views = [record.parse(local_view(node, key)) for node in nodes]
    with trio.fail_after(10):
        views.append(record.parse(await reader.get(key, latest=True)))
    return views


@pytest.mark.parametrize("kind", list(RECORD_TYPES))
async def test_an_attacker_cannot_write_or_squat_on_another_peers_record(kind: str) -> None:
    record = RECORD_TYPES[kind]
    attacker = Identity.generate()
    async with three_nodes() as (storage, owner, reader):
        full = [storage, owner]
        await record.publish(owner, 1)
        assert await everyone_sees(record, owner, full, reader) == [{owner.peer_id: record.says(owner, 1)}] * 3

        for name, forged in forgeries(record, owner, attacker).items():
            assert await send_store(full, attacker, forged) == [False, False], name
        # The old layout, a plain peer ID as subkey: nodes take it for as long as the type allows,
        # a day they refuse; either way readers no longer look there.
        plain = pack(record.plain_subkey(owner.host.identity))
        value = pack(record.forged(owner, attacker))
        for expiration, taken in ((time.time() + 30, True), (time.time() + MAX_TTL, False)):
            squat = DHTRecord(pack(record.key(owner)), plain, value, expiration)
            assert await send_store(full, attacker, squat) == [taken, taken]
        assert await everyone_sees(record, owner, full, reader) == [{owner.peer_id: record.says(owner, 1)}] * 3

        await record.publish(owner, 2)  # short-lived (4-45 s), later than every forged expiration
        assert await everyone_sees(record, owner, full, reader) == [{owner.peer_id: record.says(owner, 2)}] * 3
        if kind == "experts":
            assert await get_expert_addresses(reader, ["ffn.3"]) == {"ffn.3": expert_address(owner, 2)}


@pytest.mark.parametrize("kind", ["matchmaking", "state_donors", "experts"])
async def test_a_record_the_attacker_signs_about_the_owner_reaches_no_reader(kind: str) -> None:
    """Under its own marked subkey the attacker may write what it likes, but a record that claims the
    owner's address (so that peers would count the owner twice, or trust the attacker for it) is
    dropped: the address must name whoever signed."""
    record = RECORD_TYPES[kind]
    async with three_nodes() as (storage, owner, reader):
        async with DHTNode.open(initial_peers=[storage.address]) as attacker:
            await record.publish(owner, 1)
            claim = {
                "matchmaking": declaration(owner, 5).to_wire(),
                "state_donors": {"address": str(owner.address), "version": 5},
                "experts": str(expert_address(owner, 5)),
            }[kind]
            subkey = record.owned_subkey(attacker.host.identity)
            assert await attacker.store(record.key(owner), claim, time.time() + 30, subkey=subkey)
            assert (
                await everyone_sees(record, owner, [storage, owner], reader)
                == [{owner.peer_id: record.says(owner, 1)}] * 3
            )


async def test_a_node_signs_only_with_its_hosts_identity() -> None:
    """Its own records are signed with the identity peers know it by; a second signer is refused (it
    would wrap the envelope in another that no node verifies), and so is another peer's marker."""
    other = Identity.generate()
    with pytest.raises(ValueError, match="SignatureValidator"):
        async with DHTNode.open(validators=[SignatureValidator(other)]):
            pass
    async with DHTNode.open() as node:
        with pytest.raises(ValueError, match="not ours"):
            await node.store("x.progress", 1, time.time() + 10, subkey=peer_subkey(other.public_key))
        assert await node.store("x.progress", 1, time.time() + 10, subkey=peer_subkey(node.host.identity.public_key))


async def test_experts_are_announced_only_by_the_peer_that_serves_them() -> None:
    """Readers drop an announcement whose address names another peer than its signer, so a server
    whose DHT node runs on another identity would vanish from the grid; it is refused up front."""
    from moe.server import open_expert_server

    async with DHTNode.open() as node, open_peer_host(Identity.generate()) as other_host:
        with pytest.raises(ValueError, match="DHT node of the peer that serves them"):
            async with open_expert_server(other_host, {}, dht=node):
                pass
