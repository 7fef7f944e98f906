"""A short-lived DHT client for lab tests: ``store`` or ``get`` COUNT records under PREFIX.i in one
process, through the given peer; prints one JSON object ``{"ok": n, "count": COUNT}``.

Run inside a lab namespace (``ip netns exec NS python tests/support/lab_dht_client.py ...``): one process
for a batch of records, where ``peerd dht`` would start one per record."""

from __future__ import annotations

import argparse
import json
import os
import time

import trio

from dht.node import DHTConfig, DHTNode
from peer import LOCAL_DIFFICULTY, PeerAddress

TTL = 900.0  # outlives the longest (slow) churn run


async def main(args: argparse.Namespace) -> dict:
    difficulty = int(os.environ.get("PEERD_NODE_ID_DIFFICULTY", LOCAL_DIFFICULTY))
    async with DHTNode.open(
        initial_peers=[PeerAddress.parse(args.initial_peer)],
        client_mode=True,
        run_id=args.run_id,
        config=DHTConfig(bootstrap_timeout=15.0),
        node_id_difficulty=difficulty,
    ) as node:
        ok = 0
        missing = []
        for index in range(args.count):
            key = f"{args.prefix}.{index}"
            with trio.move_on_after(10):
                if args.action == "store":
                    ok += bool(await node.store(key, {"index": index}, time.time() + TTL))
                else:
                    found = await node.get(key)
                    if found is not None and found.value == {"index": index}:
                        ok += 1
                        continue
            if args.action == "get":
                missing.append(key)
        return {"ok": ok, "count": args.count, "missing": missing}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["store", "get"])
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--prefix", default="lab-record")
    parser.add_argument("--count", type=int, default=100)
    print(json.dumps(trio.run(main, parser.parse_args())))
