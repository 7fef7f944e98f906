"""The attacker's tools: an authenticated connection whose records it writes by hand, and DHT
stores and reads made and checked the way peers make and check them."""

from __future__ import annotations

import time
from typing import Any

import trio

from averaging.progress import PeerProgress
from dht import wire
from dht.local import LocalRecords
from dht.peer_dictionary import peer_entries, peer_subkey
from dht.records import MAX_TTL, DHTRecord, DHTValue, key_id, pack
from dht.validation import SignatureValidator
from peer import Identity, NodeIDProof, PeerAddress
from peer.rpc_protocol import packb, unpackb
from peer.secure_channel import PROTOCOL_VERSION, Hello, secure_handshake

from .target import ATTACKER_HOST, DIFFICULTY, MIB, RUN_ID, MemoryWatch


class RawPeer:
    """An authenticated connection whose records the attacker writes by hand."""

    def __init__(self, stream: trio.SocketStream, channel: Any):
        self.stream, self.channel = stream, channel
        self.received: list[Any] = []

    @classmethod
    async def connect(cls, address: PeerAddress, timeout: float = 10.0) -> RawPeer:
        stream = await trio.open_tcp_stream(address.host, address.port, local_address=ATTACKER_HOST)
        identity = Identity.generate()
        hello = Hello(PROTOCOL_VERSION, RUN_ID, node_id_nonce=NodeIDProof.solve(identity.peer_id, DIFFICULTY).nonce)
        try:
            channel = await secure_handshake(stream, identity, hello, initiator=True, timeout=timeout)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return cls(stream, channel)

    async def send(self, header: list) -> None:
        await self.channel.send_record(packb(header))

    async def send_payload(self, nbytes: int, stop: MemoryWatch | None = None) -> int:
        """``nbytes`` of payload in records of at most 1 MiB; stops early past the safety limit."""
        chunk = bytes(min(nbytes, MIB))
        sent = 0
        while sent < nbytes:
            if stop is not None:
                stop.sample()
                if stop.over_safety_limit:
                    break
            size = min(MIB, nbytes - sent)
            await self.channel.send_record(chunk[:size])
            sent += size
        return sent

    async def read_replies(self) -> None:
        """Collect whatever the target answers (decoded headers) until it closes the connection."""
        try:
            while True:
                record = await self.channel.receive_record()
                try:
                    self.received.append(unpackb(record))
                except Exception:
                    self.received.append(None)
        except Exception:
            pass

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


async def close_all(peers: list) -> None:
    with trio.CancelScope(shield=True):
        for peer in peers:
            if isinstance(peer, RawPeer):
                await peer.aclose()
            else:
                await trio.aclose_forcefully(peer)


async def dht_store(connection, key: bytes, subkey: bytes | None, value: bytes, expiration: float) -> bool:
    reply = await connection.call("dht.store", [[key, subkey, value, expiration]], timeout=10)
    return isinstance(reply.body, list) and reply.body[:1] == [True]


async def dht_read_as_peers_do(connection, key: bytes) -> DHTValue | None:
    """The whole dictionary under ``key`` as the target answers it, checked and decoded the way a
    reading peer's own DHT node does (signatures verified, envelopes removed)."""
    reply = await connection.call("dht.find", [key_id(key).to_bytes(20, "big"), key], timeout=10)
    local = LocalRecords(SignatureValidator())
    found = local.validated(wire.parse_found(key, reply.payload, time.time()))
    return None if found is None else local.decode(key, found)


def signed_value(signer: Identity, key: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """``value`` as ``signer``'s DHT node would put it on the wire under its own marked subkey."""
    return SignatureValidator(signer).sign(DHTRecord(key, subkey, value, expiration))


async def owner_store(connection, owner: Identity, key: bytes, value: bytes, ttl: float) -> bool:
    """``owner``'s own record under its marked subkey, signed, as its DHT node stores it."""
    subkey, expiration = pack(peer_subkey(owner.public_key)), time.time() + ttl
    return await dht_store(connection, key, subkey, signed_value(owner, key, subkey, value, expiration), expiration)


async def forge_both_layouts(
    connection, key: bytes, owner: Identity, attacker: Identity, forged: bytes, cap_s: float
) -> tuple[bool, bool]:
    """The attacker's stores of ``forged`` as ``owner``'s record: (accepted under the owner's marked
    subkey, accepted under its plain peer ID). Under the marked subkey: a day-long and a capped
    expiration, signed by the attacker (a signature of its own marked subkey, moved over) and
    unsigned. Under the plain peer ID (what readers read before they took owners from signed
    subkeys): a day-long and a capped expiration."""
    owned, plain = pack(peer_subkey(owner.public_key)), pack(owner.peer_id.to_bytes())
    own = pack(peer_subkey(attacker.public_key))
    marked = plain_taken = False
    for expiration in (time.time() + MAX_TTL, time.time() + cap_s):
        for value in (signed_value(attacker, key, own, forged, expiration), forged):
            marked |= await dht_store(connection, key, owned, value, expiration)
        plain_taken |= await dht_store(connection, key, plain, forged, expiration)
    return marked, plain_taken


def progress_records(found: DHTValue | None) -> dict:
    """Progress per peer, parsed as every training peer parses it."""
    return dict(peer_entries(found, lambda peer, body: PeerProgress.from_wire(body)))
