"""The ``peerd`` command line.

Configuration comes from flags first, then ``PEERD_*`` environment variables (what docker compose
sets), then a TOML file (``--config PATH`` or ``PEERD_CONFIG``; see ``peerd/settings.py``), then
built-in defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import trio

from peer import __version__
from peer.identity import Identity, IdentityError, check_key_path, default_identity_path

from .daemon import run_daemon
from .daemon_config import AveragingConfig, DaemonConfig, NetworkConfig, StatusConfig, TrainingConfig
from .dht_commands import add_dht_commands, run_dht_command
from .exit_codes import EXIT_BAD_INPUT, EXIT_CODES, EXIT_IN_USE, EXIT_INTERRUPTED, EXIT_RANK_FAILED
from .expert_commands import add_serve_experts_command, config_from_args, run_serve_experts
from .help import PeerdArgumentParser, add_everywhere, env_setting
from .identity_lock import IdentityInUseError, lock_identity
from .join_arguments import (
    AUTO,
    CONFIG,
    IDENTITY,
    KNOWN_FILE_KEYS,
    LOG_LEVEL,
    STATUS_HOST,
    STATUS_PORT,
    add_join_arguments,
    data_shard_from_args,
    delay_updates_from_args,
    initial_peers_from_args,
)
from .machine_launch import launch_ranks
from .node_ids import node_id_for
from .ports import PortInUseError, check_port_free
from .private_swarm import access_from_args
from .ranks import RankError, RankPlace, follow_signals, rank_place
from .runner import EXIT_UNREACHABLE, exit_process, run_joining, until_stopped
from .setting_kinds import from_args
from .settings import Settings, SettingsError
from .status_pages import dashboard_url
from .status_server import fetch_status
from .swarm import add_swarm_arguments, run_swarm

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
    parser = PeerdArgumentParser(prog="peerd", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"peerd {__version__}")
    _add_config_argument(parser, settings)
    LOG_LEVEL.add_to(parser, settings)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    keygen = commands.add_parser("keygen", help="create an identity key and print its peer ID", epilog=EPILOG)
    replace(IDENTITY, help="key file to create").add_to(keygen, settings)

    join = commands.add_parser("join", help="start a peer, join the swarm and (with --task) train", epilog=EPILOG)
    add_join_arguments(join, settings)

    status = commands.add_parser("status", help="show a running peer's /status for humans", epilog=EPILOG)
    replace(STATUS_PORT, default=8080, default_text=None, help="the peer's --status-port").add_to(status, settings)
    # (no variable: PEERD_STATUS_HOST is where a peer binds, which need not be where it is asked)
    status.add_argument("--status-host", default=STATUS_HOST.default, help="where that peer serves its status")
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
    # (not CONFIG.add_to: Settings.load has read the variable, and the file is not its own key)
    env_setting(
        parser.add_argument(CONFIG.flag, metavar=CONFIG.metavar, default=default, help=CONFIG.help), CONFIG.variable
    )


def _cmd_keygen(args: argparse.Namespace) -> int:
    path = Path(args.identity) if args.identity else default_identity_path()
    check_key_path(path)
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
                host = config.status.host
                print(f"peerd status on http://{host}:{daemon.status_port}/status", flush=True)
                print(f"peerd dashboard on {dashboard_url(host, daemon.status_port)}", flush=True)

    return await until_stopped(serve)


def _experts(args: argparse.Namespace):
    """``(hosting config, built experts)`` for ``--serve-experts``, validated before joining."""
    if not args.experts:
        return None
    config = config_from_args(args)
    return config, config.build_experts()


def _cmd_join(args: argparse.Namespace, argv: list[str]) -> int:
    place = rank_place()  # set by torchrun, or by our own launcher below
    if args.shard_model:
        _check_sharding(place, args.nproc_per_node)
    if place is not None or args.nproc_per_node > 1:
        if args.task is None:
            raise ValueError("a peer of several ranks trains: give --task (or run a single process)")
        if place is None:
            return launch_ranks(argv, args.nproc_per_node)
        if place.rank != 0:
            return follow_signals(functools.partial(_follow, args, place))
    identity_path = Path(args.identity) if args.identity else default_identity_path()
    check_key_path(identity_path)
    lock_identity(identity_path)  # before the slow start-up, so a second process fails at once
    shard = None
    if args.task is not None:
        from .tasks import ShardSpec, check_task  # torch loads only in peers that train

        chosen = data_shard_from_args(args)
        shard = chosen if chosen == AUTO else ShardSpec(*chosen)
        check_task(args.task, args.model_size)  # fail now, with a clear message
    delay_updates = delay_updates_from_args(args)
    if args.compression is not None:
        from averaging.compression import get_codec  # torch loads only in peers that train
        from averaging.local_updates import outer_settings

        # an unknown codec is a ValueError: one line, exit 1
        sparse = get_codec(args.compression).sparse
        if sparse and args.mode != "local-updates":
            raise ValueError(f"--compression {args.compression} is sparse: it needs --mode local-updates")
        try:  # the optimizer's own rule (error feedback on, as peerd join runs it), asked before slow work
            outer_settings(owed_in_params=sparse, lr=args.outer_lr, momentum=None)
        except ValueError:
            kept = "keeps unsent progress in the parameters"
            raise ValueError(
                f"--compression {args.compression} {kept}: it takes --outer-lr 1, not {args.outer_lr:g}"
            ) from None
    if args.outer_lr is not None and args.mode != "local-updates":
        raise ValueError(f"--outer-lr {args.outer_lr:g} is the outer step of local updates: give --mode local-updates")
    if args.fragments > 1 and args.mode != "local-updates":
        raise ValueError(f"--fragments {args.fragments} averages local updates in turns: give --mode local-updates")
    if args.local_steps % args.fragments:
        raise ValueError(f"--fragments {args.fragments} must divide --local-steps {args.local_steps} into equal rounds")
    access = access_from_args(args)
    # the ports are bound only after the node-ID puzzle: a taken one must fail before it
    check_port_free("listen", *args.listen, "--listen HOST:PORT")
    if args.status_port is not None:
        check_port_free("status", args.status_host, args.status_port, "--status-port")
    identity = Identity.load_or_create(identity_path)
    node_id = node_id_for(identity, identity_path, args.node_id_difficulty)
    initial_peers = initial_peers_from_args(args)
    config = from_args(
        DaemonConfig,
        args,
        identity=identity,
        ranks=None if place is None else _join_rank_group(place, args),
        experts=_experts(args),
        network=from_args(NetworkConfig, args, initial_peers=initial_peers, node_id=node_id, access=access),
        training=from_args(TrainingConfig, args, data_shard=shard),
        averaging=from_args(AveragingConfig, args, delay_updates=delay_updates),
        status=from_args(StatusConfig, args),
    )
    return run_joining(_join_main, config)


def _check_sharding(place: RankPlace | None, nproc_per_node: int) -> None:
    """``--shard-model`` needs several ranks, and FSDP2 (``fully_shard``, public from torch 2.6)."""
    if place is None and nproc_per_node == 1:
        raise ValueError("--shard-model shards the model over a machine's ranks: run several (--nproc-per-node N)")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        import torch

        raise ValueError(f"--shard-model needs torch 2.6 or later (FSDP2); this is torch {torch.__version__}") from None


def _join_rank_group(place: RankPlace, args: argparse.Namespace):
    from .machine import join_rank_group  # torch loads only in peers that train

    return join_rank_group(place, args.device, args.shard_model)


def _follow(args: argparse.Namespace, place: RankPlace) -> int:
    """A rank other than 0: check the task as rank 0 does, then follow rank 0's slices. What goes
    wrong here goes wrong on rank 0 too, which says it in one line: a follower only logs it."""
    from .machine_training import run_follower  # torch loads only in peers that train
    from .tasks import check_task

    try:
        check_task(args.task, args.model_size)
        group = _join_rank_group(place, args)
    except ValueError as error:  # TaskError is one: rank 0 checks the same and says it, for the machine
        logging.getLogger("peerd").debug("rank %d stops: %s", place.rank, error)
        return EXIT_BAD_INPUT
    except RankError as error:  # this rank's own trouble with the group: rank 0 may not know why
        logging.getLogger("peerd").warning("rank %d stops: %s", place.rank, error)
        return EXIT_RANK_FAILED
    return run_follower(group, args.task, args.model_size)


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
        if key == "reachability" and isinstance(value, dict):
            value = reachability_line(value)
        elif key == "ranks" and isinstance(value, dict):
            value = ranks_line(value)
        print(f"{key.replace('_', ' '):<{width}}  {value if value is not None else '-'}")
    return 0


def reachability_line(reachability: dict) -> str:
    """``nat; seen as HOST:PORT; via RELAYED...; 3 direct, 1 relayed connections`` for humans."""
    parts = [str(reachability.get("status", "?"))]
    if reachability.get("observed_address"):
        parts.append(f"seen as {reachability['observed_address']}")
    if reachability.get("relayed_addresses"):
        parts.append("reached via " + ", ".join(map(str, reachability["relayed_addresses"])))
    if reachability.get("client_mode_fallback"):
        parts.append("client mode: no relay found")
    connections = reachability.get("connections") or {}
    parts.append(f"{connections.get('direct', 0)} direct, {connections.get('relayed', 0)} relayed connections")
    return "; ".join(parts)


def ranks_line(ranks: dict) -> str:
    """``2 ranks (gloo on cpu): rank 0 4864 samples, rank 1 4864 samples`` for humans (``gloo on
    cpu, sharded`` when the ranks hold the model under FSDP)."""
    rows = ", ".join(f"rank {row.get('rank')} {row.get('samples')} samples" for row in ranks.get("ranks") or [])
    sharded = ", sharded" if ranks.get("model") == "fsdp" else ""
    return f"{ranks.get('world_size')} ranks ({ranks.get('backend')} on {ranks.get('device')}{sharded}): {rows}"


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
    settings.check_known(KNOWN_FILE_KEYS)
    return args


def run() -> NoReturn:
    """The ``peerd`` program: ``main()`` and exit with its code at once (see ``exit_process``)."""
    exit_process(main())


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
            return _cmd_join(args, sys.argv[1:] if argv is None else argv)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "swarm":
            return run_swarm(args)
        if args.command == "dht":
            return run_dht_command(args)
        if args.command == "serve-experts":
            return run_serve_experts(args)
    except RankError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except (IdentityInUseError, PortInUseError) as error:
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
    run()
