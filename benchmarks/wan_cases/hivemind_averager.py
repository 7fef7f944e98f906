"""One Hivemind peer for ``benchmarks/wan.py``'s baseline: a ``hivemind.DHT`` and a
``hivemind.averaging.DecentralizedAverager`` of ``--values`` float32 values (all equal to
``--index``), driven like ``faults_cases/matchmaking_member.py``: it prints ``ready`` (peer 0
first prints ``{"maddrs": [...]}``, the multiaddrs the others join through), then runs one
``averager.step()`` per stdin line and prints one JSON object per step: ``ok``, ``error``,
``size`` (group size), ``seconds`` (the whole step, matchmaking included), ``allreduce_s`` (from
the step entering Hivemind's ``RUNNING_ALLREDUCE`` stage, i.e. the group formed, to its end:
load balancing, the butterfly all-reduce and the in-place update) and ``exact`` (whether the
averaged tensor holds the mean of every peer's index, which it must after a full-group step).

Runs under an interpreter that has ``hivemind`` installed (``wan.py --hivemind PYTHON``), not the
project's; it imports nothing from the project. Settings as in the comparison of issue 14:
``target_group_size`` = ``--group-size``, ``min_matchmaking_time=0.5``, no compression, no state
sharing (peerd's member shares no state either); the rest are Hivemind 1.1.12's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage

STAGE_POLL = 0.002  # seconds between reads of the step's stage (shared memory): its time resolution


def main(args: argparse.Namespace) -> None:
    if os.getpgrp() != os.getpid():
        os.setsid()  # one process group with the DHT, the averager and p2pd: the driver stops them all
    dht = DHT(start=True, host_maddrs=[f"/ip4/{args.address}/tcp/0"], initial_peers=args.initial_peer)
    if not args.initial_peer:
        print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    tensor = torch.full((args.values,), float(args.index))
    averager = DecentralizedAverager(
        [tensor],
        dht,
        start=True,
        prefix="wan",
        target_group_size=args.group_size,
        min_matchmaking_time=0.5,
        allow_state_sharing=False,
    )
    expected = sum(range(args.group_size)) / args.group_size
    print("ready", flush=True)
    while sys.stdin.readline():
        outcome: dict = {"index": args.index, "ok": False}
        started = time.monotonic()
        allreduce_from = None
        try:
            control = averager.step(timeout=args.matchmaking_timeout, wait=False)
            while not control.done():
                if control.stage == AveragingStage.RUNNING_ALLREDUCE and allreduce_from is None:
                    allreduce_from = time.monotonic()
                elif control.stage == AveragingStage.LOOKING_FOR_GROUP:  # a retry: a new group
                    allreduce_from = None
                time.sleep(STAGE_POLL)
            gathered = control.result()
            ended = time.monotonic()
            outcome.update(ok=gathered is not None, size=len(gathered or ()))
            if allreduce_from is not None:
                outcome["allreduce_s"] = ended - allreduce_from
            with averager.get_tensors() as (averaged,):
                ends = (averaged[0].item(), averaged[-1].item())
            outcome["exact"] = all(abs(value - expected) < 1e-6 for value in ends)
        except Exception as error:  # a failed round is a figure of the benchmark, not a crash
            outcome["error"] = f"{type(error).__name__}: {error}"
        outcome["seconds"] = time.monotonic() - started
        print(json.dumps(outcome), flush=True)
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--address", required=True, help="the IPv4 address p2pd listens on")
    parser.add_argument("--initial-peer", action="append", default=[], help="a multiaddr of peer 0")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--values", type=int, default=4_194_304)
    parser.add_argument("--matchmaking-timeout", type=float, default=15.0)
    main(parser.parse_args())
