"""A ``torch.optim`` optimizer's state as a fixed list of tensors, so it can be averaged with
peers and handed to newcomers like the parameters are.

Optimizers create their state lazily, on the first step, but matchmaking needs every peer's tensor
list (and its schema) from the start, and a newcomer needs it to download a donor's state into.
``materialize_state`` creates the state up front, for the optimizers whose fresh state is all
zeros (moments, buffers, step counts): it takes one step that moves nothing (learning rates zero,
zero gradients) to get the state's structure, then zeroes it. Each of them then takes its first
real step exactly as a fresh optimizer would. Optimizers whose first step builds state from the
learning rate or the gradient in other ways (NAdam, Rprop, ASGD, SGD with dampening, ...) are not
in that list: unless their state already exists, a peer shares their parameters only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["FUSED_ON_CPU", "fused_where_supported", "materialize_state", "sanitize_state", "state_tensors"]

log = logging.getLogger("peerd.training")

# Exact types (a subclass may build its state differently).
_ZERO_STATE_OPTIMIZERS = (
    torch.optim.SGD,  # momentum_buffer: zeros * momentum + grad == grad, its fresh value, if dampening is 0
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.RAdam,
)


_FUSED_DEVICES = frozenset({"cpu", "cuda"})
# Whether this torch has Adam's fused kernel on a CPU (it has had it on CUDA longer).
FUSED_ON_CPU = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 4)


def fused_where_supported(
    optimizer_class: type[torch.optim.Optimizer], params: Iterable[torch.Tensor], **options: Any
) -> torch.optim.Optimizer:
    """``optimizer_class(params, fused=True, **options)`` where torch has a fused kernel for it and
    these parameters' devices and dtypes, else the class's default implementation.

    Why: Adam's and AdamW's default step on a CPU goes over every parameter and moment one tensor
    and one operation at a time; the fused kernel makes one pass. That is 4.8 -> 1.3 ms a step for
    ``textlm`` small (1.9 M parameters), ~2% of its training step, and the same for an expert's step.
    Torch checks some of the support only at the first step, so this takes the fused kernel only
    for floating-point parameters on a CPU or a CUDA device (where they are when this is called),
    with a torch that has it for both (2.4 and later), and otherwise (or where torch refuses it when
    it is built) the same options without it.

    A checkpoint's parameter groups carry the ``fused`` setting they were saved with, and
    ``load_state_dict`` would take it over: a checkpoint saved without it would turn the kernel
    off, one saved with it would turn it on where this torch or device has none. The optimizer
    keeps the choice made here across loads."""
    params = list(params)
    supported = FUSED_ON_CPU and all(
        isinstance(p, torch.Tensor) and p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params
    )
    optimizer = None
    if supported:
        try:
            optimizer = optimizer_class(params, fused=True, **options)
        except (RuntimeError, TypeError, ValueError):  # (an option the fused kernel lacks)
            pass
    if optimizer is None:
        optimizer = optimizer_class(params, **options)
    if "fused" in optimizer.defaults and hasattr(optimizer, "register_load_state_dict_post_hook"):
        optimizer.register_load_state_dict_post_hook(_keep_kernel_choice(optimizer.defaults["fused"]))
    return optimizer


def _keep_kernel_choice(chosen: bool | None) -> Callable[[torch.optim.Optimizer], None]:
    """A ``load_state_dict`` post hook that puts back the kernel choice ``chosen``. Torch places each
    loaded step count where the *saved* groups' kernel keeps it (the fused kernel on the
    parameter's device, as float32; the default one on the CPU), and the fused CUDA kernel refuses
    a step count on the CPU: the step counts move with the choice."""

    def keep_choice(loaded: torch.optim.Optimizer) -> None:
        for group in loaded.param_groups:
            group["fused"] = chosen
            on_device = bool(chosen) or bool(group.get("capturable"))
            for param in group["params"]:
                state = loaded.state.get(param, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor):
                    place = param.device if on_device else torch.device("cpu")
                    state["step"] = step.to(place, torch.float32 if chosen else step.dtype)

    return keep_choice


def materialize_state(optimizer: torch.optim.Optimizer) -> bool:
    """Make the optimizer's per-parameter state exist now, as a fresh optimizer's would be, without
    changing any parameter or any state that already exists (e.g. loaded from a checkpoint in
    which some parameters never had a gradient). Returns whether every parameter has state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:  # built at construction (Adagrad), stepped or loaded
        return True
    if type(optimizer) not in _ZERO_STATE_OPTIMIZERS or any(g.get("dampening", 0) for g in optimizer.param_groups):
        log.info("%s state is not shared with peers (only the parameters are)", type(optimizer).__name__)
        return False
    before = [p.detach().clone() for p in params]
    saved_grads = [p.grad for p in params]
    lacking = {id(p) for p in missing}
    try:
        with _zero_learning_rates(optimizer), torch.no_grad():
            for p in params:  # optimizers skip parameters without a gradient: their state stays
                p.grad = torch.zeros_like(p) if id(p) in lacking else None
            optimizer.step()
        moved = any(not torch.equal(p, old) for p, old in zip(params, before, strict=True))
    except Exception as error:  # e.g. an option this cannot honour: keep the optimizer as it was
        log.warning("cannot create %s state up front (%s); sharing parameters only", type(optimizer).__name__, error)
        moved = True
    with torch.no_grad():
        for p, old, grad in zip(params, before, saved_grads, strict=True):
            if moved:
                p.copy_(old)
            p.grad = grad
    if moved:
        for p in missing:
            optimizer.state.pop(p, None)
        return False
    for p in missing:
        state = optimizer.state[p]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                state[key] = type(value)(0)
    return True


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating-point tensors of the optimizer's state, in a fixed order (parameter order,
    then state key), so that peers with the same model and optimizer list the same tensors."""
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    tensors.append(value)
    return tensors


@contextmanager
def _zero_learning_rates(optimizer: torch.optim.Optimizer):
    saved = [group.get("lr") for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = torch.zeros_like(group["lr"])
            elif "lr" in group:
                group["lr"] = 0.0
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            if lr is not None:
                group["lr"] = lr


# State entries that are non-negative by construction (step counts, second moments, accumulated
# squares) in the optimizers above and in Adagrad.
_NON_NEGATIVE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "exp_inf", "sum"})


def sanitize_state(optimizer: torch.optim.Optimizer) -> None:
    """Clamp state entries back into the range their optimizer can ever produce (non-negative
    second moments and step counts, centered RMSprop's variance). Honest averages stay in range,
    so this only undoes what a hostile peer sent."""
    with torch.no_grad():
        for state in optimizer.state.values():
            for key in _NON_NEGATIVE & state.keys():
                value = state[key]
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.clamp_(min=0)
            # Centered RMSprop takes sqrt(square_avg - grad_avg**2): a mean of squares is never
            # below the square of the mean, and honest averages keep it that way.
            square_avg, grad_avg = state.get("square_avg"), state.get("grad_avg")
            if isinstance(square_avg, torch.Tensor) and isinstance(grad_avg, torch.Tensor):
                torch.maximum(square_avg, grad_avg * grad_avg, out=square_avg)
