"""The collaborative optimizer: many peers train one model toward a swarm-wide batch size.

Each peer accumulates gradients over its own batches and publishes its progress to the DHT. When
the swarm together has seen ``target_batch_size`` samples for the current epoch, every peer
averages its mean gradient with a group (weighted by its sample count, so the result is the
gradient of the whole swarm batch), steps the wrapped optimizer, and moves to the next epoch.
Every ``average_state_every`` epochs the parameters themselves are averaged too, which pulls
back together peers that stepped alone after a failed round. A peer more than one epoch behind
(a late joiner, or one that was stalled) loads parameters and epoch from a peer instead.

If averaging fails, the peer steps on its own gradients and says so: training never stops
because another peer misbehaved.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import trio

from .allreduce import AllReduceError
from .averager import GroupAverager
from .matchmaking import MatchmakingError
from .progress import PeerProgress, ProgressTracker, SwarmProgress
from .state_sharing import StateUnavailable

__all__ = ["CollaborativeOptimizer"]

log = logging.getLogger("peerd.training")


class _ModelStateAverager(GroupAverager):
    """Averages parameters; tells newcomers the epoch along with them."""

    def __init__(self, owner: CollaborativeOptimizer, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.owner = owner

    def state_metadata(self) -> Any:
        return {"round": self.round, "epoch": self.owner.epoch}


class CollaborativeOptimizer:
    """Wraps any ``torch.optim`` optimizer. Call ``await opt.step(batch_size)`` after each
    ``loss.backward()``; it returns True when the swarm stepped (an epoch passed)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht,
        *,
        prefix: str,
        target_batch_size: int,
        scheduler: Any = None,
        clip_grad_norm: float | None = None,
        average_state_every: int = 5,
        target_group_size: int = 4,
        min_group_size: int = 2,
        matchmaking_timeout: float = 3.0,
        averaging_timeout: float = 15.0,
        settle_time: float | None = None,
        codec: str = "none",
        progress_interval: float = 0.25,
        load_state_timeout: float = 30.0,
    ):
        self.optimizer = optimizer
        self.dht = dht
        self.prefix = prefix
        self.target_batch_size = target_batch_size
        self.scheduler = scheduler
        self.clip_grad_norm = clip_grad_norm
        self.average_state_every = average_state_every
        self.progress_interval = progress_interval
        self.load_state_timeout = load_state_timeout
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.gradients = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
        averaging = {
            "target_group_size": target_group_size,
            "min_group_size": min_group_size,
            "matchmaking_timeout": matchmaking_timeout,
            "sender_timeout": averaging_timeout / 2,
            "reducer_timeout": averaging_timeout,
            "settle_time": settle_time,
            "codec": codec,
        }
        self.grad_averager = GroupAverager(
            self.gradients, dht, prefix=f"{prefix}.grads", allow_state_sharing=False, **averaging
        )
        self.state_averager = _ModelStateAverager(self, self.params, dht, prefix=f"{prefix}.state", **averaging)
        self.tracker = ProgressTracker(dht, prefix)
        self.epoch = 0
        self.local_samples = 0
        self.samples_per_s = 0.0
        self.last_averaging: dict[str, Any] | None = None
        self.swarm = SwarmProgress({})
        self._last_fetch = -float("inf")
        self._last_step_time: float | None = None

    @property
    def _progress(self) -> PeerProgress:
        return PeerProgress(self.epoch, self.local_samples, self.samples_per_s)

    async def step(self, batch_size: int) -> bool:
        await trio.to_thread.run_sync(self._accumulate, batch_size)
        self.local_samples += batch_size
        self._update_throughput(batch_size)
        now = trio.current_time()
        if now - self._last_fetch >= self.progress_interval:
            self._last_fetch = now
            await self.tracker.publish(self._progress)
            self.swarm = await self.tracker.fetch(self._progress)
        view = SwarmProgress({**self.swarm.peers, self.tracker.me: self._progress})
        if view.epoch > self.epoch + 1:
            await self.load_state_from_peers()
            return False
        if not view.ready_to_step(self.epoch, self.target_batch_size):
            return False
        await self._averaged_step()
        return True

    async def load_state_from_peers(self) -> None:
        """Adopt a peer's parameters and epoch (we fell behind or just joined)."""
        try:
            metadata = await self.state_averager.load_state_from_peers(timeout=self.load_state_timeout)
        except StateUnavailable as error:
            log.warning("could not load state from peers: %s", error)
            return
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if type(epoch) is int and epoch >= 0:
            self.epoch = max(self.epoch, epoch)
        self._reset_accumulators()
        log.info("joined the swarm at epoch %d with its parameters", self.epoch)
        await self.tracker.publish(self._progress)

    def _accumulate(self, batch_size: int) -> None:
        with torch.no_grad():
            for accumulator, param in zip(self.gradients, self.params, strict=True):
                if param.grad is not None:
                    accumulator.add_(param.grad.detach().to("cpu", torch.float32), alpha=batch_size)
                    param.grad = None

    def _update_throughput(self, batch_size: int) -> None:
        now = trio.current_time()
        if self._last_step_time is not None and now > self._last_step_time:
            instant = batch_size / (now - self._last_step_time)
            self.samples_per_s = instant if self.samples_per_s == 0 else 0.9 * self.samples_per_s + 0.1 * instant
        self._last_step_time = now

    def _reset_accumulators(self) -> None:
        for accumulator in self.gradients:
            accumulator.zero_()
        self.local_samples = 0

    async def _averaged_step(self) -> None:
        samples = max(self.local_samples, 1)
        for accumulator in self.gradients:
            accumulator.div_(samples)
        record: dict[str, Any] = {"epoch": self.epoch, "averaged": False, "group": 0, "failed": []}
        try:
            result = await self.grad_averager.step(weight=float(self.local_samples))
            record.update(
                averaged=True,
                group=len(result.group.members),
                failed=sorted(str(p) for p in result.failed_peers),
            )
        except (MatchmakingError, AllReduceError) as error:
            log.warning("gradient averaging failed at epoch %d (%s); stepping on local gradients", self.epoch, error)
        await trio.to_thread.run_sync(self._apply_gradients)
        self.epoch += 1
        self._reset_accumulators()
        self.last_averaging = record
        await self.tracker.publish(self._progress)
        if self.average_state_every and self.epoch % self.average_state_every == 0:
            try:
                await self.state_averager.step()
            except (MatchmakingError, AllReduceError) as error:
                log.info("parameter averaging skipped at epoch %d: %s", self.epoch, error)

    def _apply_gradients(self) -> None:
        for accumulator, param in zip(self.gradients, self.params, strict=True):
            param.grad = accumulator.to(param.device, param.dtype).clone()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
