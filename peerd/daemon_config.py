"""What a peer is told to do, in four parts a reader would name: how it reaches the swarm
(``NetworkConfig``), what it trains (``TrainingConfig``), how its rounds average
(``AveragingConfig``) and where it shows its status (``StatusConfig``).

A field that holds a ``peerd join`` setting names it (``setting_field``): its default is the
setting's, declared once in ``join_arguments.py``, and ``setting_kinds.from_args`` fills it from
the parsed flags. The other fields are worked out from settings (a loaded key, its node-ID proof, a
swarm's access rules, a chosen data shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peer import LOCAL_DIFFICULTY, Identity, NodeIDProof, PeerAddress, SwarmAccess

from .join_arguments import (
    AGGREGATION,
    BOOTSTRAP_TIMEOUT,
    CLIENT_MODE,
    COMPRESSION,
    DELAY_UPDATES,
    DEVICE,
    FRAGMENTS,
    INITIAL_PEERS,
    LISTEN,
    LOCAL_STEPS,
    MODE,
    MODEL_SIZE,
    OUTER_LR,
    RELAY,
    RELAY_RATE,
    RUN_ID,
    SCORE_CONTRIBUTIONS,
    STATUS_HOST,
    STATUS_PORT,
    TARGET_BATCH_SIZE,
    TASK,
    UPLINK_MBIT,
)
from .node_ids import NODE_ID_DIFFICULTY
from .setting_kinds import setting_field

__all__ = ["DaemonConfig", "NetworkConfig", "TrainingConfig", "AveragingConfig", "StatusConfig"]


@dataclass(frozen=True)
class NetworkConfig:
    """How the peer reaches the swarm, and what it offers peers behind NAT."""

    listen: tuple[str, int] = setting_field(LISTEN)
    initial_peers: list[PeerAddress] = setting_field(INITIAL_PEERS, factory=list)
    run_id: str = setting_field(RUN_ID)
    # The run's node-ID difficulty and this key's solution (None: solved at start). The library
    # default is the local one (see PeerHost for why); the command line defaults to a public run's.
    node_id_difficulty: int = setting_field(NODE_ID_DIFFICULTY, default=LOCAL_DIFFICULTY)
    node_id: NodeIDProof | None = None
    access: SwarmAccess | None = None  # a private swarm's allowlist and key (peer/access.py)
    bootstrap_timeout: float = setting_field(BOOTSTRAP_TIMEOUT)
    client_mode: bool = setting_field(CLIENT_MODE)
    relay: bool = setting_field(RELAY)  # relay for peers behind NAT (peer/nat.py), within per-circuit limits
    relay_mib_per_s: float = setting_field(RELAY_RATE)  # all relayed circuits together


@dataclass(frozen=True)
class TrainingConfig:
    """What the peer trains (``task`` None: nothing)."""

    task: str | None = setting_field(TASK)
    model_size: str | None = setting_field(MODEL_SIZE)  # sized tasks only (textlm); None: the task's default
    mode: str = setting_field(MODE)  # "collaborative" or "local-updates"
    data_shard: Any = None  # peerd.tasks.ShardSpec, "auto" (data_shards.py) or None: the whole data set
    target_batch_size: int | None = setting_field(TARGET_BATCH_SIZE)  # None: the task's
    local_steps: int = setting_field(LOCAL_STEPS)
    fragments: int = setting_field(FRAGMENTS)  # local updates: the model's fragments, averaged in turn
    outer_lr: float | None = setting_field(OUTER_LR)  # local updates; None: the optimizer's default


@dataclass(frozen=True)
class AveragingConfig:
    """How the peer's rounds average."""

    delay_updates: bool = setting_field(DELAY_UPDATES)  # collaborative: average while the next epoch accumulates
    compression: str | None = setting_field(COMPRESSION)  # codec name; None: each mode's default
    aggregation: str = setting_field(AGGREGATION)  # a reducer's rule (averaging/robust.py); auto: by the swarm's access
    score_contributions: bool = setting_field(SCORE_CONTRIBUTIONS)  # against the task's held-out loss
    uplink_mbit: float | None = setting_field(UPLINK_MBIT)  # declared uplink: rounds pace their connections to share it


@dataclass(frozen=True)
class StatusConfig:
    """Where the peer serves ``/status``, ``/metrics`` and the dashboard (``port`` None: nowhere)."""

    host: str = setting_field(STATUS_HOST)
    port: int | None = setting_field(STATUS_PORT)


@dataclass(frozen=True)
class DaemonConfig:
    """One peer: its key, the device it computes on, the experts it hosts, and the four parts."""

    identity: Identity
    device: str | None = setting_field(DEVICE)  # training's and the experts'; None: CUDA when available
    experts: Any = None  # (moe.hosting.ExpertHostingConfig, built experts) for --serve-experts
    network: NetworkConfig = field(default_factory=NetworkConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    ranks: Any = None  # peerd.machine.RankGroup: rank 0 of a machine of several ranks (machine.py)
