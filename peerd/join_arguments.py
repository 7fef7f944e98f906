"""The ``peerd join`` flags, and the settings among them that only ``join`` parses.

A setting that only ``join`` uses (``PEERD_INITIAL_PEERS``, ``PEERD_DATA_SHARD``) is parsed when
``join`` runs, not when the parser is built, so that a bad value breaks ``join`` with a message
naming the variable and never ``peerd status`` or another command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peer import PeerAddress
from peer.identity import default_identity_path

from .arguments import listen_address, peer_list
from .expert_commands import add_expert_arguments
from .help import env_setting
from .node_ids import add_difficulty_argument
from .private_swarm import add_access_arguments
from .settings import Settings, SettingsError, parse_bool

__all__ = ["add_join_arguments", "data_shard", "data_shard_from_args", "initial_peers_from_args"]

AUTO = "auto"


def data_shard(text: str) -> tuple[int, int] | str:
    """``I/N`` (0 <= I < N) or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    index, _, count = text.partition("/")
    # ASCII digits only: str.isdigit also accepts superscripts, which int() refuses
    if not (_number(index) and _number(count) and 0 <= int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--data-shard wants I/N with 0 <= I < N, or auto, got {text!r}")
    return int(index), int(count)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def data_shard_from_args(args: argparse.Namespace) -> tuple[int, int] | str:
    """The flag's value, else the setting's (``auto`` by default); SettingsError names the
    variable or file key of a bad setting."""
    if args.data_shard is not None:
        return args.data_shard
    text, origin = args.data_shard_setting
    try:
        return data_shard(text)
    except argparse.ArgumentTypeError as error:
        raise SettingsError(f"{origin}: {error}") from None


def delay_updates_from_args(args: argparse.Namespace) -> bool:
    """Delayed parameter updates: off unless asked for (``--delay-updates``), and only for
    collaborative training; asking for them anywhere else is a ValueError (one line). Off by
    default because a peer with a round in flight starts its next round late, after the group
    formed ahead for it has begun: the lab's swarms fell out of step that way."""
    collaborative = args.task is not None and args.mode == "collaborative"
    if args.delay_updates and not collaborative:
        raise ValueError("--delay-updates applies to training (--task) in collaborative mode only")
    return collaborative and bool(args.delay_updates)


def initial_peers_from_args(args: argparse.Namespace) -> list[PeerAddress]:
    if args.initial_peer is not None:
        return args.initial_peer
    text, origin = args.initial_peers_setting
    try:
        return peer_list(text) if text.strip() else []
    except argparse.ArgumentTypeError as error:
        raise SettingsError(f"{origin}: {error}") from None


def _choice(*allowed: str):
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return text

    return parse


def add_join_arguments(join: argparse.ArgumentParser, settings: Settings) -> None:
    env = settings.get
    listen = settings.parsed("LISTEN", listen_address, listen_address("0.0.0.0:31337"))
    env_setting(
        join.add_argument(
            "--listen",
            type=listen_address,
            default=listen,
            metavar="HOST:PORT",
            help="where to accept peers (port 0: any)",
        ),
        "LISTEN",
        default_text=f"{listen[0]}:{listen[1]}",
    )
    env_setting(
        join.add_argument(
            "--identity",
            type=Path,
            default=env("IDENTITY"),
            help="Ed25519 key file, created on first use; one process per key",
        ),
        "IDENTITY",
        default_text=str(default_identity_path()) if env("IDENTITY") is None else None,
    )
    env_setting(
        join.add_argument(
            "--initial-peer",
            type=peer_list,
            action="extend",
            default=None,
            metavar="ADDR",
            help="a peer to join through, HOST:PORT or HOST:PORT/PEERID (pinned identity); repeatable,"
            " or several separated by commas (the variable: commas or spaces)",
        ),
        "INITIAL_PEERS",
    )
    # Parsed only by ``join``, so that a bad address does not break every other command.
    join.set_defaults(initial_peers_setting=(env("INITIAL_PEERS", "") or "", settings.origin("INITIAL_PEERS")))
    env_setting(
        join.add_argument("--run-id", default=env("RUN_ID", "default"), help="peers only talk within one run"),
        "RUN_ID",
    )
    add_difficulty_argument(join, settings)
    add_access_arguments(join, settings)
    env_setting(
        join.add_argument(
            "--bootstrap-timeout",
            type=float,
            default=settings.parsed("BOOTSTRAP_TIMEOUT", float, 15.0),
            metavar="SECONDS",
            help="exit 2 if no initial peer answers within this",
        ),
        "BOOTSTRAP_TIMEOUT",
    )
    env_setting(
        join.add_argument(
            "--client-mode",
            action=argparse.BooleanOptionalAction,
            default=settings.parsed("CLIENT_MODE", parse_bool, False),
            help="make requests, accept none (not needed behind NAT: relays and hole punching reach such a peer)",
        ),
        "CLIENT_MODE",
    )
    env_setting(
        join.add_argument(
            "--relay",
            action=argparse.BooleanOptionalAction,
            default=settings.parsed("RELAY", parse_bool, True),
            help="relay connections for peers behind NAT while this peer is reachable (limited per circuit)",
        ),
        "RELAY",
    )
    env_setting(
        join.add_argument(
            "--relay-rate",
            type=positive_float,
            default=settings.parsed("RELAY_RATE", positive_float, 32.0),
            metavar="MIB_PER_S",
            help="the most this peer relays per second, all circuits together (each circuit: at most 16)",
        ),
        "RELAY_RATE",
    )
    env_setting(
        join.add_argument(
            "--task",
            default=env("TASK"),
            help="train this task: a built-in name (digits, textlm) or package.module:factory",
        ),
        "TASK",
    )
    env_setting(
        join.add_argument(
            "--model-size",
            default=env("MODEL_SIZE"),
            help="model shape for sized tasks (textlm: tiny, small, base, medium, large, xl; default small)",
        ),
        "MODEL_SIZE",
    )
    env_setting(
        join.add_argument(
            "--delay-updates",
            action=argparse.BooleanOptionalAction,
            default=settings.parsed("DELAY_UPDATES", parse_bool, None),
            help="collaborative mode: average an epoch's gradients while the next one accumulates, its "
            "step landing one epoch late (default: off, averaging and stepping in turn)",
        ),
        "DELAY_UPDATES",
    )
    env_setting(
        join.add_argument(
            "--compression",
            default=env("COMPRESSION"),
            help="codec for averaged gradients or pseudo-gradients: none, float16, scaled_float16, uint8, "
            "blockwise_8bit, adaptive (default: none in collaborative mode, blockwise_8bit in local-updates)",
        ),
        "COMPRESSION",
    )
    aggregations = ("auto", "mean", "centered-clip")
    env_setting(
        join.add_argument(
            "--aggregation",
            choices=aggregations,
            default=settings.parsed("AGGREGATION", _choice(*aggregations), "auto"),
            help="how a reducer aggregates its shard: the weighted mean, or centered-clip (robust to a "
            "hostile minority); auto: centered-clip in a public swarm, mean in a private one",
        ),
        "AGGREGATION",
    )
    modes = ("collaborative", "local-updates")
    env_setting(
        join.add_argument(
            "--mode",
            choices=modes,
            default=settings.parsed("MODE", _choice(*modes), "collaborative"),
            help="gradient averaging, or DiLoCo-style local steps and outer rounds",
        ),
        "MODE",
    )
    env_setting(
        join.add_argument(
            "--local-steps",
            type=int,
            default=settings.parsed("LOCAL_STEPS", int, 20),
            help="inner steps per round in local-updates mode, per peer on average (faster peers take more)",
        ),
        "LOCAL_STEPS",
    )
    env_setting(
        join.add_argument(
            "--uplink-mbit",
            type=positive_float,
            default=settings.parsed("UPLINK_MBIT", positive_float),
            metavar="MBIT_PER_S",
            help="this machine's upload speed: averaging rounds pace their connections to share it, which "
            "moves the same bytes sooner than letting TCP share it (default: TCP shares it)",
        ),
        "UPLINK_MBIT",
    )
    env_setting(
        join.add_argument(
            "--target-batch-size",
            type=int,
            default=settings.parsed("TARGET_BATCH_SIZE", int),
            help="swarm-wide samples per epoch in collaborative mode (default: the task's)",
        ),
        "TARGET_BATCH_SIZE",
    )
    env_setting(
        join.add_argument("--device", default=env("DEVICE"), help="cpu, cuda, cuda:1 ... (default: CUDA if available)"),
        "DEVICE",
    )
    shard_text = env("DATA_SHARD")
    env_setting(
        join.add_argument(
            "--data-shard",
            type=data_shard,
            default=None,
            metavar="I/N|auto",
            help="train on shard I of N of the task's data, or auto: the shard that the fewest live peers"
            " train (chosen at start from their progress records)",
        ),
        "DATA_SHARD",
        default_text=shard_text or "auto",
    )
    # Parsed only by ``join`` (``data_shard_from_args``): a bad value must not break other commands.
    join.set_defaults(data_shard_setting=(shard_text or "auto", settings.origin("DATA_SHARD")))
    env_setting(
        join.add_argument(
            "--status-port",
            type=int,
            default=settings.parsed("STATUS_PORT", int),
            metavar="PORT",
            help="serve /status and /metrics on this port (0: any; default: none)",
        ),
        "STATUS_PORT",
    )
    env_setting(
        join.add_argument(
            "--status-host", default=env("STATUS_HOST", "127.0.0.1"), help="address the status port binds"
        ),
        "STATUS_HOST",
    )
    add_expert_arguments(join, flag="--serve-experts", device=False)
    env_setting(join._option_string_actions["--serve-experts"], "SERVE_EXPERTS")
    join.set_defaults(experts=env("SERVE_EXPERTS"))
