"""Scale benchmark: how a peer's work grows with the swarm, on the simulated internet.

    python benchmarks/scale.py [--quick] [--peers 32,64,128] [--dht-nodes 256,1024] [--nat-fraction 0.3]

For each swarm size N, the scenario of ``tests/support/sim_scale.py`` runs under trio's virtual
clock: N real peers (hosts, DHT nodes, ``GroupAverager``s of 256 floats in Moshpit groups of 16),
``--nat-fraction`` of them behind NAT (relays, hole punching), join, average through rounds with
10% of the swarm replaced per simulated minute and one round split by a partition, then through
calm rounds until they agree. Per size it prints a row of the
growth table: per peer per round the CPU seconds, bytes and segments sent, the DHT requests the
swarm served and the connections it made (each a handshake: the protocol's own work, which a peer
pays in a process of its own, while the CPU of N peers in one process also grows with their shared
heap); the DHT requests served by the busiest and by the median node (of the DHT's servers: peers
behind NAT are its clients); memory per peer (resident-set growth over the run ÷ N, each row in
a process of its own); the calm rounds until the swarm agreed; the median round's simulated
seconds; the fraction of the steps of peers that stayed that averaged (and of those behind NAT,
with the direct connections hole punching made).

Then a DHT-only swarm per ``--dht-nodes`` size: the nodes join (32 at a time), 64 keys are stored,
30% of the nodes leave, and every key is looked for from a surviving node
(``dht_get_success_after_churn``). Memory per node is read at rest, once the joins' connections
have been idle long enough to retire: what the nodes' allocations hold (``dht_memory_per_node_mb``,
read through malloc, C allocations such as cipher states included) and the resident-set growth
(``dht_resident_per_node_mb``, after ``malloc_trim``: one process's high-water mark of all the
joins' connections, ~30 KB each, which its allocator keeps in part). The row's process allocates
through glibc's malloc (``PYTHONMALLOC=malloc``) for that reading, so its CPU per join is not
comparable with figures taken under Python's own allocator.

Then, per ``--optimizer-peers`` size, a swarm training with the collaborative optimizer
(``tests/support/sim_training.py``: a tiny model, modelled compute, 12 epochs through the same
churn, NAT and a partition): the share of the stayers' epochs whose round averaged
(``optimizer_averaged_fraction``, the least over the sizes; None when no size was asked for), and
the same share with the epochs a stayer skipped (it caught up a round, or loaded a donor's state)
counted as rounds it did not average in (``optimizer_averaged_fraction_of_epochs``). The optimizer
forms its groups at the step, its default; ``--match-ahead`` forms them while the epoch
accumulates, as ``peerd join`` does.

Every figure is a ratio within the run: ``cpu_per_peer_round_growth`` is the per-peer CPU per
round at the largest N of the run over that at the smallest, ``busiest_node_load_ratio`` the
busiest node's requests over the median node's (at the largest N). The last line is one JSON
object. ``--quick`` runs N = 16 and 32 and a DHT of 128 nodes (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dht import DHTConfig  # noqa: E402
from peer.idle_connections import IDLE_CHECK_S, IDLE_RETIRE_S  # noqa: E402
from peer.simnet import SimNetwork  # noqa: E402
from tests.support.sim_heap import one_heap_for_many_peers, settle_every, sweep  # noqa: E402
from tests.support.sim_scale import ScaleReport, Scenario, run_scenario  # noqa: E402
from tests.support.sim_swarm import open_sim_swarm  # noqa: E402
from tests.support.sim_training import TrainingScenario, run_training  # noqa: E402

KEYS = 64
DEPARTED = 0.3
# The DHT-only swarm's garbage is collected per node's heap (``tests/support/sim_heap.py``), the
# survivors frozen after every this many joins.
JOINS_PER_SETTLE = 64
# DHT nodes join this many at a time (``open_sim_swarm``): one join after another, N nodes form
# over ~2.6 N simulated seconds, through which every node runs its periodic work (idle-connection
# looks, refreshes of buckets gone quiet): 1,024 nodes took over 30 CPU-minutes one at a time, 15
# sixteen at a time.
DHT_JOINS_AT_ONCE = 32
MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


def resident_mb() -> float:
    """The process's resident set now (MiB), from /proc, else its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize() / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _malloc_info() -> Any:
    """glibc's ``mallinfo2`` (None elsewhere, or on a glibc before 2.33)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]

    function.restype = MallInfo2
    return function()


def held_mb() -> float | None:
    """What the process's allocations hold now (MiB): the bytes malloc has handed out and not had
    back. Python's own allocator keeps small objects in arenas that malloc does not see, so this
    is read only where Python allocates through malloc (``PYTHONMALLOC=malloc``, as the DHT row's
    process runs); None elsewhere."""
    info = _malloc_info() if os.environ.get("PYTHONMALLOC") == "malloc" else None
    return None if info is None else (info.uordblks + info.hblkhd) / 2**20


def give_freed_memory_back() -> None:
    """Return malloc's free pages to the system (glibc's ``malloc_trim``), so that the resident
    set reads what is held, not the high-water mark of the joins' connections."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def averaging_row(peers: int, seed: int, nat_fraction: float) -> dict[str, Any]:
    scenario = Scenario(
        peers=peers,
        group_size=16,
        turbulent_rounds=3,
        churn_per_minute=0.1,
        partition_round=1,
        nat_fraction=nat_fraction,
        seed=seed,
    )
    before, started = resident_mb(), time.perf_counter()
    report: ScaleReport = trio.run(run_scenario, scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    rounds = max(report.peer_rounds, 1)
    served = sorted(report.served)
    return {
        "peers": peers,
        "cpu_per_peer_round_s": round(report.cpu_per_peer_round, 4),
        "bytes_per_peer_round": round(report.bytes_sent / rounds),
        "segments_per_peer_round": round(report.segments_sent / rounds, 1),
        "dht_requests_per_peer_round": round(report.dht_requests_per_peer_round, 1),
        "connections_per_peer_round": round(report.connections_per_peer_round, 3),
        "busiest_node_requests": served[-1] if served else 0,
        "median_node_requests": served[len(served) // 2] if served else 0,
        "busiest_node_load_ratio": round(report.busiest_node_load_ratio, 2),
        "memory_per_peer_mb": round(max(0.0, resident_mb() - before) / peers, 2),
        "rounds_to_agree": report.rounds_to_agree,
        "median_round_s": round(statistics.median(report.round_s), 1) if report.round_s else None,
        "averaged_fraction": round(report.averaged_fraction, 4),
        "behind_nat": report.behind_nat,
        "averaged_fraction_behind_nat": _rounded(report.averaged_fraction_behind_nat, 4),
        "punched": report.punched,
        "partition_round_averaged": round(report.partition_round_averaged or 0.0, 3),
        "newcomers": report.newcomers,
        "newcomers_averaged": len(report.newcomer_first_average_s),
        "newcomers_gone_unaveraged": len(report.newcomers_gone_unaveraged_s),
        "newcomer_first_average_max_s": round(max(report.newcomer_first_average_s, default=0.0), 1),
        "real_s": round(time.perf_counter() - started, 1),
    }


async def dht_churn(nodes: int, seed: int) -> dict[str, Any]:
    network = SimNetwork(seed=seed)
    picks = random.Random(seed)
    before, held_before, started = resident_mb(), held_mb(), time.process_time()
    async with open_sim_swarm(
        network, nodes, config=DHTConfig(), joined=settle_every(JOINS_PER_SETTLE), joins_at_once=DHT_JOINS_AT_ONCE
    ) as swarm:
        join_cpu = time.process_time() - started
        joined_connections = _connections_per_node(network, swarm)
        await trio.sleep(IDLE_RETIRE_S + 2 * IDLE_CHECK_S)  # the joins' connections retire
        sweep()  # (every node's garbage freed before the readings)
        give_freed_memory_back()
        memory, held = max(0.0, resident_mb() - before) / nodes, _per_node(held_mb(), held_before, nodes)
        resting_connections = _connections_per_node(network, swarm)
        clock = swarm.clock
        keys = {f"scale-{n}": n for n in range(KEYS)}
        for key, value in keys.items():
            await swarm.nodes[picks.randrange(nodes)].store(key, value, clock.time() + 3600)
        for index in picks.sample(range(1, nodes), int(DEPARTED * nodes)):
            swarm.leave(index)
        alive = swarm.alive()
        found = 0
        for key, value in keys.items():
            got = await swarm.nodes[picks.choice(alive)].get(key)
            found += got is not None and got.value == value
    return {
        "nodes": nodes,
        "dht_get_success_after_churn": found / KEYS,
        "memory_per_node_mb": _rounded(held, 3),
        "resident_per_node_mb": round(memory, 2),
        "connections_per_node_joined": round(joined_connections, 1),
        "connections_per_node_at_rest": round(resting_connections, 1),
        "join_cpu_per_node_s": round(join_cpu / nodes, 3),
    }


def _connections_per_node(network: SimNetwork, swarm: Any) -> float:
    """Open connections a node has (pooled or not), on average: each has two ends at each of its
    two hosts."""
    return sum(network.open_ends(swarm.address(index)) for index in range(len(swarm.nodes))) / 2 / len(swarm.nodes)


def _per_node(now: float | None, before: float | None, nodes: int) -> float | None:
    return None if now is None or before is None else max(0.0, now - before) / nodes


def optimizer_row(size: int, seed: int, nat_fraction: float, match_ahead: bool) -> dict[str, Any]:
    scenario = TrainingScenario(
        peers=size,
        group_size=16 if size >= 32 else 8,
        epochs=12,
        nat_fraction=nat_fraction,
        churn_per_minute=0.1,
        partition_at=30.0,
        seed=seed,
        match_ahead=match_ahead,
    )
    started = time.perf_counter()
    report = trio.run(run_training, scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    return {
        "peers": size,
        "averaged_fraction": round(report.averaged_fraction, 4),
        "averaged_fraction_of_epochs": round(report.averaged_fraction_of_epochs, 4),
        "rounds_of_stayers": report.rounds_of_stayers,
        "skipped_epochs_of_stayers": report.skipped_epochs_of_stayers,
        "failures": dict(report.failures),
        "least_epoch": report.least_epoch,
        "spread_ratio": round(report.spread / report.error_before, 4),
        "cpu_per_peer_epoch_s": round(report.cpu_s / (size * max(report.least_epoch, 1)), 4),
        "real_s": round(time.perf_counter() - started, 1),
    }


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def dht_row(size: int, seed: int) -> dict[str, Any]:
    with one_heap_for_many_peers():
        return trio.run(dht_churn, size, seed, clock=trio.testing.MockClock(autojump_threshold=0))


def in_own_process(kind: str, size: int, seed: int, nat_fraction: float, *options: str) -> dict[str, Any]:
    """One row, run in a process of its own: a row's memory is the resident-set growth it causes,
    and memory that an earlier row freed stays resident (the allocator keeps it), so the next row in
    the same process would grow into it and read as costing nothing."""
    command = [
        sys.executable,
        __file__,
        "--row",
        kind,
        str(size),
        "--seed",
        str(seed),
        "--nat-fraction",
        str(nat_fraction),
        *options,
    ]
    # The DHT row reads what its nodes hold through malloc (``held_mb``): Python allocates through it there.
    environment = {**os.environ, "PYTHONMALLOC": "malloc"} if kind == "dht" else None
    finished = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False, env=environment)
    if finished.returncode != 0:
        raise SystemExit(f"the {kind} row of {size} failed (exit status {finished.returncode}); its traceback is above")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def _growth(rows: list[dict[str, Any]], figure: str) -> float | None:
    """``figure`` in the last row (the largest N, as ``--peers`` lists them) over the first; None
    where the first is 0 (no ratio to give)."""
    first = rows[0][figure]
    return round(rows[-1][figure] / first, 3) if first else None


def _least(values: Any) -> float | None:
    """The least of ``values`` that are not None (None if none is)."""
    present = [value for value in values if value is not None]
    return min(present) if present else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", nargs=2, metavar=("KIND", "SIZE"), help=argparse.SUPPRESS)  # one row (in_own_process)
    parser.add_argument("--quick", action="store_true", help="N = 16, 32 and a DHT of 128 nodes")
    parser.add_argument("--peers", default=None, help="comma-separated swarm sizes (default 32,64,128)")
    parser.add_argument("--dht-nodes", default=None, help="comma-separated DHT-only sizes (default 256,1024)")
    parser.add_argument(
        "--optimizer-peers", default=None, help="comma-separated collaborative-optimizer swarm sizes (default: none)"
    )
    parser.add_argument(
        "--match-ahead",
        action="store_true",
        help="the optimizer's groups form while the epoch accumulates, as peerd join forms them (default: at the step)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--nat-fraction", type=float, default=0.3, help="of the averaging peers, behind NAT (default 0.3)"
    )
    args = parser.parse_args()
    if not 0.0 <= args.nat_fraction < 1.0:
        parser.error("--nat-fraction takes a fraction in [0, 1)")
    if args.row:
        kind, size = args.row
        rows = {
            "averaging": lambda n: averaging_row(n, args.seed, args.nat_fraction),
            "dht": lambda n: dht_row(n, args.seed),
            "optimizer": lambda n: optimizer_row(n, args.seed, args.nat_fraction, args.match_ahead),
        }
        if kind not in rows or not size.isdigit():
            parser.error(f"--row takes averaging, dht or optimizer and a size, not {kind} {size}")
        print(json.dumps(rows[kind](int(size))))
        return
    peers = [int(n) for n in (args.peers or ("16,32" if args.quick else "32,64,128")).split(",")]
    dht_sizes = [int(n) for n in (args.dht_nodes or ("128" if args.quick else "256,1024")).split(",")]
    trainers = [int(n) for n in (args.optimizer_peers or "").split(",") if n]

    rows = []
    print(
        f"{'peers':>6} {'cpu/peer/round':>15} {'KB/peer/round':>14} {'busiest/median':>15} "
        f"{'MB/peer':>8} {'agree':>6} {'averaged':>9} {'behind NAT':>11} {'DHT req/peer/round':>19} "
        f"{'conns/peer/round':>17} {'round s':>8} {'real s':>7}"
    )
    for size in peers:
        row = in_own_process("averaging", size, args.seed, args.nat_fraction)
        rows.append(row)
        print(
            f"{size:>6} {row['cpu_per_peer_round_s']:>15.4f} {row['bytes_per_peer_round'] / 1e3:>14.1f} "
            f"{row['busiest_node_load_ratio']:>15.2f} {row['memory_per_peer_mb']:>8.2f} "
            f"{str(row['rounds_to_agree']):>6} {row['averaged_fraction']:>9.4f} "
            f"{str(row['averaged_fraction_behind_nat']):>11} "
            f"{row['dht_requests_per_peer_round']:>19.1f} {row['connections_per_peer_round']:>17.2f} "
            f"{str(row['median_round_s']):>8} {row['real_s']:>7.1f}",
            flush=True,
        )
    dht_rows = []
    for size in dht_sizes:
        row = in_own_process("dht", size, args.seed, args.nat_fraction)
        dht_rows.append(row)
        print(
            f"DHT {size:>5} nodes: {row['dht_get_success_after_churn']:.3f} of keys found after "
            f"{DEPARTED:.0%} left; per node at rest {row['memory_per_node_mb']} MB held, "
            f"{row['resident_per_node_mb']:.2f} MB resident, {row['connections_per_node_at_rest']} connections "
            f"({row['connections_per_node_joined']} once joined); {row['join_cpu_per_node_s']:.3f} CPU-s per join",
            flush=True,
        )
    optimizer_rows = []
    for size in trainers:
        row = in_own_process("optimizer", size, args.seed, args.nat_fraction, *(["--match-ahead"] * args.match_ahead))
        optimizer_rows.append(row)
        print(
            f"optimizer {size:>4} peers: {row['averaged_fraction']:.4f} of {row['rounds_of_stayers']} stayers' epochs "
            f"averaged (failures {row['failures']}; {row['averaged_fraction_of_epochs']:.4f} counting "
            f"{row['skipped_epochs_of_stayers']} skipped epochs), spread / start error {row['spread_ratio']:.4f}, "
            f"{row['cpu_per_peer_epoch_s']:.3f} CPU-s per peer-epoch",
            flush=True,
        )
    smallest, largest = rows[0], rows[-1]
    result = {
        "peers": largest["peers"],
        "averaged_fraction": min(row["averaged_fraction"] for row in rows),
        "nat_fraction": args.nat_fraction,
        "averaged_fraction_behind_nat": _least(row["averaged_fraction_behind_nat"] for row in rows),
        "punched": largest["punched"],
        "cpu_per_peer_round_growth": _growth(rows, "cpu_per_peer_round_s"),
        "peers_ratio": round(largest["peers"] / smallest["peers"], 3),
        "dht_requests_per_peer_round_growth": _growth(rows, "dht_requests_per_peer_round"),
        "connections_per_peer_round_growth": _growth(rows, "connections_per_peer_round"),
        "busiest_node_load_ratio": largest["busiest_node_load_ratio"],
        "memory_per_peer_mb": largest["memory_per_peer_mb"],
        "dht_nodes": dht_rows[-1]["nodes"],
        "dht_get_success_after_churn": min(row["dht_get_success_after_churn"] for row in dht_rows),
        "dht_memory_per_node_mb": dht_rows[-1]["memory_per_node_mb"],
        "dht_resident_per_node_mb": dht_rows[-1]["resident_per_node_mb"],
        "optimizer_averaged_fraction": _least(row["averaged_fraction"] for row in optimizer_rows),
        "optimizer_averaged_fraction_of_epochs": _least(row["averaged_fraction_of_epochs"] for row in optimizer_rows),
        "optimizer_match_ahead": args.match_ahead,
        "rows": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
