"""``peerd join --allow-peers FILE --swarm-key FILE``: a private swarm (``peer/access.py``)."""

from __future__ import annotations

import argparse

from peer.access import SwarmAccess, read_allowlist, read_swarm_key

from .help import env_setting
from .settings import Settings

__all__ = ["add_access_arguments", "access_from_args"]


def add_access_arguments(parser: argparse.ArgumentParser, settings: Settings) -> None:
    env_setting(
        parser.add_argument(
            "--allow-peers",
            default=settings.get("ALLOW_PEERS"),
            metavar="FILE",
            help="a private swarm: connect only with these peer IDs (one per line; # comments)",
        ),
        "ALLOW_PEERS",
    )
    env_setting(
        parser.add_argument(
            "--swarm-key",
            default=settings.get("SWARM_KEY"),
            metavar="FILE",
            help="a private swarm: connect only with peers that hold this secret (at least 16 bytes, "
            "e.g. head -c 32 /dev/urandom > swarm.key); it never crosses the wire",
        ),
        "SWARM_KEY",
    )


def access_from_args(args: argparse.Namespace) -> SwarmAccess:
    """The swarm's access rules from the flags; ValueError (one line) for a bad or missing file."""
    try:
        allowed = read_allowlist(args.allow_peers) if args.allow_peers else None
        key = read_swarm_key(args.swarm_key) if args.swarm_key else None
    except OSError as error:
        raise ValueError(f"cannot read {error.filename}: {error.strerror}") from None
    return SwarmAccess(allowed, key)
