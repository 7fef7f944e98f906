"""``peerd join --allow-peers FILE --swarm-key FILE``: a private swarm (``peer/access.py``): the two
settings (listed among ``join_arguments.JOIN_SETTINGS``) and the access rules they give."""

from __future__ import annotations

import argparse

from peer.access import SwarmAccess, read_allowlist, read_swarm_key

from .setting_kinds import Setting

__all__ = ["ALLOW_PEERS", "SWARM_KEY", "access_from_args"]


ALLOW_PEERS = Setting(
    name="allow_peers", flag="--allow-peers", variable="ALLOW_PEERS", metavar="FILE",
    help="a private swarm: connect only with these peer IDs (one per line; # comments)",
    doc="a private swarm: connect only with the peer IDs in FILE (one per line, `#` comments); others are refused at "
    "the handshake and told why",
)  # fmt: skip
SWARM_KEY = Setting(
    name="swarm_key", flag="--swarm-key", variable="SWARM_KEY", metavar="FILE",
    help="a private swarm: connect only with peers that hold this secret (at least 16 bytes, e.g. head -c 32 "
    "/dev/urandom > swarm.key); it never crosses the wire",
    doc="a private swarm: connect only with peers holding the same secret (≥ 16 bytes, e.g. `head -c 32 /dev/urandom "
    "> swarm.key`); mixed into the Noise prologue, never sent",
)  # fmt: skip


def access_from_args(args: argparse.Namespace) -> SwarmAccess:
    """The swarm's access rules from the flags; ValueError (one line) for a bad or missing file."""
    try:
        allowed = read_allowlist(args.allow_peers) if args.allow_peers else None
        key = read_swarm_key(args.swarm_key) if args.swarm_key else None
    except OSError as error:
        raise ValueError(f"cannot read {error.filename}: {error.strerror}") from None
    return SwarmAccess(allowed, key)
