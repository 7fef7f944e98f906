"""One peer's matchmaking for one round as its own process, for the lab's leader-death scenario.

Run inside a lab namespace: it joins the DHT (through ``--initial-peer`` unless it is the first),
prints ``ready``, waits for ``go`` on stdin, declares itself and tries to form a group; the group's
members (or the error) go to ``--out`` as JSON. With ``--dies-when-leading`` it dies (``os._exit``)
the moment it has formed a group as its leader, before any follower hears of it."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import trio

from averaging.group import AveragingMode
from averaging.matchmaking import Declaration, Matchmaker, MatchmakingError
from dht.node import DHTConfig, DHTNode
from peer import Identity, PeerAddress, open_peer_host

PREFIX = "lab.leader"
SCHEMA = "lab-schema"


class DiesAfterForming:
    """A router whose unary handlers die once they have an answer (the leader's join handler
    answers only when its group has formed)."""

    def __init__(self, inner):
        self._inner = inner

    def add_unary(self, name, handler, **options):
        async def dies_with_the_answer(request):
            await handler(request)
            sys.stdout.flush()
            os._exit(17)

        self._inner.add_unary(name, dies_with_the_answer, **options)


async def main(args: argparse.Namespace) -> None:
    identity = Identity.load_or_create(args.key)
    listen = PeerAddress.parse(args.listen)
    async with open_peer_host(identity, listen=(listen.host, listen.port)) as host:
        initial = [PeerAddress.parse(args.initial_peer)] if args.initial_peer else []
        async with DHTNode.open(host=host, initial_peers=initial, config=DHTConfig(bootstrap_timeout=15)) as dht:
            router = DiesAfterForming(host.router) if args.dies_when_leading else None
            matchmaker = Matchmaker(host, dht, PREFIX, router=router)
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)
            started = time.monotonic()
            me = Declaration(host.peer_id, host.listen_address, 1.0, AveragingMode.NODE, SCHEMA, 0)
            outcome: dict = {"peer": str(host.peer_id)}
            try:
                match = await matchmaker.form_group(
                    me, target_group_size=5, min_group_size=2, timeout=args.timeout, settle_time=args.settle
                )
                group = match.group
                outcome["group"] = [str(m.peer_id) for m in group.members]
            except MatchmakingError as error:
                outcome["error"] = str(error)
            outcome["seconds"] = time.monotonic() - started
            with open(args.out + ".part", "w") as file:  # whole or not at all: the test waits for it to exist
                json.dump(outcome, file)
            os.replace(args.out + ".part", args.out)
            await trio.sleep(math.inf)  # stays up, as a daemon does, until the test ends it


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--key", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--dies-when-leading", action="store_true")
    trio.run(main, parser.parse_args())
