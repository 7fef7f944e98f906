"""``peerd dht store|get``: join as a short-lived client, do one operation, print JSON.

Exit status: 0 done; 1 key not found (get) or store refused by every peer; 2 the swarm cannot be
reached. ``peerd/cli.py`` wires these in with ``add_dht_commands(subparsers)`` and dispatches
``args.command == "dht"`` to ``run_dht_command(args)``.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

import trio

from dht.node import DHTBootstrapError, DHTConfig, DHTNode
from dht.records import MAX_TTL, DHTValue
from peer import Identity, NodeIDProof
from peer.identity import default_identity_path

from .arguments import peer_list
from .node_ids import add_difficulty_argument, node_id_for
from .runner import EXIT_UNREACHABLE
from .settings import Settings

__all__ = ["add_dht_commands", "run_dht_command", "EXIT_NOT_FOUND", "EXIT_UNREACHABLE"]

EXIT_NOT_FOUND = 1
DEFAULT_TTL = 300.0  # five minutes: long enough to look at, short enough not to litter the swarm


def _ttl(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_TTL:
        raise argparse.ArgumentTypeError(f"--ttl must be in (0, {MAX_TTL:.0f}] seconds")
    return value


def _literal(text: str) -> Any:
    """JSON if it parses (numbers, lists, objects, quoted strings), otherwise the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def add_dht_commands(
    subparsers: argparse._SubParsersAction, settings: Settings | None = None
) -> argparse.ArgumentParser:
    """Add ``dht store`` and ``dht get`` to the ``peerd`` parser's subcommands (``settings``: where
    the run's node-ID difficulty comes from when no flag gives it)."""
    dht = subparsers.add_parser("dht", help="store or get one DHT record as a short-lived client")
    actions = dht.add_subparsers(dest="dht_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--initial-peer", type=peer_list, action="extend", required=True, metavar="ADDR")
    common.add_argument("--run-id", default="default", help="the swarm's run ID")
    common.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS", help="joining deadline")
    add_difficulty_argument(common, settings)
    common.add_argument(
        "--identity",
        type=Path,
        default=None,
        help="key file whose node-ID solution is kept (default: client.key beside the default identity, so"
        " the puzzle is solved once, not on every command)",
    )

    store = actions.add_parser("store", parents=[common], help="store KEY = VALUE (JSON or text)")
    store.add_argument("key", type=_literal, metavar="KEY")
    store.add_argument("value", type=_literal, metavar="VALUE")
    store.add_argument("--ttl", type=_ttl, default=DEFAULT_TTL, metavar="SECONDS")
    store.add_argument("--subkey", type=_literal, default=None, metavar="SK")

    get = actions.add_parser("get", parents=[common], help="print the value under KEY")
    get.add_argument("key", type=_literal, metavar="KEY")
    get.add_argument("--latest", action="store_true", help="ask all k nearest peers for the newest value")
    return dht


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, DHTValue):
        return {"value": _jsonable(obj.value), "expiration_time": obj.expiration_time}
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else json.dumps(_jsonable(k)): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(item) for item in obj]
    if isinstance(obj, bytes):
        return {"base64": base64.b64encode(obj).decode()}
    return obj


async def _run(args: argparse.Namespace, identity: Identity, node_id: NodeIDProof) -> tuple[int, dict[str, Any]]:
    config = DHTConfig(bootstrap_timeout=args.timeout)
    async with DHTNode.open(
        identity=identity,
        initial_peers=args.initial_peer,
        client_mode=True,
        run_id=args.run_id,
        config=config,
        node_id_difficulty=args.node_id_difficulty,
        node_id=node_id,
    ) as node:
        if args.dht_command == "store":
            expiration = time.time() + args.ttl
            stored = await node.store(args.key, args.value, expiration, subkey=args.subkey)
            result = {"key": _jsonable(args.key), "stored": stored, "expiration_time": expiration}
            if args.subkey is not None:
                result["subkey"] = _jsonable(args.subkey)
            return (0 if stored else EXIT_NOT_FOUND), result
        found = await node.get(args.key, latest=args.latest)
        if found is None:
            return EXIT_NOT_FOUND, {"key": _jsonable(args.key), "found": False}
        return 0, {"key": _jsonable(args.key), "found": True, **_jsonable(found)}


def run_dht_command(args: argparse.Namespace) -> int:
    """Run ``peerd dht store|get``; prints one JSON object (stdout) or an error (stderr)."""
    try:
        # The key and its node-ID proof (possibly seconds of solving) before the loop starts.
        path = args.identity or default_identity_path().with_name("client.key")
        identity = Identity.load_or_create(path)
        node_id = node_id_for(identity, path, args.node_id_difficulty)
        status, result = trio.run(_run, args, identity, node_id)
    except DHTBootstrapError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (TypeError, ValueError) as error:  # unserialisable or oversized input
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_NOT_FOUND
    print(json.dumps(result))
    return status
