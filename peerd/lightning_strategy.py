"""``PeerdStrategy``: a Lightning ``Trainer`` whose one device is a peer of a swarm, in the shape of
Lightning's ``HivemindStrategy`` (the ``lightning-hivemind`` package):

    trainer = Trainer(strategy=PeerdStrategy(target_batch_size=8192, initial_peers=["10.0.0.5:31337"]))

The module's optimizer is wrapped in a ``SwarmOptimizer`` (``swarm_optimizer.py``) when Lightning
sets the optimizers up: each optimizer step hands the step's gradients to the swarm's collaborative
optimizer (or, ``mode="local-updates"``, DiLoCo rounds), counting the samples of the batches since
the last step (``gradient accumulation`` included), or ``batch_size`` per step when given. Initial
peers come from ``initial_peers`` or else ``PEERD_INITIAL_PEERS`` (commas or spaces, as ``peerd
join`` reads it; HivemindStrategy's was ``PL_INITIAL_PEERS``); none: this peer starts a swarm,
and ``strategy.address`` says where others join it. Needs the ``lightning`` extra.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import SingleDeviceStrategy
from pytorch_lightning.utilities.data import extract_batch_size

from peer import PeerAddress

from .swarm_optimizer import SwarmOptimizer

__all__ = ["INITIAL_PEERS_VARIABLE", "PeerdStrategy"]

log = logging.getLogger("peerd.lightning")

INITIAL_PEERS_VARIABLE = "PEERD_INITIAL_PEERS"


class PeerdStrategy(SingleDeviceStrategy):
    """Train on one device (CUDA when there is one) with the swarm of ``run_id``.
    ``settings``: ``AveragingSettings`` fields (``matchmaking_timeout``, ``codec``...)."""

    strategy_name = "peerd"

    def __init__(
        self,
        target_batch_size: int,
        *,
        run_id: str = "lightning_run",
        batch_size: int | None = None,
        initial_peers: Iterable[PeerAddress | str] | None = None,
        mode: str = "collaborative",
        local_steps: int = 20,
        listen: tuple[str, int] | None = ("127.0.0.1", 0),
        device: str | torch.device | None = None,
        **settings: Any,
    ):
        super().__init__(device=torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
        if initial_peers is None:
            initial_peers = os.environ.get(INITIAL_PEERS_VARIABLE, "").replace(",", " ").split()
        self._swarm = dict(
            run_id=run_id,
            target_batch_size=target_batch_size,
            initial_peers=list(initial_peers),
            mode=mode,
            local_steps=local_steps,
            listen=listen,
            **settings,
        )
        self._batch_size = batch_size
        self._samples_since_step = 0

    @property
    def swarm_optimizer(self) -> SwarmOptimizer | None:
        """The module's optimizer as the swarm trains it (None before Lightning sets it up)."""
        wrapped = [optimizer for optimizer in self.optimizers if isinstance(optimizer, SwarmOptimizer)]
        return wrapped[0] if wrapped else None

    @property
    def address(self) -> PeerAddress | None:
        """Where other peers reach this one (None before the optimizers are set up)."""
        optimizer = self.swarm_optimizer
        return optimizer.address if optimizer is not None else None

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"PeerdStrategy trains one optimizer with the swarm; the module has {len(self.optimizers)}"
            )
        (optimizer,) = self.optimizers
        if not isinstance(optimizer, SwarmOptimizer):
            per_step = self._batch_size if self._batch_size is not None else self._take_samples
            self.optimizers = [SwarmOptimizer(optimizer, batch_size_per_step=per_step, **self._swarm)]
            log.info("training with the swarm %s as %s", self._swarm["run_id"], self.address)

    def _take_samples(self) -> int:
        samples, self._samples_since_step = self._samples_since_step, 0
        return max(samples, 1)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        if batch is not None:
            self._samples_since_step += extract_batch_size(batch)
        return super().training_step(*args, **kwargs)

    def teardown(self) -> None:
        optimizer = self.swarm_optimizer
        super().teardown()
        if optimizer is not None:
            optimizer.shutdown()
