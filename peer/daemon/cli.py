"""The ``peerd`` command line.

Configuration comes from flags first, then ``PEERD_*`` environment variables (what docker compose
sets), then a TOML file (``--config PATH`` or ``PEERD_CONFIG``; see ``peer/daemon/settings.py``), then
built-in defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import trio

from peer import PeerAddress, __version__
from peer.identity import Identity, IdentityError, default_identity_path

from .arguments import listen_address, peer_address
from .daemon import DaemonConfig, run_daemon
from .dht_commands import add_dht_commands, run_dht_command
from .exit_codes import EXIT_BAD_INPUT, EXIT_CODES, EXIT_IN_USE, EXIT_INTERRUPTED
from .expert_commands import add_expert_arguments, add_serve_experts_command, config_from_args, run_serve_experts
from .help import PeerdArgumentParser, add_everywhere, env_setting
from .identity_lock import IdentityInUseError, lock_identity
from .node_ids import add_difficulty_argument, node_id_for
from .private_swarm import access_from_args, add_access_arguments
from .runner import EXIT_UNREACHABLE, run_joining, until_stopped
from .settings import Settings, SettingsError, parse_bool
from .status_server import fetch_status
from .swarm import add_swarm_arguments, run_swarm


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--data-shard wants I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


def _peer_list(text: str) -> list[PeerAddress]:
    return [peer_address(item) for item in text.replace(",", " ").split()]


DESCRIPTION = """Decentralized volunteer-training peer daemon.

Every flag can also come from a PEERD_* environment variable (shown in each command's --help) or
a TOML file (--config); a flag wins over the variable, the variable over the file."""

EPILOG = "exit status:\n" + "\n".join(
    f"  {code:>3}  {meaning.replace('`', '')}" for code, meaning in EXIT_CODES.items()
)


def build_parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    """The ``peerd`` parser; defaults that no flag overrides come from ``settings`` (by default
    the ``PEERD_*`` environment variables alone). Raises SettingsError for a value it cannot use."""
    settings = settings if settings is not None else Settings()
    env = settings.get
    parser = PeerdArgumentParser(prog="peerd", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"peerd {__version__}")
    _add_config_argument(parser, settings)
    log_levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    env_setting(
        parser.add_argument(
            "--log-level",
            type=str.upper,
            choices=log_levels,
            default=env("LOG_LEVEL", "INFO").upper(),
            help="log detail",
        ),
        "LOG_LEVEL",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keygen = commands.add_parser("keygen", help="create an identity key and print its peer ID", epilog=EPILOG)
    env_setting(
        keygen.add_argument("--identity", type=Path, default=env("IDENTITY"), help="key file to create"),
        "IDENTITY",
        default_text=str(default_identity_path()) if env("IDENTITY") is None else None,
    )

    join = commands.add_parser("join", help="start a peer, join the swarm and (with --task) train", epilog=EPILOG)
    add_join_arguments(join, settings)

    status = commands.add_parser("status", help="show a running peer's /status for humans", epilog=EPILOG)
    env_setting(
        status.add_argument(
            "--status-port",
            type=int,
            default=settings.parsed("STATUS_PORT", int, 8080),
            metavar="PORT",
            help="the peer's --status-port",
        ),
        "STATUS_PORT",
    )
    status.add_argument("--status-host", default="127.0.0.1", help="where that peer serves its status")
    status.add_argument("--json", action="store_true", help="print the raw JSON")

    swarm = commands.add_parser(
        "swarm", help="run N local peers training a task until a target accuracy", epilog=EPILOG
    )
    add_swarm_arguments(swarm)

    add_dht_commands(commands, settings)
    add_serve_experts_command(commands, settings)
    add_everywhere(parser, "--config", "--log-level")
    return parser


def _add_config_argument(parser: argparse.ArgumentParser, settings: Settings | None) -> None:
    """``--config`` on the top-level parser (``settings`` given: its default); ``add_everywhere``
    copies it to every subcommand."""
    default = settings.source if settings is not None else argparse.SUPPRESS
    env_setting(
        parser.add_argument("--config", metavar="FILE", default=default, help="TOML file of settings"), "CONFIG"
    )


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
            type=peer_address,
            action="append",
            default=None,
            metavar="ADDR",
            help="a peer to join through, HOST:PORT or HOST:PORT/PEERID (pinned identity); repeatable"
            " (the variable: space- or comma-separated)",
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
            help="behind NAT: make requests, accept none",
        ),
        "CLIENT_MODE",
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
            default=settings.parsed("DELAY_UPDATES", parse_bool, False),
            help="collaborative mode: average an epoch's gradients while the next one accumulates",
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
            help="inner steps per round in local-updates mode",
        ),
        "LOCAL_STEPS",
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
    shard = settings.parsed("DATA_SHARD", _shard, (0, 1))
    env_setting(
        join.add_argument(
            "--data-shard", type=_shard, default=shard, metavar="I/N", help="train on shard I of N of the task's data"
        ),
        "DATA_SHARD",
        default_text=f"{shard[0]}/{shard[1]}",
    )
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


def _cmd_keygen(args: argparse.Namespace) -> int:
    path = Path(args.identity) if args.identity else default_identity_path()
    if path.exists():
        print(f"peerd: {path} already exists; refusing to overwrite an identity", file=sys.stderr)
        return EXIT_BAD_INPUT
    identity = Identity.generate()
    identity.save(path)
    print(identity.peer_id)
    return 0


async def _join_main(config: DaemonConfig) -> int:
    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(run_daemon, config)
            address = daemon.host.listen_address
            if address is not None:
                print(f"peerd listening on {address}", flush=True)
            else:
                print("peerd running in client mode (accepting no connections)", flush=True)
            if daemon.status_port is not None:
                print(f"peerd status on http://{config.status_host}:{daemon.status_port}/status", flush=True)

    return await until_stopped(serve)


def _experts(args: argparse.Namespace):
    """``(hosting config, built experts)`` for ``--serve-experts``, validated before joining."""
    if not args.experts:
        return None
    config = config_from_args(args)
    return config, config.build_experts()


def _setting_peers(args: argparse.Namespace) -> list[PeerAddress]:
    text, origin = args.initial_peers_setting
    try:
        return _peer_list(text)
    except argparse.ArgumentTypeError as error:
        raise SettingsError(f"{origin}: {error}") from None


def _cmd_join(args: argparse.Namespace) -> int:
    identity_path = Path(args.identity) if args.identity else default_identity_path()
    lock_identity(identity_path)  # before the slow start-up, so a second process fails at once
    shard = None
    if args.task is not None:
        from .tasks import ShardSpec, check_task  # torch loads only in peers that train

        shard = ShardSpec(*args.data_shard)
        check_task(args.task, args.model_size)  # fail now, with a clear message
    if args.delay_updates and (args.task is None or args.mode != "collaborative"):
        raise ValueError("--delay-updates applies to training (--task) in collaborative mode only")
    if args.compression is not None:
        from averaging.compression import get_codec  # torch loads only in peers that train

        get_codec(args.compression)  # an unknown codec is a ValueError: one line, exit 1
    access = access_from_args(args)
    identity = Identity.load_or_create(identity_path)
    node_id = node_id_for(identity, identity_path, args.node_id_difficulty)
    host, port = args.listen
    config = DaemonConfig(
        identity=identity,
        listen_host=host,
        listen_port=port,
        initial_peers=args.initial_peer if args.initial_peer is not None else _setting_peers(args),
        run_id=args.run_id,
        node_id=node_id,
        node_id_difficulty=args.node_id_difficulty,
        access=access,
        bootstrap_timeout=args.bootstrap_timeout,
        client_mode=args.client_mode,
        task=args.task,
        model_size=args.model_size,
        mode=args.mode,
        delay_updates=args.delay_updates,
        compression=args.compression,
        aggregation=args.aggregation,
        device=args.device,
        shard=shard,
        target_batch_size=args.target_batch_size,
        local_steps=args.local_steps,
        status_host=args.status_host,
        status_port=args.status_port,
        experts=_experts(args),
    )
    return run_joining(_join_main, config)


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        status = json.loads(fetch_status(args.status_port, args.status_host))
    except OSError as error:
        print(f"peerd: no peer answers on {args.status_host}:{args.status_port} ({error})", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    width = max(len(key) for key in status)
    for key, value in status.items():
        print(f"{key.replace('_', ' '):<{width}}  {value if value is not None else '-'}")
    return 0


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over ``PEERD_*`` variables over the config file; raises SettingsError for a bad file
    or value (argparse exits on bad flags, as usual)."""
    try:
        settings = Settings.load(_config_path(argv))
    except SettingsError:  # PEERD_CONFIG may name a bad file that an abbreviated --conf overrides
        named = build_parser(Settings(environ={})).parse_args(argv).config
        if named is None or named == _config_path(argv):
            raise
        settings = Settings.load(named)
    args = build_parser(settings).parse_args(argv)
    if args.config != settings.source:  # e.g. an abbreviated --conf that the early look missed
        settings = Settings.load(args.config)
        args = build_parser(settings).parse_args(argv)
    settings.check_all_known()  # every setting has been looked up by now
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before or after a command's own signal handling
        print("peerd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    try:
        args = parse_command_line(argv)
    except SettingsError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.basicConfig(
        level=getattr(logging, args.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "keygen":
            return _cmd_keygen(args)
        if args.command == "join":
            return _cmd_join(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "swarm":
            return run_swarm(args)
        if args.command == "dht":
            return run_dht_command(args)
        if args.command == "serve-experts":
            return run_serve_experts(args)
    except IdentityInUseError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_IN_USE
    except (IdentityError, ValueError) as error:  # TaskError is a ValueError
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command}")


def _config_path(argv: list[str] | None) -> str | None:
    """``--config FILE`` from the command line (the parser's defaults depend on it, so it is read
    before the parser is built)."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--config")
    known, _rest = early.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.config


if __name__ == "__main__":
    sys.exit(main())
