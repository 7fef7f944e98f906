"""A 10-node DHT of separate ``peerd join`` processes: exact lookups, and stores and gets entering
through random nodes, both from an embedded node and with the ``peerd dht`` commands."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

from dht.node import DHTNode
from dht.testing import jaccard
from peer import NodeIDProof, PeerAddress
from peer.node_id import proof_path
from tests.support.processes import PEERD, PeerdProcess

NODES = 10


def stored_nonce(key: Path) -> bytes:
    return bytes.fromhex(json.loads(proof_path(key).read_text())["nonce"])


def start_swarm(tmp_path) -> tuple[list[PeerdProcess], list[PeerAddress]]:
    processes, addresses = [], []
    rng = random.Random(7)
    for index in range(NODES):
        args = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / f"n{index}.key"), "--run-id", "dht"]
        if addresses:
            args += ["--initial-peer", str(rng.choice(addresses))]  # join through any earlier node
        process = PeerdProcess(args, tmp_path / f"n{index}.log")
        processes.append(process)
        addresses.append(PeerAddress.parse(process.read_line(timeout=60).removeprefix("peerd listening on ")))
    return processes, addresses


async def test_ten_peerd_processes_form_a_dht(tmp_path):
    processes, addresses = start_swarm(tmp_path)
    rng = random.Random(11)
    try:
        # Each process stored its node-ID solution beside its key; that, not the peer ID, is its place.
        place = {
            a.peer_id.to_int(): int.from_bytes(
                NodeIDProof(a.peer_id, stored_nonce(tmp_path / f"n{i}.key")).node_id, "big"
            )
            for i, a in enumerate(addresses)
        }
        ids = list(place)
        async with DHTNode.open(initial_peers=[rng.choice(addresses)], client_mode=True, run_id="dht") as client:
            scores = []
            for _ in range(20):
                target = rng.getrandbits(160)
                found = {p.to_int() for p in await client.find_nearest(target)}
                truth = set(sorted(ids, key=lambda peer: place[peer] ^ target)[: client.config.k])
                scores.append(jaccard(found, truth))
            assert sum(scores) / len(scores) >= 0.95, scores
            for i in range(20):
                assert await client.store(f"key-{i}", {"i": i}, time.time() + 120)

        for i in range(20):  # read back through other entry points
            async with DHTNode.open(initial_peers=[rng.choice(addresses)], client_mode=True, run_id="dht") as reader:
                found = await reader.get(f"key-{i}")
                assert found is not None and found.value == {"i": i}

        def cli(*args: str) -> subprocess.CompletedProcess:
            entry = ["--initial-peer", str(rng.choice(addresses)), "--run-id", "dht"]
            return subprocess.run(PEERD + ["dht", *args, *entry], capture_output=True, text=True, timeout=60)

        for i in range(3):
            stored = cli("store", f"cli-{i}", json.dumps({"n": i}), "--ttl", "60")
            assert stored.returncode == 0, stored.stderr
            got = cli("get", f"cli-{i}")
            assert got.returncode == 0, got.stderr
            assert json.loads(got.stdout)["value"] == {"n": i}
        missing = cli("get", "never-stored")
        assert missing.returncode == 1
    finally:
        for process in processes:
            process.stop()
