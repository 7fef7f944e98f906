"""One member of a fixed all-reduce group that runs a round per stdin line ``GROUP_ID FAULT``.

The lab's ``tests/support/lab_allreduce_peer.py`` runs one round and then waits to be killed; the fault
benchmark needs a no-fault round first (the baseline) and the faulty round second in the same
processes, so starting five interpreters once instead of twice. The faults, tensors and weights are
that script's, imported, not copied. Prints ``ready``, then one JSON object per round:
``ok``, ``error``, ``failed`` (peer IDs), ``seconds`` and ``finished_at`` (CLOCK_MONOTONIC, one
clock for every process on the machine, so the benchmark can subtract its kill time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from averaging.allreduce import AllReduceService, RoundSettings  # noqa: E402
from averaging.group import AveragingMode, GroupInfo, GroupMember  # noqa: E402
from averaging.partition import DEFAULT_PART_SIZE  # noqa: E402
from peer import Identity, PeerAddress, open_peer_host  # noqa: E402
from tests.support.lab_allreduce_peer import FAULTS, WEIGHTS, tensors_of  # noqa: E402
from tests.support.round_faults import exit_process  # noqa: E402
from tests.support.stream_faults import Fault, FaultyHost  # noqa: E402


class RoundFault(Fault):
    """The fault of the current round (None: pass everything on); the service and its router
    registration live as long as the process, so the fault is swapped rather than the host."""

    current: Fault | None = None

    async def send(self, stream, body, payload):
        if self.current is None:
            await stream.inner.send(body, payload)
        else:
            await self.current.send(stream, body, payload)


async def main(args: argparse.Namespace) -> None:
    identity = Identity.load_or_create(args.keys[args.index])
    members = tuple(
        GroupMember(Identity.load_or_create(key).peer_id, PeerAddress.parse(address), 1.0, AveragingMode.NODE)
        for key, address in zip(args.keys, args.addresses, strict=True)
    )
    listen = PeerAddress.parse(args.addresses[args.index])
    fault = RoundFault()
    tensors = tensors_of(args.index, args.values)
    async with open_peer_host(identity, listen=(listen.host, listen.port)) as host:
        service = AllReduceService(FaultyHost(host, fault))
        print("ready", flush=True)
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            group_id, fault_name = line.split()
            if fault_name == "dies_before":
                exit_process()
            fault_class = FAULTS[fault_name]
            fault.current = fault_class() if fault_class else None
            group = GroupInfo(bytes.fromhex(group_id), members)
            outcome: dict = {"index": args.index, "ok": False}
            started = time.monotonic()
            try:
                settings = RoundSettings(
                    sender_timeout=args.sender_timeout,
                    reducer_timeout=args.reducer_timeout,
                    part_size=DEFAULT_PART_SIZE,
                )
                result = await service.run(
                    group, [t.clone() for t in tensors], weight=WEIGHTS[args.index], settings=settings
                )
                outcome.update(ok=True, failed=sorted(str(p) for p in result.failed_peers))
            except Exception as error:  # a failed round is a result, reported to the benchmark
                outcome["error"] = f"{type(error).__name__}: {error}"
            outcome["seconds"] = time.monotonic() - started
            outcome["finished_at"] = time.monotonic()
            print(json.dumps(outcome), flush=True)
        # stdin closed: the benchmark is done with us


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--keys", nargs="+", required=True)
    parser.add_argument("--addresses", nargs="+", required=True)
    parser.add_argument("--values", type=int, required=True)
    parser.add_argument("--sender-timeout", type=float, default=3.0)
    parser.add_argument("--reducer-timeout", type=float, default=20.0)
    trio.run(main, parser.parse_args())
