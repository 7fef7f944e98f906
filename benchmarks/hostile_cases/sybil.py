"""Sybil placement: what it costs to put 20 node IDs next to a key, measured at the run's puzzle
difficulty and estimated at the public default, with key grinding (no puzzle) as the baseline."""

from __future__ import annotations

import random
import time
from typing import Any

import trio

from peer import DEFAULT_DIFFICULTY, Identity, NodeIDProof

from .bench import Bench, Outcome
from .target import DIFFICULTY


async def sybil_placement(bench: Bench, out: Outcome) -> None:
    out.info_only = True
    s = bench.settings
    result = await trio.to_thread.run_sync(sybil_measurement, s.sybil_swarm_n, s.sybil_time_cap_s, DIFFICULTY)
    free = await trio.to_thread.run_sync(free_id_rate, 1.0)
    n = s.sybil_swarm_n
    public_rate = result["hash_rate"] / 2**DEFAULT_DIFFICULTY  # IDs/s that pass a public run's puzzle
    public_s = (n + 1) / public_rate  # n + 1 candidates for 20 hits (see sybil_measurement)
    bench.figures.update(
        sybil_ids_per_s=round(result["rate"], 1),
        sybil_20_ids_s=round(result["seconds"], 3),
        sybil_difficulty=DIFFICULTY,
        sybil_public_difficulty=DEFAULT_DIFFICULTY,
        sybil_public_ids_per_s=round(public_rate, 4),
        sybil_public_20_ids_s=round(public_s),
        sybil_free_ids_per_s=round(free),
        sybil_swarm_n=n,
    )
    how = "measured" if result["measured"] else "estimated (cap hit)"
    out.notes.append(f"baseline: {free:.0f} free IDs/s (key pairs) on one core")
    out.notes.append(
        f"difficulty {DIFFICULTY}: {result['rate']:.0f} IDs/s pass the puzzle ({result['candidates']} solved, "
        f"{result['hash_rate'] / 1e6:.2f} M hashes/s); 20 IDs nearer than the 20 nearest of {n}: "
        f"{result['seconds']:.2f} s ({how})"
    )
    estimates = ", ".join(f"N={m:.0e}: {(m + 1) / public_rate / 3600:.1f} h" for m in (1e3, 1e4, 1e6))
    out.notes.append(
        f"difficulty {DEFAULT_DIFFICULTY} (public): {public_rate:.3f} IDs/s; 20 IDs near a key among N "
        f"(estimate (N+1)/rate): {estimates}"
    )


def sybil_measurement(n: int, cap_s: float, difficulty: int) -> dict[str, Any]:
    """Grind node IDs the cheapest way the puzzle allows (one key, successive solutions at
    ``difficulty``, each a uniformly placed node ID) until 20 lie nearer to a random key than the
    20th nearest of ``n`` honest IDs; the hash rate gives the cost at any other difficulty."""
    rng = random.Random(1)
    target = rng.getrandbits(160)
    honest = sorted(rng.getrandbits(160) ^ target for _ in range(n))
    bound = honest[19]
    peer_id = Identity.generate().peer_id
    start = time.perf_counter()
    placed = solutions = nonce = 0
    while placed < 20 and time.perf_counter() - start < cap_s:
        proof = NodeIDProof.solve(peer_id, difficulty, start=nonce)
        nonce = int.from_bytes(proof.nonce, "little") + 1
        solutions += 1
        if int.from_bytes(proof.node_id, "big") ^ target < bound:
            placed += 1
    elapsed = time.perf_counter() - start
    rate, hash_rate = solutions / elapsed, nonce / elapsed
    if placed >= 20:
        return {"rate": rate, "hash_rate": hash_rate, "seconds": elapsed, "measured": True, "candidates": solutions}
    # Expected candidates for 20 hits when each hits with probability 20/(n+1): n + 1.
    seconds = (n + 1) / rate
    return {"rate": rate, "hash_rate": hash_rate, "seconds": seconds, "measured": False, "candidates": solutions}


def free_id_rate(seconds: float) -> float:
    """Peer IDs (key pairs and their hash) per second on one core: what a DHT position cost when
    the DHT placed peers by peer ID."""
    start = time.perf_counter()
    count = 0
    while time.perf_counter() - start < seconds:
        Identity.generate().peer_id.to_int()
        count += 1
    return count / (time.perf_counter() - start)
