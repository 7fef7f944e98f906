"""Hosting experts on a running peer: what to host (``ExpertHostingConfig``) and the task that
serves and announces them (``host_experts``).

No argument parsing lives here (``peerd/expert_commands.py`` turns flags into a config).
Importing this module stays light: the daemon's command line builds its parser from these
defaults, so torch and the expert server load only inside the functions that need them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from peer import PeerAddress, PeerHost
from peer.worker_threads import run_blocking

if TYPE_CHECKING:
    from dht.node import DHTNode

    from .experts import ExpertBackend

# Mirror moe.server.DEFAULT_MAX_BATCH_SIZE and moe.announce.HEARTBEAT_PERIOD (a test checks they
# agree): importing those modules here would pull torch into every ``peerd`` start-up, which
# only needs these flags' defaults.
DEFAULT_MAX_BATCH_SIZE = 4096
HEARTBEAT_PERIOD = 15.0
# Announcements live three heartbeat periods, and every node caps expert-grid records at 600 s
# (dht/lifetimes.py): a slower heartbeat could never be stored, and the experts would be served
# but never found.
MAX_HEARTBEAT_PERIOD = 200.0

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "HEARTBEAT_PERIOD", "MAX_HEARTBEAT_PERIOD", "ExpertHostingConfig", "host_experts"]


@dataclass
class ExpertHostingConfig:
    """What to host: ``pattern`` like ``ffn.[0:4].[0:4]``, of ``expert_type`` blocks."""

    pattern: str
    expert_type: str = "ffn"
    hidden_dim: int = 256
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    optimizer: str = "adam"
    lr: float = 1e-3
    device: str | None = None
    checkpoint_dir: Path | None = None
    heartbeat_period: float = HEARTBEAT_PERIOD
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_period <= MAX_HEARTBEAT_PERIOD:
            raise ValueError(
                f"--heartbeat-period must be in (0, {MAX_HEARTBEAT_PERIOD:g}] seconds: announcements live three"
                f" periods and the DHT keeps expert records at most 600 s, got {self.heartbeat_period:g}"
            )

    def build_experts(self) -> dict[str, ExpertBackend]:
        """Validates everything (pattern, type, optimizer) before any network activity."""
        import torch  # torch loads only for peers that host experts

        from averaging.optimizer_state import fused_where_supported

        from .experts import ExpertBackend, resolve_block_type
        from .protocol import expand_expert_pattern

        uids = expand_expert_pattern(self.pattern)
        resolve_block_type(self.expert_type)
        optimizers = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
        if self.optimizer not in optimizers:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: use one of {sorted(optimizers)}")
        make = optimizers[self.optimizer]
        return {
            uid: ExpertBackend.create(
                self.expert_type,
                self.hidden_dim,
                optimizer=lambda params: fused_where_supported(make, params, lr=self.lr),
                device=self.device,
                seed=None if self.seed is None else self.seed + i,
            )
            for i, uid in enumerate(uids)
        }


async def host_experts(
    host: PeerHost,
    dht: DHTNode | None,
    config: ExpertHostingConfig,
    *,
    experts: dict[str, ExpertBackend] | None = None,
    announce_address: PeerAddress | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the configured experts on an existing peer until cancelled.

    ``task_status.started`` receives the hosted expert IDs once they are served and announced.
    Build ``experts`` beforehand with ``config.build_experts()`` to report bad configuration early.
    """
    from .announce import HEARTBEAT_TTL  # torch loads only for peers that host experts
    from .server import open_expert_server

    if experts is None:
        experts = await run_blocking(config.build_experts)
    async with open_expert_server(
        host,
        experts,
        dht=dht,
        max_batch_size=config.max_batch_size,
        checkpoint_dir=config.checkpoint_dir,
        heartbeat_period=config.heartbeat_period,
        heartbeat_ttl=max(HEARTBEAT_TTL, 3 * config.heartbeat_period),
        announce_address=announce_address,
    ) as server:
        task_status.started(sorted(server.experts))
        await trio.sleep(math.inf)
