"""``textlm``: a byte-level decoder-only transformer trained on Python's own standard library.

Why this corpus: every machine that runs peerd has it (no download, no licence question), it is
large enough (~12 MB of library code outside the test folders) for models of a few million to a
few hundred million parameters, and text is what swarms like this one are built to train.

The split is by file and deterministic: a file is held out when the first byte of the SHA-256 of
its path (relative to the standard library folder) is below ``HELD_OUT_BELOW`` (~10% of files),
so every peer running the same Python agrees on it without talking. The training files are dealt
to shards by a seeded shuffle (``ShardSpec``). Evaluation is the mean loss over fixed held-out
windows, reported as nats (``loss``), bits per byte (``bits_per_byte``) and next-byte accuracy.

Model: pre-norm blocks (LayerNorm, causal self-attention, GELU MLP), learned positions, output
head tied to the byte embedding. ``MODEL_SIZES`` names the shapes; ``small`` (the default, ~1.9 M
parameters) trains on 2 CPU cores; ``large`` and ``xl`` are GPU sizes. On CUDA the forward pass
runs under bf16 autocast; on CPU it stays float32.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from averaging.optimizer_state import fused_where_supported

from .task_types import ShardSpec, Task, TaskError, model_device

__all__ = [
    "MODEL_SIZES",
    "ModelShape",
    "ByteTransformer",
    "byte_lm_objectives",
    "corpus_files",
    "endless_text_windows",
    "split_corpus",
    "text_windows",
    "textlm_task",
]

HELD_OUT_BELOW = 26  # of 256: ~10% of files are held out
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
EVAL_WINDOWS = 48  # fixed held-out windows per evaluation: enough for a steady figure, cheap on CPU
SEPARATOR = 0  # byte placed between files; never occurs in source text


@dataclass(frozen=True)
class ModelShape:
    width: int
    layers: int
    heads: int
    context: int  # bytes per training window


MODEL_SIZES: dict[str, ModelShape] = {
    "tiny": ModelShape(width=64, layers=2, heads=2, context=64),  # tests: trains in seconds
    "small": ModelShape(width=192, layers=4, heads=4, context=128),  # default: ~1.9 M parameters, CPU
    "base": ModelShape(width=256, layers=6, heads=8, context=256),  # ~4.8 M
    "medium": ModelShape(width=512, layers=8, heads=8, context=256),  # ~25 M
    "large": ModelShape(width=1024, layers=16, heads=16, context=512),  # ~200 M, GPU
    "xl": ModelShape(width=1536, layers=24, heads=16, context=1024),  # ~680 M, GPU
}
DEFAULT_SIZE = "small"


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attention_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class ByteTransformer(nn.Module):
    """Next-byte logits for a batch of byte windows (``[batch, length]`` int64, length ≤ context)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        if shape.width % shape.heads:
            raise TaskError(f"width {shape.width} is not a multiple of {shape.heads} heads")
        self.shape = shape
        self.embed = nn.Embedding(256, shape.width)
        self.position = nn.Parameter(torch.zeros(shape.context, shape.width))
        self.blocks = nn.ModuleList(_Block(shape.width, shape.heads) for _ in range(shape.layers))
        self.final_norm = nn.LayerNorm(shape.width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x) @ self.embed.weight.t()  # the head shares the embedding


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files outside test and package folders, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = [
        path
        for path in root.rglob("*.py")
        if not SKIPPED_FOLDERS.intersection(path.relative_to(root).parts[:-1]) and path.is_file()
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _held_out(relative: str) -> bool:
    return hashlib.sha256(relative.encode()).digest()[0] < HELD_OUT_BELOW


def _concatenate(paths: list[Path]) -> torch.Tensor:
    separator = bytes([SEPARATOR])
    data = separator.join(path.read_bytes() for path in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_corpus(shard: ShardSpec, root: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(this shard's training bytes, all held-out bytes), each as one uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = corpus_files(root)
    held_out: list[Path] = []
    train: list[Path] = []
    for path in files:
        (held_out if _held_out(path.relative_to(root).as_posix()) else train).append(path)
    if len(train) < shard.count or not held_out:
        raise TaskError(f"the standard library at {root} has too few source files for {shard.count} shards")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(shard.seed)).tolist()
    mine = [train[i] for i in order[shard.index :: shard.count]]
    return _concatenate(mine), _concatenate(held_out)


def text_windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    offsets = starts.unsqueeze(1) + torch.arange(length + 1).unsqueeze(0)
    return data[offsets].long()


def endless_text_windows(data: torch.Tensor, batch_size: int, length: int, seed: int) -> Iterator[tuple]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - length - 1, (batch_size,), generator=generator)
        windows = text_windows(data, starts, length)
        yield windows[:, :-1], windows[:, 1:]


def byte_lm_objectives(
    held_out: torch.Tensor,
    context: int,
    device: torch.device,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> tuple[Callable, Callable]:
    """The training loss and the held-out evaluation of a byte-level language model whose
    ``forward(model, tokens)`` gives its logits: the same held-out windows for every peer, bf16
    autocast on CUDA; shared by ``textlm`` and ``hf-lm``, so their figures compare."""
    eval_starts = torch.randint(
        0, len(held_out) - context - 1, (EVAL_WINDOWS,), generator=torch.Generator().manual_seed(4321)
    )
    eval_windows = text_windows(held_out, eval_starts, context).to(device)

    def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.device.type == "cuda"):
            return forward(model, tokens).float()

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = (part.to(model_device(model)) for part in batch)
        return F.cross_entropy(logits_of(model, inputs).reshape(-1, 256), targets.reshape(-1))

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        windows = eval_windows.to(model_device(model))
        logits = logits_of(model, windows[:, :-1]).reshape(-1, 256)
        targets = windows[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits, targets).item()
        return {
            "loss": loss,
            "bits_per_byte": loss / torch.log(torch.tensor(2.0)).item(),
            "accuracy": (logits.argmax(dim=1) == targets).float().mean().item(),
        }

    return loss_fn, evaluate


def textlm_task(
    shard: ShardSpec | None = None,
    device: torch.device | str = "cpu",
    model_size: str = DEFAULT_SIZE,
    batch_size: int = 16,
    root: Path | None = None,
) -> Task:
    """Byte-level language modelling of the standard library (see the module docstring)."""
    if model_size not in MODEL_SIZES:
        raise TaskError(f"unknown model size {model_size!r}: use one of {', '.join(MODEL_SIZES)}")
    device = torch.device(device)
    shape = MODEL_SIZES[model_size]
    shard = shard or ShardSpec()
    train, held_out = split_corpus(shard, root)
    if len(train) <= shape.context + 1 or len(held_out) <= shape.context + 1:
        raise TaskError(f"this shard holds too little text for {shape.context}-byte windows")
    torch.manual_seed(0)  # every peer starts from the same initial model
    model = ByteTransformer(shape).to(device)
    loss_fn, evaluate = byte_lm_objectives(held_out, shape.context, device, lambda model, tokens: model(tokens))

    return Task(
        name=f"textlm-{model_size}",  # the size is part of the name: peers of other sizes never meet
        model=model,
        make_optimizer=lambda params: fused_where_supported(
            torch.optim.AdamW, params, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01
        ),
        batches=endless_text_windows(train, batch_size, shape.context, seed=1000 + shard.index),
        loss_fn=loss_fn,
        evaluate=evaluate,
        batch_size=batch_size,
        target_batch_size=64,  # small swarm batches: early in training more steps beat bigger ones
        validation_batches=endless_text_windows(held_out, batch_size, shape.context, seed=2000 + shard.index),
    )
