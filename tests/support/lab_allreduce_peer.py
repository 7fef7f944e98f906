"""One member of an all-reduce group as its own process, for the lab's group-fault scenario.

Run inside a lab namespace. It listens on ``--listen``, builds the group from every member's key
file and address (the test made the keys, so all members agree on the group without matchmaking),
prints ``ready``, waits for ``go`` on stdin, runs one round with the seeded tensors of its index and
writes the result as JSON to ``--out``. ``--fault`` makes it misbehave at one point of the round,
where a death is a real ``os._exit``: the kernel closes its sockets as when a process is killed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import trio

from averaging.allreduce import AllReduceService, RoundSettings
from averaging.group import AveragingMode, GroupInfo, GroupMember
from averaging.partition import DEFAULT_PART_SIZE
from peer import Identity, PeerAddress, open_peer_host
from tests.support.round_faults import (
    CancelsMidRound,
    DiesWhileReducing,
    DiesWhileReplying,
    DiesWhileSending,
    FreezesWhileSending,
    StallsWhileReducing,
    StallsWhileSending,
    dying_as_a_process,
    exit_process,
)
from tests.support.stream_faults import Fault, FaultyHost

SHAPES = [(37, 5), (100,), (3, 3, 3)]  # 312 values: about 4 parts per shard with part_size=16
PART_SIZE = 16
WEIGHTS = [1.0, 2.0, 1.0, 0.5, 1.5]


def tensors_of(index: int, values: int | None = None) -> list[torch.Tensor]:
    """The seeded tensors of member ``index``: SHAPES, or one tensor of ``values`` floats."""
    generator = torch.Generator().manual_seed(index)
    shapes = SHAPES if values is None else [(values,)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


FAULTS = {
    "none": None,
    "dies_before": Fault,  # dies when told to go, before sending anything
    "dies_sending": dying_as_a_process(DiesWhileSending),
    "slow_send": StallsWhileSending,
    "freezes_sending": FreezesWhileSending,
    "dies_reducing": dying_as_a_process(DiesWhileReducing),
    "dies_replying": dying_as_a_process(DiesWhileReplying),
    "slow_reduce": StallsWhileReducing,
    "cancel": CancelsMidRound,
}


async def main(args: argparse.Namespace) -> None:
    identity = Identity.load_or_create(args.keys[args.index])
    members = tuple(
        GroupMember(Identity.load_or_create(key).peer_id, PeerAddress.parse(address), 1.0, AveragingMode.NODE)
        for key, address in zip(args.keys, args.addresses, strict=True)
    )
    group = GroupInfo(bytes.fromhex(args.group_id), members)
    listen = PeerAddress.parse(args.addresses[args.index])
    fault_class = FAULTS[args.fault]
    fault = fault_class() if fault_class else None
    async with open_peer_host(identity, listen=(listen.host, listen.port)) as host:
        service = AllReduceService(host if fault is None else FaultyHost(host, fault))
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        if args.fault == "dies_before":
            exit_process()
        tensors = tensors_of(args.index, args.values)
        started = time.monotonic()
        outcome: dict = {"index": args.index, "cancelled": False}
        with trio.CancelScope() as scope:
            if fault is not None:
                fault.run_scope = scope
            settings = RoundSettings(
                sender_timeout=args.sender_timeout,
                reducer_timeout=args.reducer_timeout,
                part_size=PART_SIZE if args.values is None else DEFAULT_PART_SIZE,
            )
            result = await service.run(group, tensors, weight=WEIGHTS[args.index], settings=settings)
            outcome.update(
                flat=torch.cat([t.reshape(-1) for t in tensors]).tolist() if args.values is None else None,
                contributors={str(k): [str(p) for p in v] for k, v in result.contributors.items()},
                part_contributors={
                    str(k): [[str(p) for p in part] for part in v] for k, v in result.part_contributors.items()
                },
                local_shards=sorted(result.local_shards),
                failed=sorted(str(p) for p in result.failed_peers),
            )
        outcome["cancelled"] = scope.cancelled_caught
        outcome["seconds"] = time.monotonic() - started
        outcome["finished_at"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
        with open(args.out + ".part", "w") as file:  # whole or not at all: the test waits for it to exist
            json.dump(outcome, file)
        os.replace(args.out + ".part", args.out)
        # Every member stays up until the test ends it, as a daemon does after a round: the round
        # returning here does not mean that the replies this peer sends as a reducer were delivered.
        await trio.sleep(math.inf)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--keys", nargs="+", required=True)
    parser.add_argument("--addresses", nargs="+", required=True)
    parser.add_argument("--group-id", required=True)
    parser.add_argument("--fault", choices=list(FAULTS), default="none")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sender-timeout", type=float, default=2.0)
    parser.add_argument("--reducer-timeout", type=float, default=4.0)
    parser.add_argument("--values", type=int, default=None, help="one tensor this long instead of SHAPES")
    trio.run(main, parser.parse_args())
