"""A short-lived peer for NAT lab tests: connects to ADDRESS (direct or relayed) and calls
``peer.ping`` COUNT times; prints one JSON object ``{"ok": n, "relayed_via": ..., "error": ...}``.

Run inside a lab namespace (``ip netns exec NS python tests/support/lab_nat_client.py ADDRESS``)."""

from __future__ import annotations

import argparse
import json
import os

import trio

from peer import LOCAL_DIFFICULTY, ConnectError, Identity, PeerAddress, RPCError, open_peer_host
from peer.relay import RelayClient


async def main(args: argparse.Namespace) -> dict:
    difficulty = int(os.environ.get("PEERD_NODE_ID_DIFFICULTY", LOCAL_DIFFICULTY))
    address = PeerAddress.parse(args.address)
    identity = Identity.generate()
    async with open_peer_host(identity, listen=None, run_id=args.run_id, node_id_difficulty=difficulty) as host:
        RelayClient(host)  # dials relayed addresses
        ok, error = 0, None
        try:
            with trio.fail_after(20):
                connection = await host.connect(address)
                for _ in range(args.count):
                    reply = await connection.call("peer.ping", timeout=5)
                    ok += reply.body.get("peer_id") == str(address.peer_id)
        except (ConnectError, RPCError, trio.TooSlowError) as failure:
            error = repr(failure)
        relay = host.connection_to(address.peer_id) if address.peer_id else None
        via = str(relay.relayed_via) if relay is not None and relay.relayed_via else None
        return {"ok": ok, "count": args.count, "relayed_via": via, "error": error}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--count", type=int, default=3)
    print(json.dumps(trio.run(main, parser.parse_args())))
