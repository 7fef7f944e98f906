"""Expert block types and the backend that owns one expert's module, optimizer and compute.

An expert maps a batch ``[batch, *sample_shape]`` to a batch of the same shape. Built-in types are
``ffn`` (a transformer feed-forward block) and ``transformer`` (one encoder layer over
``[batch, seq, hidden]``); any other ``nn.Module`` class can be named by import path
(``package.module:ClassName``) and is built as ``ClassName(hidden_dim)``.

``ExpertBackend`` methods are synchronous and meant to run on the server's compute thread
(``peer.worker_threads.ComputeThread``) under its compute limiter, so at most one of them touches
an expert at a time and the event loop never waits on torch; ``check_input`` is the exception, run
on the loop as a request arrives, and its pass over the values starts no parallel work.

An expert is shared by callers it cannot trust, so it protects itself: it refuses non-finite inputs
and output gradients (``check_input``), and each caller's share of a training step is its own
parameter gradient clipped to ``clip_grad_norm`` before the batch's sum is clipped again, so one
caller's huge or hostile gradient moves the expert no further than any honest caller's could. A
caller whose gradient comes out non-finite anyway (finite but extreme values that overflow) gets an
error and contributes nothing; the others' step goes ahead.
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from averaging.optimizer_state import fused_where_supported
from peer.tensors import all_finite, all_finite_serial

__all__ = [
    "BLOCK_TYPES",
    "BlockType",
    "ExpertBackend",
    "RefusedGradient",
    "SavedGraph",
    "DEFAULT_CLIP_GRAD_NORM",
    "resolve_block_type",
    "default_device",
]

# Per caller and per batch, the parameter gradient's L2 norm is clipped to this: 1.0 is the global
# norm clip of standard transformer training (BERT, GPT-3, Megatron), so honest callers of a
# well-scaled model are rarely clipped, while one caller can move the expert by no more than one
# such step, whatever it sends. Adam's second moment stays bounded by it too (a 1e30 gradient
# would otherwise fill it with ~1e60 and freeze the expert).
DEFAULT_CLIP_GRAD_NORM = 1.0


class RefusedGradient(ValueError):
    """One caller's contribution was not finite: refused to that caller alone."""


@dataclass(frozen=True, eq=False)
class SavedGraph:
    """A forward's autograd graph, for the backward that follows: its inputs (which require grad),
    its outputs, and ``nbytes``, what the graph holds (inputs, outputs and the activations autograd
    saved, each storage once; the module's parameters and buffers are the expert's, not the graph's)."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    nbytes: int


@dataclass(frozen=True)
class BlockType:
    """How to build one kind of expert: ``build(hidden_dim)`` and the shape of one sample
    (``None`` = any length, e.g. a sequence dimension)."""

    build: Callable[[int], nn.Module]
    sample_shape: Callable[[int], tuple[int | None, ...]]


class FeedForward(nn.Module):
    """The transformer FFN block (hidden -> 4 hidden -> hidden), the classic MoE expert."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.up = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.down = nn.Linear(4 * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _transformer(hidden_dim: int) -> nn.Module:
    # 64-dimensional heads as in BERT/GPT; at least one head for tiny test models.
    heads = max(1, hidden_dim // 64)
    while hidden_dim % heads:
        heads -= 1
    return nn.TransformerEncoderLayer(hidden_dim, heads, dim_feedforward=4 * hidden_dim, dropout=0.0, batch_first=True)


BLOCK_TYPES: dict[str, BlockType] = {
    "ffn": BlockType(FeedForward, lambda hidden: (hidden,)),
    "transformer": BlockType(_transformer, lambda hidden: (None, hidden)),
}


def resolve_block_type(name: str) -> BlockType:
    """A built-in block type, or ``module:Class`` imported (the operator's own code, never the network's).

    A custom class may define ``sample_shape(hidden_dim)`` as a static method; otherwise samples are
    vectors of ``hidden_dim``.
    """
    if name in BLOCK_TYPES:
        return BLOCK_TYPES[name]
    module_name, sep, class_name = name.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"unknown expert type {name!r}: use one of {sorted(BLOCK_TYPES)} or 'package.module:Class'")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{name!r} does not name an nn.Module class")
    shape = getattr(cls, "sample_shape", None)
    return BlockType(cls, shape if callable(shape) else (lambda hidden: (hidden,)))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ExpertBackend:
    """One expert: module + optimizer + the rules for what input it accepts.

    A forward that will be followed by a backward may return its autograd graph
    (``forward_keeping_graph``) for the server to keep (``moe/saved_graphs.py``), so that the
    backward does not recompute the forward. A graph is only valid until the next optimizer step
    changes the parameters in place: the server drops an expert's graphs when a backward of it
    begins, and a backward without one recomputes from its inputs.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sample_shape: tuple[int | None, ...],
        device: torch.device | str | None = None,
        clip_grad_norm: float = DEFAULT_CLIP_GRAD_NORM,
    ):
        if not clip_grad_norm > 0:
            raise ValueError("clip_grad_norm must be positive")
        self.clip_grad_norm = float(clip_grad_norm)
        self.device = torch.device(device) if device is not None else default_device()
        self.module = module.to(self.device)
        if optimizer is None:
            optimizer = fused_where_supported(torch.optim.Adam, self.module.parameters(), lr=1e-3)
        self.optimizer = optimizer
        self.sample_shape = tuple(sample_shape)
        self.dtype = next(self.module.parameters()).dtype
        self.steps = 0
        # A gradient waits in the parameters for ``step`` (``input_gradients_per_caller`` left it).
        self.step_pending = False

    @classmethod
    def create(
        cls,
        block_type: str,
        hidden_dim: int,
        *,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
        clip_grad_norm: float = DEFAULT_CLIP_GRAD_NORM,
    ) -> ExpertBackend:
        block = resolve_block_type(block_type)
        if seed is not None:
            torch.manual_seed(seed)
        # (on its device first: an optimizer takes its kernel for where the parameters are)
        module = block.build(hidden_dim).to(torch.device(device) if device is not None else default_device())
        opt = optimizer(module.parameters()) if optimizer is not None else None
        return cls(
            module, opt, sample_shape=block.sample_shape(hidden_dim), device=device, clip_grad_norm=clip_grad_norm
        )

    def check_input(self, tensor: torch.Tensor, what: str = "inputs") -> None:
        """Raise ValueError (a BadRequest on the wire) unless ``tensor`` is a batch of samples."""
        if tensor.dtype != self.dtype:
            raise ValueError(f"{what} must be {str(self.dtype).removeprefix('torch.')}, got {tensor.dtype}")
        shape = tuple(tensor.shape[1:])
        expected = self.sample_shape
        if tensor.dim() != len(expected) + 1 or any(
            e is not None and e != s for e, s in zip(expected, shape, strict=True)
        ):
            wanted = ", ".join("*" if e is None else str(e) for e in expected)
            raise ValueError(f"{what} must have shape [batch, {wanted}], got {list(tensor.shape)}")
        if tensor.shape[0] == 0:
            raise ValueError(f"{what} is an empty batch")
        if not all_finite_serial(tensor):  # (on the server's loop: see its ComputeThread)
            raise ValueError(f"{what} contain NaN or Inf; refused (the expert is shared with other callers)")

    # ------------------------------------------------------------------ compute (the compute thread)
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Outputs for ``inputs``, keeping no graph."""
        with torch.no_grad():
            return self.module(inputs.to(self.device, non_blocking=True)).to("cpu")

    def forward_keeping_graph(self, inputs: torch.Tensor) -> tuple[torch.Tensor, SavedGraph]:
        """Outputs for ``inputs``, and the graph for ``backward_per_caller(saved=...)``, measured as
        autograd saves its tensors."""
        x = inputs.to(self.device, non_blocking=True).detach().requires_grad_(True)
        own = {t.untyped_storage().data_ptr() for t in (*self.module.parameters(), *self.module.buffers())}
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in own:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            y = self.module(x)
        for tensor in (x, y):
            pack(tensor)
        return y.detach().to("cpu"), SavedGraph(x, y, sum(storages.values()))

    def backward(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, saved: SavedGraph | None = None
    ) -> torch.Tensor:
        """Gradient w.r.t. ``inputs`` of one caller; also takes one optimizer step on its (clipped)
        parameter gradient. Raises RefusedGradient if that gradient is not finite."""
        [result] = self.backward_per_caller(inputs, grad_outputs, [inputs.shape[0]], saved)
        if isinstance(result, Exception):
            raise result
        return result

    def backward_per_caller(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, sizes: Sequence[int], saved: SavedGraph | None = None
    ) -> list[torch.Tensor | RefusedGradient]:
        """``input_gradients_per_caller``, then the optimizer step on what it left (``step``)."""
        results = self.input_gradients_per_caller(inputs, grad_outputs, sizes, saved)
        self.step()
        return results

    def input_gradients_per_caller(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, sizes: Sequence[int], saved: SavedGraph | None = None
    ) -> list[torch.Tensor | RefusedGradient]:
        """Input gradients for a batch of callers (``sizes``: their rows, in order). Leaves the sum
        of their parameter gradients, each clipped to ``clip_grad_norm`` and the sum clipped again,
        in the parameters' ``grad`` for ``step``: the callers need only their input gradients, so a
        server answers them before it steps. A caller whose gradient is not finite gets a
        RefusedGradient in its place and adds nothing to the step.

        Each caller's parameter gradient needs its own backward pass through the batch's graph, so
        a batch of k callers costs k backward passes (one when a caller is alone). ``saved``: the
        graph of these inputs' forward, if it was kept (used if its shape matches). A step still
        pending from the last call is taken first: its gradient is never overwritten."""
        self.step()
        if saved is not None and saved.inputs.shape == inputs.shape:
            x, y = saved.inputs, saved.outputs
        else:
            x = inputs.to(self.device, non_blocking=True).detach().requires_grad_(True)
            with torch.enable_grad():
                y = self.module(x)
        grad = grad_outputs.to(self.device, non_blocking=True)
        params = [p for p in self.module.parameters() if p.requires_grad]
        total: list[torch.Tensor] | None = None  # the clipped gradients' sum, once one contributed
        total_norm = 0.0  # its norm while a single gradient makes it up (else measured at the end)
        contributors = 0
        results: list[torch.Tensor | RefusedGradient] = []
        start = 0
        for index, size in enumerate(sizes):
            rows = slice(start, start + size)
            start += size
            found = torch.autograd.grad(
                y[rows], [x, *params], grad[rows], retain_graph=index + 1 < len(sizes), allow_unused=True
            )
            grad_x = found[0][rows] if found[0] is not None else torch.zeros_like(x[rows])
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, found[1:], strict=True)]
            norm = _norm(grads)
            if not (math.isfinite(norm) and all_finite(grad_x)):
                results.append(RefusedGradient("the gradient of this call is not finite; the expert ignored it"))
                continue
            scale = _clip_scale(norm, self.clip_grad_norm)
            if total is None:  # the gradients autograd just made are ours to scale in place
                total, total_norm = _scaled(grads, scale), norm * scale
            else:
                for accumulated, g in zip(total, grads, strict=True):
                    accumulated.add_(g, alpha=scale)
            contributors += 1
            results.append(grad_x.to("cpu"))
        if total is not None:
            norm = total_norm if contributors == 1 else _norm(total)
            scale = _clip_scale(norm, self.clip_grad_norm)
            for p, g in zip(params, _scaled(total, scale), strict=True):
                p.grad = g
            self.step_pending = True
        return results

    def step(self) -> bool:
        """The optimizer step on the gradient ``input_gradients_per_caller`` left; False (and no
        step) when it left none (every caller refused, or already stepped)."""
        if not self.step_pending:
            return False
        self.step_pending = False
        try:
            self.optimizer.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, then rename) so a crash never leaves half a checkpoint."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(self.state_dict(), file)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, path: Path) -> None:
        # weights_only: a checkpoint file is still parsed without executing code from it.
        self.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))


def _clip_scale(norm: float, limit: float) -> float:
    """What a gradient of L2 norm ``norm`` is multiplied by to be at most ``limit``: 1 within it
    (and within rounding of it, so that a sum made of one clipped gradient is not scaled again)."""
    return 1.0 if norm <= limit * (1 + 1e-6) else limit / norm


def _scaled(tensors: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``tensors`` multiplied by ``scale`` in place; a gradient within the clip norm (scale 1) is
    left untouched rather than rewritten, a pass over every parameter saved."""
    if scale != 1.0:
        torch._foreach_mul_(tensors, scale)
    return tensors


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together, in float64 so that large finite values do not
    overflow to inf on the way (a 1e30 gradient squared is past float32's range)."""
    if not tensors:
        return 0.0
    # float32 first (no float64 copy of every gradient); only a sum that overflowed is redone
    squares = sum(float(torch.linalg.vector_norm(t.detach())) ** 2 for t in tensors)
    if math.isfinite(squares):
        return math.sqrt(squares)
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))
