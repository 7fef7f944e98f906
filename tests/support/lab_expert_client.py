"""A short-lived expert caller for NAT lab tests: joins the DHT through ``--initial-peer`` as a
client, waits until ``UID`` is announced at a relayed address (its host is behind NAT), calls its
forward through the relay and prints one JSON object ``{"address", "relayed_via", "shape"}``.

Run inside a lab namespace (``ip netns exec NS python tests/support/lab_expert_client.py ...``)."""

from __future__ import annotations

import argparse
import json
import os

import torch
import trio

from dht.node import DHTConfig, DHTNode
from moe.announce import get_expert_addresses
from moe.client import call_forward
from peer import LOCAL_DIFFICULTY, PeerAddress
from peer.relay import RelayClient


async def main(args: argparse.Namespace) -> dict:
    difficulty = int(os.environ.get("PEERD_NODE_ID_DIFFICULTY", LOCAL_DIFFICULTY))
    async with DHTNode.open(
        initial_peers=[PeerAddress.parse(args.initial_peer)],
        client_mode=True,
        run_id=args.run_id,
        config=DHTConfig(bootstrap_timeout=15.0),
        node_id_difficulty=difficulty,
    ) as node:
        RelayClient(node.host)  # dials relayed addresses
        with trio.fail_after(args.timeout):
            while True:
                address = (await get_expert_addresses(node, [args.uid]))[args.uid]
                if address is not None and address.relay is not None:
                    break
                await trio.sleep(0.5)  # the expert's host re-announces once it holds a relay
            outputs = await call_forward(node.host, address, args.uid, torch.randn(3, args.hidden_dim))
        connection = node.host.connection_to(address.peer_id)
        via = str(connection.relayed_via) if connection is not None and connection.relayed_via else None
        return {"address": str(address), "relayed_via": via, "shape": list(outputs.shape)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("uid")
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--hidden-dim", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=60.0)
    print(json.dumps(trio.run(main, parser.parse_args())))
