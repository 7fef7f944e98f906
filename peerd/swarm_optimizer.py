"""``SwarmOptimizer``: the swarm's optimizers behind a plain ``torch.optim.Optimizer``, for training
loops that are not trio programs and that someone else wrote (Hugging Face's ``Trainer``,
Lightning): ``step()`` blocks while the swarm's optimizer takes the step's gradients in the
process-wide background trio loop (``peer.background``), as the ``DHT`` and ``Averager`` facades do.

A loop calls ``step()`` once per optimizer step, after its gradients are in ``.grad``; the wrapper
counts ``batch_size_per_step`` samples for it (the loop's batch times its accumulation steps) and
hands it to a ``CollaborativeOptimizer`` (steps when the swarm has seen ``target_batch_size``
samples) or a ``LocalUpdatesOptimizer`` (DiLoCo rounds of ``local_steps``). ``param_groups`` and
``state`` are the wrapped optimizer's own, so learning-rate schedulers and checkpoints see it; a
scheduler the loop steps moves the learning rate per local step, not per swarm epoch, so a
constant schedule is the one that means what it says here.

A loop that is itself a ``torch.distributed`` job (a ``transformers.Trainer`` under torchrun, its
gradients reduced by DDP) is one peer, as ``peerd join --nproc-per-node`` is (``machine.py``): when
the process group exists as the optimizer is made (``TrainingArguments`` makes it), rank 0 alone
joins the swarm and steps, and after each step that changed its parameters broadcasts them to the
other ranks, whose own optimizer never steps. The count per step must then be the whole job's
(``hf_swarm_optimizer`` multiplies by the world size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from averaging import CollaborativeOptimizer, LocalUpdatesOptimizer
from dht import DHT
from peer import PeerAddress

from .machine import ParameterWrites, broadcast_parameters

__all__ = ["SwarmOptimizer"]

MODES = ("collaborative", "local-updates")


def _read_through(name: str) -> property:
    """An attribute of the wrapped optimizer (``inner``); before it is set (while
    ``Optimizer.__init__`` runs), the wrapper's own."""
    own = f"_own_{name}"

    def read(self: Any) -> Any:
        inner = self.__dict__.get("inner")
        return getattr(inner, name) if inner is not None else self.__dict__[own]

    def write(self: Any, value: Any) -> None:
        inner = self.__dict__.get("inner")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__[own] = value

    return property(read, write)


class SwarmOptimizer(torch.optim.Optimizer):
    """``optimizer`` trained with the swarm of ``run_id``. Joins through ``initial_peers`` (none:
    this peer starts a swarm; ``address`` says where others reach it) unless given a running
    ``dht``. ``batch_size_per_step``: the samples each ``step()`` counts, or a function that says
    (Lightning's strategy counts the batches since the last step). ``settings``:
    ``AveragingSettings`` fields for the swarm's optimizer."""

    # The wrapped optimizer's own groups and state, read through on every access: schedulers and
    # checkpoints act on it, also after its ``load_state_dict`` replaced them with new objects (as
    # accelerate's wrapper and a resumed checkpoint do).
    param_groups = _read_through("param_groups")
    state = _read_through("state")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        batch_size_per_step: int | Callable[[], int],
        target_batch_size: int = 256,
        mode: str = "collaborative",
        local_steps: int = 20,
        initial_peers: Iterable[PeerAddress | str] = (),
        dht: DHT | None = None,
        listen: tuple[str, int] | None = ("127.0.0.1", 0),
        **settings: Any,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if isinstance(batch_size_per_step, int) and batch_size_per_step < 1:
            raise ValueError(f"batch_size_per_step must be at least 1, not {batch_size_per_step}")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.inner = optimizer  # from now on ``param_groups`` and ``state`` are the inner one's
        self.batch_size_per_step = batch_size_per_step
        self.params = [param for group in optimizer.param_groups for param in group["params"]]
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._machine = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._epoch = 0
        self._writes = ParameterWrites(self.params, optimizer)
        self.dht: DHT | None = None
        self.swarm: CollaborativeOptimizer | LocalUpdatesOptimizer | None = None
        if self._rank != 0:
            return  # another rank of a machine: rank 0 is its peer
        self._own_dht = dht is None
        self.dht = dht if dht is not None else DHT(initial_peers, start=True, listen=listen, run_id=run_id)
        self._loop = self.dht.loop

        async def create() -> CollaborativeOptimizer | LocalUpdatesOptimizer:
            node = self.dht.node
            if mode == "local-updates":
                return LocalUpdatesOptimizer(optimizer, node, prefix=run_id, local_steps=local_steps, **settings)
            return CollaborativeOptimizer(
                optimizer, node, prefix=run_id, target_batch_size=target_batch_size, **settings
            )

        self.swarm = self._loop.run(create)

    @property
    def address(self) -> PeerAddress | None:
        """Where other peers reach this one (give it to them as an initial peer; None on a rank
        other than 0)."""
        return self.dht.address if self.dht is not None else None

    @property
    def epoch(self) -> int:
        """The swarm's epoch (collaborative) or outer round (local updates) this peer is at."""
        return self.swarm.epoch if self.swarm is not None else self._epoch

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward and backward, as Lightning passes it), then give this step's
        gradients to the swarm's optimizer; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.swarm is not None:
            per_step = self.batch_size_per_step
            self._loop.run(self.swarm.step, per_step() if callable(per_step) else per_step)
        if self._machine:
            self._share_with_ranks()
        return loss

    def _share_with_ranks(self) -> None:
        """Rank 0 tells the others its epoch and whether its parameters changed, and then sends
        them; the others drop the gradients their optimizer will never step on."""
        news = torch.tensor([int(self._writes.take()), self.epoch], device=self.params[0].device)
        dist.broadcast(news, 0)
        changed, self._epoch = bool(news[0]), int(news[1])
        if changed:
            broadcast_parameters(self.params, leads=self._rank == 0)
        if self._rank != 0:
            self.inner.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def shutdown(self) -> None:
        """Leave the swarm (and stop the DHT this optimizer started)."""
        if self.dht is not None and self._own_dht:
            self.dht.shutdown()
