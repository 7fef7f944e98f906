"""Mixture-of-experts layers whose experts live on other peers.

``RemoteMixtureOfExperts`` gates over a grid of experts ``prefix.i.j...``: a linear layer gives
each sample one score per grid coordinate, beam search through the DHT finds each sample's
``k_best`` live experts, every chosen expert gets the samples routed to it in one call, and the
outputs are averaged with softmax weights over the experts' scores.

Fault tolerance: a sample needs answers from ``k_min`` of its experts; after that the rest get
``timeout_after_k_min`` seconds. Experts that failed or were cut off are masked: their weights are
zero and the remaining weights are renormalised. Backward goes only to the experts that answered
the forward, under the same rule (``backward_k_min``); one that fails then contributes no gradient.

``RemoteSwitchMixtureOfExperts`` is the Switch Transformer variant: each sample goes to its best
expert (``k_best=1`` by default), weighted by that expert's gate probability, and ``forward``
also returns a load-balancing loss to add to the training loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .beam_search import ExpertMatch, find_best_experts
from .client import DEFAULT_TIMEOUT, ExpertCallError, MoEClient, call_backward, call_forward, next_token
from .quorum import gather_with_quorum
from .remote import DUMMY

__all__ = ["RemoteMixtureOfExperts", "RemoteSwitchMixtureOfExperts", "MixtureError"]


class MixtureError(RuntimeError):
    """Too few experts answered for some samples (fewer than ``k_min``)."""


@dataclass
class _ExpertCall:
    uid: str
    address: Any
    samples: torch.Tensor  # which rows of the batch go to this expert
    slots: torch.Tensor  # and at which of each row's k_best positions its output lands
    token: int = field(default_factory=next_token)


@dataclass
class _Plan:
    """Everything the autograd function needs besides tensors."""

    client: MoEClient
    calls: list[_ExpertCall]
    k_best: int
    k_min: int
    backward_k_min: int
    timeout: float
    timeout_after_k_min: float
    backward_timeout: float


def _plan_calls(matches: list[list[ExpertMatch]]) -> list[_ExpertCall]:
    """Group (sample, slot) pairs by expert: one call per expert per batch, however many samples."""
    by_uid: dict[str, tuple[Any, list[int], list[int]]] = {}
    for sample, row in enumerate(matches):
        for slot, match in enumerate(row):
            entry = by_uid.setdefault(match.uid, (match.value, [], []))
            entry[1].append(sample)
            entry[2].append(slot)
    return [
        _ExpertCall(uid, address, torch.tensor(samples), torch.tensor(slots))
        for uid, (address, samples, slots) in by_uid.items()
    ]


class _RemoteMixtureCall(torch.autograd.Function):
    """``inputs [batch, *shape]`` -> ``outputs [batch, k_best, *shape]`` and ``alive [batch, k_best]``."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, plan: _Plan, keep_graph: bool, inputs: torch.Tensor):
        inputs = inputs.detach()
        client, batch = plan.client, inputs.shape[0]

        def forward_call(call: _ExpertCall):
            rows = inputs[call.samples].contiguous()

            async def run() -> torch.Tensor:
                result = await call_forward(
                    client.host,
                    call.address,
                    call.uid,
                    rows,
                    keep_graph=keep_graph,
                    token=call.token,
                    timeout=plan.timeout,
                )
                if result.shape != rows.shape:  # as good as a failed expert: it must not count toward k_min
                    raise ExpertCallError(
                        f"expert {call.uid} returned shape {list(result.shape)} for {list(rows.shape)}"
                    )
                return result

            return run

        results, tracker = client.run(
            _gather,
            [forward_call(call) for call in plan.calls],
            [call.samples.tolist() for call in plan.calls],
            batch,
            plan.k_min,
            plan.timeout,
            plan.timeout_after_k_min,
        )
        short = tracker.short_samples()
        if short:
            raise MixtureError(
                f"{len(short)} of {batch} samples got fewer than k_min={plan.k_min} expert answers "
                f"({sum(r is not None for r in results)} of {len(results)} experts answered)"
            )
        outputs = inputs.new_zeros((batch, plan.k_best, *inputs.shape[1:]))
        alive = torch.zeros(batch, plan.k_best, dtype=torch.bool)
        answered = []
        for call, result in zip(plan.calls, results, strict=True):
            if result is None:
                continue
            outputs[call.samples, call.slots] = result.to(outputs.dtype)
            alive[call.samples, call.slots] = True
            answered.append(call)
        ctx.plan, ctx.answered = plan, answered
        ctx.save_for_backward(inputs)
        ctx.mark_non_differentiable(alive)
        return outputs, alive

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_outputs: torch.Tensor, _grad_alive: Any):
        (inputs,) = ctx.saved_tensors
        plan: _Plan = ctx.plan
        calls: list[_ExpertCall] = ctx.answered
        client = plan.client

        def backward_call(call: _ExpertCall):
            rows = inputs[call.samples].contiguous()
            grads = grad_outputs[call.samples, call.slots].contiguous()
            return lambda: call_backward(
                client.host, call.address, call.uid, rows, grads, token=call.token, timeout=plan.backward_timeout
            )

        results, tracker = client.run(
            _gather,
            [backward_call(call) for call in calls],
            [call.samples.tolist() for call in calls],
            inputs.shape[0],
            plan.backward_k_min,
            plan.backward_timeout,
            plan.timeout_after_k_min,
        )
        short = tracker.short_samples()
        if short:
            raise MixtureError(f"{len(short)} samples got fewer than backward_k_min={plan.backward_k_min} gradients")
        grad_inputs = torch.zeros_like(inputs)
        for call, result in zip(calls, results, strict=True):
            if result is not None:
                grad_inputs.index_add_(0, call.samples, result.to(grad_inputs.dtype))
        return None, None, None, grad_inputs


async def _gather(calls, samples_of_call, batch, k_min, timeout, timeout_after_k_min):
    return await gather_with_quorum(
        calls, samples_of_call, batch, k_min=k_min, timeout=timeout, timeout_after_k_min=timeout_after_k_min
    )


class RemoteMixtureOfExperts(nn.Module):
    """A mixture layer over the expert grid ``uid_prefix.[0:grid_size[0]].[0:grid_size[1]]...``.

    Input ``[batch, in_features]``; experts map samples to samples of the same shape. ``client``
    must have a DHT node (``MoEClient.start(initial_peers)`` or ``MoEClient.current(host, dht=...)``).
    Call it from a non-loop thread, like ``RemoteExpert``.
    """

    def __init__(
        self,
        *,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        client: MoEClient,
        k_best: int,
        k_min: int = 1,
        beam_size: int | None = None,
        forward_timeout: float = DEFAULT_TIMEOUT,
        timeout_after_k_min: float = 1.0,
        backward_k_min: int = 1,
        backward_timeout: float = DEFAULT_TIMEOUT,
    ):
        super().__init__()
        if client.dht is None:
            raise ValueError("a mixture finds its experts in the DHT: give it a client with a DHT node")
        if not 1 <= k_min <= k_best:
            raise ValueError(f"need 1 <= k_min <= k_best, got k_min={k_min}, k_best={k_best}")
        self.grid_size = tuple(grid_size)
        self.uid_prefix = uid_prefix
        self.client = client
        self.k_best, self.k_min, self.beam_size = k_best, k_min, beam_size
        self.forward_timeout, self.timeout_after_k_min = forward_timeout, timeout_after_k_min
        self.backward_k_min, self.backward_timeout = backward_k_min, backward_timeout
        self.proj = nn.Linear(in_features, sum(self.grid_size))
        # The last forward's routing, for inspection: chosen experts per sample and which answered.
        self.last_matches: list[list[ExpertMatch]] = []
        self.last_alive: torch.Tensor | None = None

    def _route(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[list[ExpertMatch]]]:
        grid_scores = list(self.proj(x).split(self.grid_size, dim=-1))
        plain = [scores.detach().cpu().tolist() for scores in grid_scores]
        matches = self.client.run(_find, self.client.dht, self.uid_prefix, plain, self.k_best, self.beam_size)
        return grid_scores, matches

    def _call_experts(self, x: torch.Tensor, matches: list[list[ExpertMatch]]) -> tuple[torch.Tensor, torch.Tensor]:
        plan = _Plan(
            self.client,
            _plan_calls(matches),
            self.k_best,
            self.k_min,
            self.backward_k_min,
            self.forward_timeout,
            self.timeout_after_k_min,
            self.backward_timeout,
        )
        outputs, alive = _RemoteMixtureCall.apply(DUMMY, plan, torch.is_grad_enabled(), x)
        self.last_alive, self.last_matches = alive, matches
        return outputs, alive

    def _chosen_logits(self, grid_scores: list[torch.Tensor], matches: list[list[ExpertMatch]]) -> torch.Tensor:
        """``[batch, k_best]`` differentiable scores of the chosen experts (-inf where no expert)."""
        batch = grid_scores[0].shape[0]
        coords = torch.zeros(batch, self.k_best, len(self.grid_size), dtype=torch.long)
        present = torch.zeros(batch, self.k_best, dtype=torch.bool)
        for sample, row in enumerate(matches):
            for slot, match in enumerate(row):
                coords[sample, slot] = torch.tensor(match.coords)
                present[sample, slot] = True
        logits = sum(scores.gather(1, coords[:, :, d]) for d, scores in enumerate(grid_scores))
        return logits.masked_fill(~present, float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid_scores, matches = self._route(x)
        outputs, alive = self._call_experts(x, matches)
        logits = self._chosen_logits(grid_scores, matches).masked_fill(~alive, float("-inf"))
        weights = torch.softmax(logits, dim=1)  # failed experts get 0; the others renormalise to 1
        return torch.einsum("bk,bk...->b...", weights, outputs)


class RemoteSwitchMixtureOfExperts(RemoteMixtureOfExperts):
    """Switch routing: each sample to its top expert(s), scaled by their gate probability.

    ``forward`` returns ``(output, balancing_loss)``. The loss is the Switch Transformer's
    ``n * sum(fraction_routed * mean_probability)`` per grid dimension (summed), which is minimal
    when samples spread evenly over each dimension's coordinates.
    """

    def __init__(self, *, k_best: int = 1, k_min: int = 1, **kwargs: Any):
        super().__init__(k_best=k_best, k_min=k_min, **kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        grid_scores, matches = self._route(x)
        outputs, alive = self._call_experts(x, matches)
        # log P(expert) over the whole grid factorises over dimensions: sum_d log_softmax(s_d)[c_d].
        log_probs = self._chosen_logits([torch.log_softmax(s, dim=-1) for s in grid_scores], matches)
        probs = log_probs.exp()  # 0 where no expert was found
        chosen_mass = probs.sum(dim=1, keepdim=True)
        alive_probs = probs * alive
        # Masked experts' probability goes to the survivors, in proportion to theirs.
        weights = alive_probs * (chosen_mass / alive_probs.sum(dim=1, keepdim=True).clamp_min(1e-9))
        output = torch.einsum("bk,bk...->b...", weights, outputs)
        return output, self._balancing_loss(grid_scores, matches)

    def _balancing_loss(self, grid_scores: list[torch.Tensor], matches: list[list[ExpertMatch]]) -> torch.Tensor:
        loss = grid_scores[0].new_zeros(())
        for d, scores in enumerate(grid_scores):
            size = scores.shape[-1]
            mean_probs = torch.softmax(scores, dim=-1).mean(dim=0)
            counts = torch.zeros(size)
            for row in matches:
                if row:
                    counts[row[0].coords[d]] += 1
            fractions = counts / max(1, len(matches))
            loss = loss + size * (fractions.to(mean_probs) * mean_probs).sum()
        return loss


async def _find(dht, uid_prefix, grid_scores, k_best, beam_size):
    return await find_best_experts(dht, uid_prefix, grid_scores, k_best, beam_size)
