"""``peerd serve-experts`` and the expert flags ``peerd join --serve-experts`` shares.

``peerd/cli.py`` adds the subcommand with ``add_serve_experts_command`` and runs it with
``run_serve_experts``; ``peerd join`` adds ``add_expert_arguments`` (flags without the network
options) and hosts experts on its own peer through ``moe.hosting.host_experts``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import trio

from dht import DHTNode
from moe.hosting import DEFAULT_MAX_BATCH_SIZE, HEARTBEAT_PERIOD, ExpertHostingConfig, host_experts
from peer import Identity, NodeIDProof, PeerAddress

from .arguments import listen_address, peer_list
from .exit_codes import EXIT_BAD_INPUT
from .identity_lock import lock_identity
from .node_ids import add_difficulty_argument, node_id_for
from .ports import naming_port
from .runner import run_joining, until_stopped
from .settings import Settings

__all__ = [
    "add_expert_arguments",
    "add_serve_experts_command",
    "config_from_args",
    "run_serve_experts",
]

log = logging.getLogger("peerd.moe")


def add_expert_arguments(
    parser: argparse.ArgumentParser, *, flag: str | None = "--experts", device: bool = True
) -> None:
    """The expert flags (shared by ``serve-experts`` and ``join``, which declares the pattern flag
    ``--serve-experts`` among its settings, ``flag=None`` here, and has its own ``--device`` for
    training and experts alike)."""
    if flag is not None:
        parser.add_argument(flag, dest="experts", metavar="PATTERN", help="expert IDs to host, e.g. 'ffn.[0:4].[0:4]'")
    parser.add_argument("--expert-type", default="ffn", help="ffn, transformer or package.module:Class")
    parser.add_argument("--hidden-dim", type=int, default=256, help="width of each expert")
    parser.add_argument(
        "--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, help="samples per batched expert call"
    )
    parser.add_argument("--expert-optimizer", choices=["adam", "sgd"], default="adam", help="updates the experts")
    parser.add_argument("--expert-lr", type=float, default=1e-3, help="the expert optimizer's learning rate")
    if device:
        parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="load experts from and save them to DIR")
    parser.add_argument(
        "--heartbeat-period",
        type=float,
        default=HEARTBEAT_PERIOD,
        metavar="SECONDS",
        help="re-announce the experts in the DHT this often",
    )
    parser.add_argument("--seed", type=int, default=None, help="initialise experts reproducibly")


def add_serve_experts_command(subparsers: Any, settings: Settings | None = None) -> argparse.ArgumentParser:
    """Add ``serve-experts`` to an ``add_subparsers()`` object; returns the subparser (``settings``:
    where the run's node-ID difficulty comes from when no flag gives it)."""
    parser = subparsers.add_parser("serve-experts", help="host mixture-of-experts experts for the swarm")
    add_expert_arguments(parser)
    listen = parser.add_argument(
        "--listen", type=listen_address, default=("0.0.0.0", 0), metavar="HOST:PORT", help="where to accept calls"
    )
    listen.default_text = "0.0.0.0:0 (any free port)"
    parser.add_argument("--announce-host", default=None, help="host to advertise (default: the listen host, "
                        "or for 0.0.0.0 the local address that reaches the first initial peer)")  # fmt: skip
    parser.add_argument(
        "--initial-peer", type=peer_list, action="extend", default=[], metavar="ADDR", help="a peer of the swarm"
    )
    parser.add_argument("--identity", type=Path, default=None, help="key file (default: a new identity)")
    parser.add_argument("--run-id", default="default", help="the swarm's run ID")
    add_difficulty_argument(parser, settings)
    return parser


def config_from_args(args: argparse.Namespace) -> ExpertHostingConfig:
    return ExpertHostingConfig(
        pattern=args.experts,
        expert_type=args.expert_type,
        hidden_dim=args.hidden_dim,
        max_batch_size=args.max_batch_size,
        optimizer=args.expert_optimizer,
        lr=args.expert_lr,
        device=args.device,
        checkpoint_dir=args.checkpoint_dir,
        heartbeat_period=args.heartbeat_period,
        seed=args.seed,
    )


def _announce_host(args: argparse.Namespace) -> str | None:
    host = args.listen[0]
    if args.announce_host:
        return args.announce_host
    if host not in ("0.0.0.0", "::", ""):
        return None
    if not args.initial_peer:
        return "127.0.0.1"
    # The local address of the route to the first initial peer (UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((args.initial_peer[0].host, args.initial_peer[0].port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


async def _serve_main(
    args: argparse.Namespace, config: ExpertHostingConfig, experts: dict, identity: Identity, node_id: NodeIDProof
) -> int:
    async def serve() -> None:
        async with contextlib.AsyncExitStack() as stack:
            with naming_port("experts", *args.listen, "--listen HOST:PORT"):
                node = await stack.enter_async_context(
                    DHTNode.open(
                        identity=identity,
                        listen=args.listen,
                        initial_peers=args.initial_peer,
                        run_id=args.run_id,
                        node_id_difficulty=args.node_id_difficulty,
                        node_id=node_id,
                    )
                )
            announce = _announce_host(args)
            address = node.host.listen_address
            if announce is not None:  # advertise a reachable host instead of the wildcard we bound
                address = PeerAddress(announce, address.port, node.peer_id)
            async with trio.open_nursery() as nursery:
                uids = await nursery.start(
                    lambda task_status: host_experts(
                        node.host, node, config, experts=experts, announce_address=address, task_status=task_status
                    )
                )
                first, last = uids[0], uids[-1]
                print(f"peerd serving {len(uids)} experts {first}..{last} at {address}", flush=True)

    return await until_stopped(serve)


def run_serve_experts(args: argparse.Namespace) -> int:
    """Run ``serve-experts`` with parsed ``args``; returns the exit status."""
    if not args.experts:
        print("peerd: serve-experts needs --experts PATTERN, e.g. 'ffn.[0:4].[0:4]'", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.identity:
        lock_identity(args.identity)  # IdentityInUseError: EXIT_IN_USE (cli.py)
    try:
        config = config_from_args(args)
        experts = config.build_experts()
    except (ValueError, ImportError) as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # The key and its node-ID proof (possibly seconds of solving) before the loop starts.
    identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
    node_id = node_id_for(identity, args.identity, args.node_id_difficulty)
    return run_joining(_serve_main, args, config, experts, identity, node_id)
