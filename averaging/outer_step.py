"""The outer step of local-updates training (DiLoCo), as tensor arithmetic with no I/O.

Every peer keeps the shared start of the round (``start``: where all replicas stood when it began)
and an outer SGD optimizer with Nesterov momentum over its parameters. At the end of a round the
delta ``start - params`` is the pseudo-gradient; once it is averaged with the swarm's, the outer
step moves from the start along it. The methods here are synchronous and may take a while on big
models: callers run them in a worker thread, under the lock that newcomers' downloads take.
"""

from __future__ import annotations

import torch

from .optimizer_state import materialize_state, state_tensors

__all__ = ["OuterStep"]


class OuterStep:
    """Start, pseudo-gradient and outer momentum of one peer's parameters."""

    def __init__(self, params: list[torch.Tensor], *, lr: float, momentum: float):
        self.params = params
        # Momentum 0 is plain SGD on the averaged delta (lr 1: the replicas' average), which torch's
        # SGD refuses to build with Nesterov on.
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.start = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self.deltas = [torch.zeros_like(s) for s in self.start]
        # The momentum buffer exists from the start, so newcomers have somewhere to load it into.
        self.momentum = state_tensors(self.optimizer) if materialize_state(self.optimizer) else []
        # A copy of the start that the periodic start averaging works on, so newcomers can download
        # the start meanwhile.
        self.start_average = [s.clone() for s in self.start]

    def compute_deltas(self) -> None:
        with torch.no_grad():
            for delta, start, param in zip(self.deltas, self.start, self.params, strict=True):
                torch.sub(start, param.detach().to("cpu", torch.float32), out=delta)

    def compute_deltas_and_anchor(self) -> list[torch.Tensor]:
        """The deltas, and where the parameters stood when they were taken (for ``apply_delayed``)."""
        self.compute_deltas()
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]

    def apply(self) -> None:
        """From the shared start, step along the averaged pseudo-gradient with Nesterov momentum."""
        with torch.no_grad():
            for param, start, delta in zip(self.params, self.start, self.deltas, strict=True):
                param.copy_(start)
                param.grad = delta.to(param.device, param.dtype).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for start, param in zip(self.start, self.params, strict=True):
                start.copy_(param.detach())

    def apply_delayed(self, anchor: list[torch.Tensor]) -> None:
        """The outer step of a round averaged while the next one ran, applied from its start, plus
        whatever this peer learned since that round's delta was taken (``params - anchor``)."""
        with torch.no_grad():
            pairs = zip(self.params, anchor, strict=True)
            progress = [param.detach().to("cpu", torch.float32) - mark for param, mark in pairs]
        self.apply()
        with torch.no_grad():
            for param, extra in zip(self.params, progress, strict=True):
                param.add_(extra.to(param.device, param.dtype))

    def copy_start_for_averaging(self) -> None:
        with torch.no_grad():
            for target, source in zip(self.start_average, self.start, strict=True):
                target.copy_(source)

    def move_to_averaged_start(self) -> None:
        """Parameters move by the same correction as the start, keeping their local progress."""
        with torch.no_grad():
            for param, start, averaged in zip(self.params, self.start, self.start_average, strict=True):
                param.add_((averaged - start).to(param.device, param.dtype))
                start.copy_(averaged)

    def reset_params_to_start(self) -> None:
        """After loading a donor's start: train on from there."""
        with torch.no_grad():
            for param, start in zip(self.params, self.start, strict=True):
                param.copy_(start)
