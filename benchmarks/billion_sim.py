"""A run no CPU here can do, simulated: 16 peers training a 1B-parameter model with local updates
on 100 Mbit/s uplinks, and how much of their time the trainers wait for the network, for today's
int8 deltas (``blockwise_8bit``) and for sparse outer rounds (``topk_2bit``).

    python benchmarks/billion_sim.py [--quick]

(``--quick``: 8 peers, 3 rounds, the first not measured, twenty steps per round; by default 16 peers,
5 rounds of a hundred steps.)

Every peer is real code on the simulated internet (``peer/simnet``) under trio's virtual clock: a
``PeerHost`` and ``DHTNode``, and ``LocalUpdatesOptimizer`` with ``OverlappedRounds`` (as ``peerd
join --mode local-updates`` runs it: matchmaking, progress records, round ends, the group
all-reduce, the codec and error feedback). What is modelled:
- compute: a round is 100 s of compute (a hundred 1-second steps of a 1B model on one GPU; with
  ``--quick``, twenty optimizer steps of 5 simulated seconds each); the gradients are random, since
  only the schedule and the traffic are measured here;
- payload size: the model has ``MODEL / SCALE`` real values, and every bulk write (a tensor
  payload: ``peer/simnet/model.py``, ``bulk_scale``) stands for ``SCALE`` times its bytes on links
  of the modelled speed (100/1000 Mbit/s), so a round's averaging takes as long as the 1B model's
  would, while the DHT's and matchmaking's small messages take their own time.

A trainer waits when a round ends before the previous round's averaging has finished (overlapped
rounds hide the averaging behind the next round's compute). ``wait_fraction`` is 1 - compute time
/ elapsed time, over the rounds after the first, averaged over the peers. The periodic averaging of
the shared start is left out (float32 every 5 rounds, in line: with int8 deltas the whole start,
~7.5 GB per peer for this model, with a sparse codec a 64th of it: ``local_updates.py``).

Streamed fragments (``_streamed``: ``fragments=4``, ``outer_fragments.py``) take four rounds of a
quarter of the steps for one of the whole model, each averaging a quarter of it.

Measured (2026-12, the full run): wait int8 0.347, topk_2bit 0.000, streamed int8 0.235, streamed
topk_2bit 0.072 (four times the rounds' matchmaking, which a sparse round's few bytes do not hide).

The last line is one JSON object: ``wait_fraction_*`` per scheme, the bytes each peer sends per
round of the whole model for the modelled model (``round_bytes_int8``, ``round_bytes_sparse``, from
the codec's payload size and the group's size) with their ratio, and the most one round has in
flight (``peak_round_bytes_*``). The table also shows all the bytes the swarm put on its links per
peer and round of the whole model, as modelled (DHT and matchmaking included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from averaging.compression import get_codec  # noqa: E402
from averaging.local_rounds import OverlappedRounds  # noqa: E402
from averaging.local_updates import LocalUpdatesOptimizer  # noqa: E402
from dht import DHTConfig, DHTNode  # noqa: E402
from peer.simnet import SimNetwork  # noqa: E402
from tests.support.sim_swarm import open_sim_swarm  # noqa: E402

PEERS = 16
MODEL = 1_000_000_000  # parameters modelled
SCALE = 100  # real values = MODEL / SCALE; links SCALE times slower
UPLINK_MBIT, DOWNLINK_MBIT = 100.0, 1000.0
STEP_S = 1.0  # simulated seconds of compute per inner step (a 1B model's step on one GPU)
LOCAL_STEPS = 100  # inner steps per outer round: 100 s of compute
# (name, codec, fragments): today's int8 deltas, sparse rounds, and both streamed in four fragments
# that take turns (``outer_fragments.py``: a round of a quarter of the steps averages a quarter)
VARIANTS = (
    ("int8", "blockwise_8bit", 1),
    ("sparse", "topk_2bit", 1),
    ("int8_streamed", "blockwise_8bit", 4),
    ("sparse_streamed", "topk_2bit", 4),
)


@dataclass(frozen=True)
class Plan:
    """What one run models: ``model`` parameters, ``step_s`` of compute per inner step."""

    model: int = MODEL
    step_s: float = STEP_S
    rounds: int = 5
    peers: int = PEERS
    local_steps: int = LOCAL_STEPS


# --quick: 8 peers, and each inner step stands for five of a 1B model (twenty 5-s steps per round, the
# same 100 s of compute in a tenth of the optimizer calls).
QUICK = Plan(step_s=5 * STEP_S, rounds=3, peers=8, local_steps=LOCAL_STEPS // 5)


async def train(node: DHTNode, index: int, codec: str, fragments: int, plan: Plan, background: trio.Nursery) -> dict:
    """One peer: ``rounds`` outer rounds landed (of every fragment); its compute and elapsed
    simulated seconds after the first round landed, and the bytes its host sent meanwhile."""
    generator = torch.Generator().manual_seed(index)
    # four tensors, so that the model deals into up to four fragments
    weights = [torch.nn.Parameter(torch.zeros(plan.model // SCALE // 4)) for _ in range(4)]
    gradients = [torch.randn(weight.numel(), generator=generator) * 1e-3 for weight in weights]
    optimizer = LocalUpdatesOptimizer(
        torch.optim.SGD(weights, lr=0.1),
        node,
        prefix="billion",
        local_steps=plan.local_steps,
        fragments=fragments,
        codec=codec,
        rounds=OverlappedRounds(background),
        target_group_size=plan.peers,
        aggregation="mean",
        matchmaking_timeout=60.0,
        averaging_timeout=1200.0,
        progress_interval=plan.local_steps * plan.step_s / fragments / 5,  # a fifth of a round
        average_state_every=0,
    )
    landed, steps, first = 0, 0, None
    while landed < plan.rounds * fragments:
        for weight, gradient in zip(weights, gradients, strict=True):
            weight.grad = gradient.clone()
        await trio.sleep(plan.step_s)  # the modelled compute of one inner step
        steps += 1
        if await optimizer.step(1):
            landed += 1
            if landed == 1:
                first = (trio.current_time(), steps)
    assert first is not None
    began, steps_before = first
    last = optimizer.last_averaging or {}
    return {
        "compute_s": (steps - steps_before) * plan.step_s,
        "elapsed_s": trio.current_time() - began,
        "averaged": bool(last.get("averaged")),
        "group": int(last.get("group") or 1),
    }


def modelled_round_bytes(codec: str, model: int, group: int) -> int:
    """What one peer of a group sends per round for the modelled model: its contribution to every
    other reducer's shard and its own shard's average back to every other member."""
    return 2 * (group - 1) * get_codec(codec).payload_size(model // group)


async def run(codec: str, fragments: int, plan: Plan, seed: int) -> tuple[list[dict], int]:
    """Each peer's figures (``train``), and every byte the swarm put on its links, as modelled."""
    network = SimNetwork(seed=seed, mixes=((UPLINK_MBIT, DOWNLINK_MBIT),), bulk_scale=SCALE)
    results: list[dict] = [{}] * plan.peers
    async with open_sim_swarm(network, plan.peers, config=DHTConfig()) as swarm:
        async with trio.open_nursery() as background:

            async def one(index: int) -> None:
                results[index] = await train(swarm.nodes[index], index, codec, fragments, plan, background)

            async with trio.open_nursery() as trainers:
                for index in range(plan.peers):
                    trainers.start_soon(one, index)
            background.cancel_scope.cancel()
    return results, network.model.bytes_sent_total


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    plan = QUICK if args.quick else Plan(rounds=args.rounds)
    plan = plan if args.peers is None else dataclasses.replace(plan, peers=args.peers)
    figures: dict[str, float] = {}
    print(f"{plan.peers} peers, {plan.model / 1e9:g}B parameters modelled, {UPLINK_MBIT:.0f} Mbit/s uplinks, "
          f"{plan.local_steps} steps of {plan.step_s:g} s per round, {plan.rounds} rounds")  # fmt: skip
    columns = ("wait fraction", "GB/peer/round", "GB in flight", "(all traffic)", "averaged", "CPU s")
    print(f"{'scheme':<16} " + " ".join(f"{c:>13}" for c in columns[:4]) + f" {columns[4]:>9} {columns[5]:>6}")
    wanted = args.only.split(",") if args.only else [key for key, _, _ in VARIANTS]
    for key, codec, fragments in (variant for variant in VARIANTS if variant[0] in wanted):
        begun = time.process_time()
        clock = trio.testing.MockClock(autojump_threshold=0)
        results, swarm_bytes = trio.run(run, codec, fragments, plan, args.seed, clock=clock)
        wait = max(0.0, statistics.mean(1 - r["compute_s"] / r["elapsed_s"] for r in results))  # (-1e-16: none)
        traffic = swarm_bytes / plan.peers / plan.rounds
        per_round = modelled_round_bytes(codec, plan.model, max(r["group"] for r in results))
        averaged = sum(r["averaged"] for r in results)
        cpu = time.process_time() - begun
        gigabytes = f"{per_round / 1e9:13.3f} {per_round / fragments / 1e9:13.3f} {traffic / 1e9:13.3f}"
        print(f"{key:<16} {wait:13.3f} {gigabytes} {averaged:>6}/{plan.peers} {cpu:6.0f}", flush=True)
        figures[f"wait_fraction_{key}"] = round(wait, 4)
        if fragments == 1:
            figures[f"round_bytes_{key}"] = round(per_round)
        figures[f"peak_round_bytes_{key}"] = round(per_round / fragments)  # in flight at once
    if "round_bytes_int8" in figures and "round_bytes_sparse" in figures:
        figures["round_bytes_int8_vs_sparse"] = round(figures["round_bytes_int8"] / figures["round_bytes_sparse"], 1)
    print(json.dumps({"peers": plan.peers, "model_params": plan.model, "uplink_mbit": UPLINK_MBIT, **figures}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="8 peers, 3 rounds (2 measured)")
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds; the first is not measured")
    parser.add_argument("--peers", type=int, help="peers (default 16, --quick 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help=f"schemes to run, of {','.join(key for key, _, _ in VARIANTS)}")
    main(parser.parse_args())
