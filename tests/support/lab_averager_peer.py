"""One peer averaging with the public ``GroupAverager`` round after round, for the lab's slow-peer
scenario.

Run inside a lab namespace: it joins the DHT (through ``--initial-peer`` unless it is the first),
prints ``ready``, waits for ``go`` on stdin, then runs ``--rounds`` successful rounds. Before each
round its tensor is reset to the seeded values of its index, so every round's exact result is the
average, per shard, of the seeded tensors of the contributors that round's result names (the keys
of all members are given, to map peer IDs to indices). One JSON line per attempt goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import trio

from averaging import GroupAverager, MatchmakingError
from dht.node import DHTConfig, DHTNode
from peer import Identity, PeerAddress, open_peer_host

PREFIX = "lab.slow"


def tensor_of(index: int, values: int) -> torch.Tensor:
    return torch.randn(values, generator=torch.Generator().manual_seed(index))


def exact_error(result, tensor: torch.Tensor, me: int, ids: list[str], values: int) -> float:
    """The largest difference between our averaged tensor and the exact average of what the
    result says took part in each part (a shard that stayed local must hold our own values)."""
    originals = {index: tensor_of(index, values) for index in range(len(ids))}
    error = 0.0
    for shard in range(result.plan.num_shards):
        parts = result.plan.parts(shard)
        by_part = result.part_contributors.get(shard, [None] * len(parts))
        for (start, end), named in zip(parts, by_part, strict=True):
            if shard in result.local_shards:
                exact = originals[me][start:end]
            else:
                contributors = [ids.index(str(peer)) for peer in named]
                exact = sum(originals[c][start:end] for c in contributors) / len(contributors)
            error = max(error, (tensor[start:end] - exact).abs().max().item())
    return error


async def main(args: argparse.Namespace) -> None:
    identity = Identity.load_or_create(args.keys[args.index])
    ids = [str(Identity.load_or_create(key).peer_id) for key in args.keys]
    listen = PeerAddress.parse(args.listen)
    async with open_peer_host(identity, listen=(listen.host, listen.port)) as host:
        initial = [PeerAddress.parse(args.initial_peer)] if args.initial_peer else []
        async with DHTNode.open(host=host, initial_peers=initial, config=DHTConfig(bootstrap_timeout=15)) as dht:
            tensor = tensor_of(args.index, args.values)
            averager = GroupAverager(
                [tensor],
                dht,
                prefix=PREFIX,
                target_group_size=len(args.keys),
                min_group_size=len(args.keys),
                matchmaking_timeout=args.matchmaking_timeout,
                settle_time=0.3,
                allow_state_sharing=False,
            )
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)
            done = 0
            with open(args.out, "w") as out:
                for attempt in range(args.rounds * 3):
                    if done == args.rounds:
                        break
                    tensor.copy_(tensor_of(args.index, args.values))
                    record: dict = {"attempt": attempt, "declared": averager.bandwidth}
                    try:
                        result = (await averager.step()).result
                    except MatchmakingError as error:
                        record["error"] = str(error)
                    else:
                        done += 1
                        reducers = [str(m.peer_id) for m in result.group.reducers]
                        record.update(
                            members=[str(m.peer_id) for m in result.group.members],
                            bandwidths={str(m.peer_id): m.bandwidth for m in result.group.members},
                            shards={peer: size for peer, size in zip(reducers, result.plan.shard_sizes, strict=True)},
                            contributors={reducers[s]: [str(p) for p in c] for s, c in result.contributors.items()},
                            local_shards=[reducers[s] for s in result.local_shards],
                            failed=sorted(str(p) for p in result.failed_peers),
                            seconds=result.seconds,
                            link_rate=result.link_rate,
                            error=exact_error(result, tensor, args.index, ids, args.values),
                        )
                    out.write(json.dumps(record) + "\n")
                    out.flush()
            print("done", flush=True)
            await trio.sleep(math.inf)  # stays up, as a daemon does, until the test ends it


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--keys", nargs="+", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--values", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--matchmaking-timeout", type=float, default=15.0)
    trio.run(main, parser.parse_args())
