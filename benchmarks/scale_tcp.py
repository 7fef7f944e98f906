"""Scale on real TCP: N averaging peers on 127.0.0.1 in one process, on the wall clock.

    python benchmarks/scale_tcp.py [--quick] [--peers 32,128] [--group 16] [--rounds 2]

The simulated internet (``benchmarks/scale.py``) charges CPU no simulated time; here it does. N
real peers (a TCP ``PeerHost`` with Noise, a ``DHTNode`` and a ``GroupAverager`` of 1,024 floats,
plain mean, Moshpit groups of ``--group``) join one after another, each through two earlier ones,
then step together for ``--rounds`` rounds, all on one trio loop: every peer's matchmaking, DHT
requests and all-reduce share one core, as they would share a small machine's. A row per N: the
fraction of peers that averaged in each round, CPU seconds per peer per round, join time.

Every figure is a ratio within the run: ``averaged_fraction`` is the smallest fraction of peers
that averaged in any round at the largest N, ``cpu_per_peer_round_growth`` the per-peer CPU per
round at the largest N over that at the smallest. The last line is one JSON object. ``--quick``
runs N = 8 and 16 in one round.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from averaging.averager import GroupAverager  # noqa: E402
from dht import DHTConfig, DHTNode  # noqa: E402
from peer import Identity, Router, open_peer_host  # noqa: E402

VALUES = 1024
ROUND_TIMEOUT = 60.0
MATCHMAKING_TIMEOUT = 15.0


async def run_peer(initial_peers: list, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_peer_host(Identity.generate(), router=Router()) as host:
        async with DHTNode.open(host=host, initial_peers=initial_peers, config=DHTConfig()) as node:
            task_status.started(node)
            await trio.sleep_forever()


async def swarm_row(peers: int, group: int, rounds: int, seed: int) -> dict[str, Any]:
    picks = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        nodes: list[DHTNode] = []
        for index in range(peers):
            entry = [nodes[i].address for i in picks.sample(range(index), min(index, 2))]
            nodes.append(await nursery.start(run_peer, entry))
        join_s = trio.current_time() - started
        averagers = [
            GroupAverager(
                [torch.randn(VALUES, generator=generator)],
                node,
                prefix="tcp-scale",
                target_group_size=group,
                matchmaking_timeout=MATCHMAKING_TIMEOUT,
                aggregation="mean",
            )
            for node in nodes
        ]
        fractions = []
        cpu_before = time.process_time()
        for _ in range(rounds):
            averaged = 0

            async def step(averager: GroupAverager) -> None:
                nonlocal averaged
                try:
                    await averager.step(timeout=ROUND_TIMEOUT)
                except Exception:  # a round this peer lost: counted, not raised
                    return
                averaged += 1

            async with trio.open_nursery() as steps:
                for averager in averagers:
                    steps.start_soon(step, averager)
            fractions.append(averaged / peers)
        cpu = time.process_time() - cpu_before
        nursery.cancel_scope.cancel()
    return {
        "peers": peers,
        "averaged_per_round": [round(fraction, 4) for fraction in fractions],
        "cpu_per_peer_round_s": round(cpu / (peers * rounds), 4),
        "join_s": round(join_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 8 and 16, one round")
    parser.add_argument("--peers", default=None, help="comma-separated swarm sizes (default 32,128)")
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None, help="rounds per swarm (default 2, quick 1)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(n) for n in (args.peers or ("8,16" if args.quick else "32,128")).split(",")]
    rounds = args.rounds or (1 if args.quick else 2)
    print(f"{'peers':>6} {'averaged per round':>24} {'cpu/peer/round':>15} {'join s':>7}")
    rows = []
    for size in sizes:
        row = trio.run(swarm_row, size, args.group, rounds, args.seed)
        rows.append(row)
        shares = " ".join(f"{fraction:.3f}" for fraction in row["averaged_per_round"])
        print(f"{size:>6} {shares:>24} {row['cpu_per_peer_round_s']:>15.4f} {row['join_s']:>7.1f}", flush=True)
    smallest, largest = rows[0], rows[-1]
    result = {
        "peers": largest["peers"],
        "group": args.group,
        "averaged_fraction": min(largest["averaged_per_round"]),
        "cpu_per_peer_round_growth": round(largest["cpu_per_peer_round_s"] / smallest["cpu_per_peer_round_s"], 3),
        "peers_ratio": round(largest["peers"] / smallest["peers"], 3),
        "rows": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
