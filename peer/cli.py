"""The ``peerd`` command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import trio

from . import __version__
from .address import PeerAddress
from .daemon import BootstrapError, DaemonConfig, run_daemon
from .identity import Identity, IdentityError, default_identity_path

EXIT_BAD_INPUT = 1
EXIT_UNREACHABLE = 2


def _listen(text: str) -> tuple[str, int]:
    try:
        address = PeerAddress.parse(text)
    except ValueError as error:
        if text.endswith(":0"):  # port 0: let the OS choose
            return text[:-2].strip("[]"), 0
        raise argparse.ArgumentTypeError(str(error)) from None
    return address.host, address.port


def _peer(text: str) -> PeerAddress:
    try:
        return PeerAddress.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peerd", description="Decentralized volunteer-training peer daemon")
    parser.add_argument("--version", action="version", version=f"peerd {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    keygen = commands.add_parser("keygen", help="create an identity key and print its peer ID")
    keygen.add_argument("--identity", type=Path, default=None, help="key file (default: user data dir)")

    join = commands.add_parser("join", help="start a peer and join the swarm")
    join.add_argument("--listen", type=_listen, default=("0.0.0.0", 31337), metavar="HOST:PORT")
    join.add_argument("--identity", type=Path, default=None, help="key file, created on first use")
    join.add_argument("--initial-peer", type=_peer, action="append", default=[], metavar="ADDR")
    join.add_argument("--run-id", default="default", help="peers only talk to peers of the same run")
    join.add_argument("--bootstrap-timeout", type=float, default=15.0, metavar="SECONDS")
    return parser


def _load_identity(path: Path | None) -> Identity:
    return Identity.load_or_create(path or default_identity_path())


def _cmd_keygen(args: argparse.Namespace) -> int:
    path = args.identity or default_identity_path()
    if path.exists():
        print(f"peerd: {path} already exists; refusing to overwrite an identity", file=sys.stderr)
        return EXIT_BAD_INPUT
    identity = Identity.generate()
    identity.save(path)
    print(identity.peer_id)
    return 0


async def _join_main(config: DaemonConfig) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    logging.getLogger("peerd").info("received %s, shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            address = await nursery.start(run_daemon, config)
            print(f"peerd listening on {address}", flush=True)


def _cmd_join(args: argparse.Namespace) -> int:
    identity = _load_identity(args.identity)
    host, port = args.listen
    config = DaemonConfig(
        identity=identity,
        listen_host=host,
        listen_port=port,
        initial_peers=args.initial_peer,
        run_id=args.run_id,
        bootstrap_timeout=args.bootstrap_timeout,
    )
    try:
        trio.run(_join_main, config)
    except Exception as error:
        bootstrap_error = find_exception(error, BootstrapError)
        if bootstrap_error is None:
            raise
        print(f"peerd: {bootstrap_error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


def find_exception(error: BaseException, wanted: type[BaseException]) -> BaseException | None:
    """The first ``wanted`` inside ``error`` or the exception groups that nurseries wrap it in."""
    if isinstance(error, wanted):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = find_exception(inner, wanted)
        if found is not None:
            return found
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "keygen":
            return _cmd_keygen(args)
        if args.command == "join":
            return _cmd_join(args)
    except IdentityError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as error:
        print(f"peerd: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
