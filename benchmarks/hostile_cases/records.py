"""Attacks on DHT records: another peer's matchmaking declaration and progress record rewritten by
the attacker, and the store filled with day-long junk before an honest peer stores."""

from __future__ import annotations

import time

import trio

from averaging.matchmaking import Declaration
from dht import wire
from dht.peer_dictionary import peer_entries
from dht.records import MAX_TTL, pack
from peer import Identity, PeerAddress, open_peer_host

from .attacker import dht_read_as_peers_do, forge_both_layouts, owner_store, progress_records
from .bench import Bench, Outcome
from .target import ATTACKER_HOST, MIB, RUN_ID


async def forge_matchmaking(bench: Bench, out: Outcome) -> None:
    target = await bench.bootstrap()
    key = pack(f"{RUN_ID}.digits.grads.matchmaking")
    owner, attacker = Identity.generate(), Identity.generate()

    def declaration(bandwidth: float, address: str | None, mode: str) -> bytes:
        return pack({"address": address, "bandwidth": bandwidth, "mode": mode, "schema": "s", "round": 1})

    honest = declaration(0.0, None, "client")
    forged = declaration(1e9, f"{ATTACKER_HOST}:9/{attacker.peer_id}", "node")
    async with bench.watch(target, out):
        address = PeerAddress(target.address.host, target.address.port)
        async with open_peer_host(owner, listen=None, run_id=RUN_ID) as owner_host:
            async with open_peer_host(attacker, listen=None, run_id=RUN_ID) as attacker_host:
                owner_conn = await owner_host.connect(address)
                attacker_conn = await attacker_host.connect(address)
                first = await owner_store(owner_conn, owner, key, honest, 10)
                # 300 s: the matchmaking cap (dht/lifetimes.py), a little less for the clock
                took, plain = await forge_both_layouts(attacker_conn, key, owner, attacker, forged, 290)
                again = await owner_store(owner_conn, owner, key, honest, 10)
                found = await dht_read_as_peers_do(owner_conn, key)
    read = dict(peer_entries(found, Declaration.from_wire))
    mine = read.get(owner.peer_id)
    returned = any(declaration.bandwidth == 1e9 for declaration in read.values())
    if took or returned or not again:
        out.forgeries += 1
    out.notes.append(
        f"owner store {'ok' if first else 'refused'}; forged stores under the owner's signed subkey "
        f"{'ACCEPTED' if took else 'refused'}, under its plain peer ID {'accepted' if plain else 'refused'} "
        f"(no reader looks there); owner re-store {'ok' if again else 'REFUSED'}; "
        f"readers see {'the FORGED' if returned else 'the owner' if mine else 'no'} declaration"
    )


async def store_flood(bench: Bench, out: Outcome) -> None:
    """All but the last two requests carry 12 records of 64 KiB that live 24 h (more than the
    node's byte cap); the last two top up the remaining bytes with records of halving sizes
    that expire a little sooner (so they never evict the big ones, and fit or are refused).
    Then an honest peer stores a 15 s progress record, as a training peer does every second."""
    s = bench.settings
    target = await bench.bootstrap()
    big = pack(bytes(65_000))  # just under the 64 KiB value limit
    fillers = [pack(bytes(1 << j)) for j in range(15, -1, -1)]
    accepted = total = 0
    accepted_bytes = 0
    address = PeerAddress(target.address.host, target.address.port)
    async with bench.watch(target, out) as memory:
        async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as attacker:
            connection = await attacker.connect(address)
            top_up = [fillers[: len(fillers) // 2], fillers[len(fillers) // 2 :]]
            # One expiration for every filler: a filler never evicts another (ties are refused).
            filler_expiration = time.time() + MAX_TTL - 600
            for request in range(s.store_requests):
                memory.sample()
                if memory.over_safety_limit:
                    break
                now = time.time()
                if request < s.store_requests - len(top_up):
                    values, expiration = [big] * wire.MAX_RECORDS_PER_STORE, now + MAX_TTL
                else:
                    values, expiration = top_up[request - s.store_requests], filler_expiration
                body = [[pack(f"junk.{request}.{i}"), None, v, expiration] for i, v in enumerate(values)]
                reply = await connection.call("dht.store", body, timeout=30)
                total += len(body)
                if isinstance(reply.body, list):
                    for record, ok in zip(body, reply.body, strict=False):
                        if ok is True:
                            accepted += 1
                            accepted_bytes += len(record[0]) + len(record[2])
        honest_identity = Identity.generate()
        async with open_peer_host(honest_identity, listen=None, run_id=RUN_ID) as honest:
            connection = await honest.connect(address)
            small = pack({"epoch": 0, "samples": 32, "sps": 10.0})
            # signed under its own marked subkey, as a training peer's progress is
            stored = await owner_store(connection, honest_identity, pack(f"{RUN_ID}.digits.progress"), small, 15)
    out.notes.append(
        f"{accepted}/{total} 24 h junk records accepted ({accepted_bytes / MIB:.0f} MiB sent into a 64 MiB store)"
    )
    if not stored:
        out.degraded = True
        out.notes.append("honest 15 s progress store REFUSED afterwards")
    else:
        out.notes.append("honest 15 s progress store accepted afterwards")


async def forge_progress(bench: Bench, out: Outcome) -> None:
    target = await bench.training()
    before = await bench.wait_for_progress(target, out)
    key = pack(f"{RUN_ID}.digits.progress")
    forged = pack({"epoch": 1_000_000, "samples": 0, "sps": 0.0})
    address = PeerAddress(target.address.host, target.address.port)
    async with bench.watch(target, out):
        attacker = Identity.generate()
        async with open_peer_host(attacker, listen=None, run_id=RUN_ID) as attacker_host:
            connection = await attacker_host.connect(address)
            # 60 s: the progress cap (dht/lifetimes.py), a little less for the clock
            took, plain = await forge_both_layouts(connection, key, target.identity, attacker, forged, 55)
        await trio.sleep(3.0)  # the owner republishes its progress about every second meanwhile
        async with open_peer_host(Identity.generate(), listen=None, run_id=RUN_ID) as reader:
            connection = await reader.connect(address)
            read = progress_records(await dht_read_as_peers_do(connection, key))
    mine = read.get(target.identity.peer_id)
    returned = any(progress.epoch == 1_000_000 for progress in read.values())
    if took or returned:
        out.forgeries += 1
    seen = "FORGED" if returned else "the owner's" if mine else "no"
    out.notes.append(
        f"owner record {'seen' if before else 'missing'}; forged stores under the owner's signed subkey "
        f"{'ACCEPTED' if took else 'refused'}, under its plain peer ID {'accepted' if plain else 'refused'} "
        f"(no reader looks there); 3 s later readers see {seen} progress for the owner"
    )
