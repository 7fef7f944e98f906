"""One training-like peer for the leader-death case: a DHT node and a ``GroupAverager`` that runs
one matchmaking + all-reduce step per stdin line (``step`` or ``step lead-and-die``).

With ``lead-and-die`` the process stops right after its group formed: once ``form_group`` has
returned (so the followers hold the group, its leader first), it prints ``{"formed": true,
"led": ...}`` and waits; the benchmark SIGKILLs it on that line. Otherwise it prints one JSON
object per step: ``ok``, ``error``, ``size`` (group size), ``failed``, ``seconds``, ``allreduce_s`` (from
the group forming to the round's end), ``finished_at``. ``benchmarks/wan.py`` uses it as well.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from averaging.averager import GroupAverager  # noqa: E402
from averaging.step_ahead import StepAhead  # noqa: E402
from dht.node import DHTConfig, DHTNode  # noqa: E402
from peer import LOCAL_DIFFICULTY, Identity, PeerAddress  # noqa: E402

# Long enough for the followers' join handlers to write the group to them (a LAN round trip is
# well under a millisecond); short enough that the leader is gone before any part reaches it.
ANSWER_FLUSH = 0.05


class StopsAfterForming:
    """Stands in for the all-reduce service on the victim: the group has formed, the leader
    announces it on stdout and never takes part in the round."""

    def __init__(self, me):
        self.me = me

    async def run(self, group, *args, **kwargs):
        await trio.sleep(ANSWER_FLUSH)
        led = group.members[0].peer_id == self.me  # a leader puts itself first
        print(json.dumps({"formed": True, "led": led, "size": len(group.members)}), flush=True)
        await trio.sleep(math.inf)


async def main(args: argparse.Namespace) -> None:
    listen = PeerAddress.parse(args.listen)
    difficulty = int(os.environ.get("PEERD_NODE_ID_DIFFICULTY", LOCAL_DIFFICULTY))
    async with DHTNode.open(
        identity=Identity.load_or_create(args.key),
        listen=(listen.host, listen.port),
        initial_peers=args.initial_peer,
        run_id=args.run_id,
        node_id_difficulty=difficulty,
        config=DHTConfig(bootstrap_timeout=15.0),
    ) as node:
        averager = GroupAverager(
            [torch.full((args.values,), float(args.index))],
            node,
            prefix="faultbench",
            target_group_size=args.group_size,
            min_group_size=2,
            matchmaking_timeout=args.matchmaking_timeout,
            sender_timeout=args.sender_timeout,
            reducer_timeout=args.reducer_timeout,
            settle_time=args.settle,
            allow_state_sharing=False,
            aggregation=args.aggregation,
            uplink=args.uplink_mbit * 1e6 / 8 if args.uplink_mbit else None,
        )
        # As the public ``Averager`` steps: once steps come in a rhythm, each finds its group formed ahead.
        stepper = StepAhead(averager, node.host) if args.step_ahead else averager
        print("ready", flush=True)
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            if "lead-and-die" in line.split():
                # the averager has no hook between forming and averaging; this is test code
                averager._service = StopsAfterForming(node.host.peer_id)
            outcome: dict = {"index": args.index, "ok": False}
            started = time.monotonic()
            try:
                averaged = await stepper.step()
                failed = sorted(map(str, averaged.result.failed_peers))
                outcome.update(ok=True, size=len(averaged.group.members), failed=failed)
                outcome["allreduce_s"] = averaged.timing.allreduce_s
            except Exception as error:  # a failed round is the figure being measured
                outcome["error"] = f"{type(error).__name__}: {error}"
            outcome["seconds"] = time.monotonic() - started
            outcome["finished_at"] = time.monotonic()
            print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--values", type=int, default=100_000)
    parser.add_argument("--matchmaking-timeout", type=float, default=4.0)
    parser.add_argument("--sender-timeout", type=float, default=2.0)
    parser.add_argument("--reducer-timeout", type=float, default=4.0)
    parser.add_argument("--aggregation", default="auto", choices=["auto", "mean", "centered-clip"])
    parser.add_argument("--uplink-mbit", type=float, default=None, help="declare this uplink (GroupAverager uplink=)")
    parser.add_argument(
        "--step-ahead", action="store_true", help="step as the public Averager does (next group formed ahead)"
    )
    parser.add_argument(
        "--settle",
        type=lambda text: None if text == "default" else float(text),
        default=0.2,
        help="a LAN: declarations land within milliseconds ('default': matchmaking's own)",
    )
    trio.run(main, parser.parse_args())
