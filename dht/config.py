"""A DHT node's settings and the errors its callers see."""

from __future__ import annotations

from dataclasses import dataclass

from .lookup import DISJOINT_PATHS
from .routing import ALPHA, K

__all__ = ["DHTConfig", "DHTError", "DHTBootstrapError"]


@dataclass(frozen=True)
class DHTConfig:
    k: int = K
    alpha: int = ALPHA
    # One request: a live peer on a continent-wide path answers a small find in well under a second.
    rpc_timeout: float = 2.0
    # A whole lookup: log2(n) rounds of rpc_timeout in the worst case of silent peers.
    lookup_timeout: float = 10.0
    bootstrap_timeout: float = 15.0
    # Initial peers that only ever refuse the connection (nothing listens at that port) are given
    # up after this, not the whole bootstrap timeout: a peer process started together with ours
    # listens within about as long as ours took (imports, key), and this covers a slower start.
    refused_grace: float = 5.0
    # Paper: refresh buckets not looked up within an hour; 10 min suits a churny volunteer swarm.
    refresh_interval: float = 600.0
    refresh_check_period: float = 60.0
    cache_on_path: bool = True
    # Gets walk this many disjoint paths, so one poisoned path cannot hide a record (S/Kademlia).
    # Stores and node lookups walk one: they already ask up to k peers, and the puzzle on node IDs
    # keeps hostile peers from being the nearest ones to a key.
    disjoint_paths: int = DISJOINT_PATHS
    # A read of the newest value (a dictionary merged across holders) asks this many of the k
    # holders, a random draw for each read. Stores reach all k, so a few answers make the entry
    # set whole (a holder misses an entry only when a store to it failed, or it joined since);
    # asking all k put every read of a popular key (each of a matchmaking cell's peers reads it
    # every round) on every one of its holders: k / latest_read_holders times the load of a draw.
    # The draw is dealt among the disjoint paths (rounded up to a whole number per path); k or
    # more asks every holder, nearest first. A hostile holder can hide an entry (never forge one)
    # only from the reads whose whole draw falls on holders hiding it.
    latest_read_holders: int = 6
    # Reads draw only once the swarm holds more nodes than this, as the routing table's
    # ``estimated_swarm_size`` reads it: in a smaller swarm nearly every node holds every key, a
    # draw spreads nothing, and a read of every holder is the one sure to find an entry that
    # reached only some of them.
    draw_reads_above: int = 3 * K


class DHTError(Exception):
    """Base class of DHT failures."""


class DHTBootstrapError(DHTError):
    """No initial peer answered within the bootstrap deadline; the message names each and why."""
