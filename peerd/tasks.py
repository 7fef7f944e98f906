"""Training tasks: what a peer trains. A task bundles the model, this peer's data shard, the loss
and an evaluation, so the daemon can train anything a user describes in one factory function.

Built in: ``digits`` (the handwritten digits data that ships inside scikit-learn; a small MLP),
``textlm`` (a byte-level transformer on Python's standard library; ``peerd.textlm``) and ``hf-lm``
(any ``transformers`` causal LM built from its config, on the same corpus; ``peerd.hf_lm``).
Users give their own with ``--task package.module:factory``; the factory is called as
``factory(shard=ShardSpec, device=torch.device)`` and returns a ``Task``. Its loss and evaluation
should move batches to the model's device (``task_types.model_device``), as the built-in ones do:
with ``--shard-model`` the task is loaded on the host and its loss computed by a sharded copy of
the model on the GPUs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from averaging.optimizer_state import fused_where_supported

from .hf_lm import DEFAULT_HF_SIZE, hf_config, hf_lm_task, hf_model_type
from .task_types import ShardSpec, Task, TaskError, model_device
from .textlm import DEFAULT_SIZE, MODEL_SIZES, textlm_task

WHOLE_DATA = ShardSpec()  # the default shard: all of a task's training data

__all__ = [
    "Task",
    "ShardSpec",
    "TaskError",
    "load_task",
    "check_task",
    "task_name",
    "digits_task",
    "digits_data",
    "endless_batches",
    "textlm_task",
    "hf_lm_task",
    "BUILTIN_TASKS",
]


def endless_batches(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, seed: int):
    """Shuffled batches forever; a shard smaller than one batch is one (smaller) batch, so a peer
    on a thin shard still trains instead of waiting forever for a full batch."""
    batch_size = min(batch_size, len(inputs))
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(inputs), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            yield inputs[index], targets[index]


def digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits images (scaled to [0, 1]), their labels, and the indices of the training and the
    held-out split (20%, the same for every peer: a seeded shuffle)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - scikit-learn is a dependency
        raise TaskError("the digits task needs scikit-learn (pip install scikit-learn)") from error
    data = load_digits()
    inputs = torch.tensor(data.data, dtype=torch.float32) / 16.0
    targets = torch.tensor(data.target, dtype=torch.long)
    split = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(12345))
    return inputs, targets, split[len(split) // 5 :], split[: len(split) // 5]


def digits_task(shard: ShardSpec = WHOLE_DATA, device: torch.device | str = "cpu", batch_size: int = 32) -> Task:
    """8x8 handwritten digits (1,797 images shipped with scikit-learn), 20% held out for evaluation."""
    device = torch.device(device)
    inputs, targets, train, held_out = digits_data()
    mine = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(shard.seed))][
        shard.index :: shard.count
    ]
    if len(mine) == 0:
        empty = f"shard {shard.index}/{shard.count} of digits is empty ({len(train)} training images)"
        raise TaskError(f"{empty}: use fewer shards")
    torch.manual_seed(0)  # every peer starts from the same initial model
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    test_x, test_y = inputs[held_out].to(device), targets[held_out].to(device)
    # what peers score contributions against: training images every peer holds, never the ones
    # accuracy is reported on
    validation = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(99))[:VALIDATION]]

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (part.to(model_device(model)) for part in batch)
        return nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(model: nn.Module) -> dict[str, float]:
        where = model_device(model)
        logits, labels = model(test_x.to(where)), test_y.to(where)
        return {
            "accuracy": (logits.argmax(dim=1) == labels).float().mean().item(),
            "loss": nn.functional.cross_entropy(logits, labels).item(),
        }

    return Task(
        name="digits",
        model=model,
        make_optimizer=lambda params: fused_where_supported(torch.optim.Adam, params, lr=3e-3),
        batches=endless_batches(inputs[mine], targets[mine], batch_size, seed=1000 + shard.index),
        loss_fn=loss_fn,
        evaluate=evaluate,
        batch_size=batch_size,
        target_batch_size=256,
        validation_batches=endless_batches(
            inputs[validation].to(device), targets[validation].to(device), VALIDATION_BATCH, seed=2000 + shard.index
        ),
    )


VALIDATION = 256  # digits: training images set apart as every peer's scoring data
VALIDATION_BATCH = 64  # samples a contribution score's reference gradient is taken on

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"digits": digits_task, "textlm": textlm_task}
SIZED_TASKS = frozenset({"textlm"})  # built-in tasks that take a model size


def check_task(spec: str, model_size: str | None = None) -> None:
    """Fail now, with a clear message, on a task that ``load_task`` would refuse. Built-in tasks
    are checked by name (cheap: no data read, no model built); a factory is loaded and called."""
    if spec in SIZED_TASKS and model_size is not None:
        if model_size not in MODEL_SIZES:
            raise TaskError(f"unknown model size {model_size!r}: use one of {', '.join(MODEL_SIZES)}")
        return
    model_type = hf_model_type(spec)
    if model_type is not None:  # the config is built (cheap: no weights), which names a bad type or size
        hf_config(model_type, model_size or DEFAULT_HF_SIZE)
        return
    if spec not in BUILTIN_TASKS or model_size is not None:
        load_task(spec, model_size=model_size)


def task_name(spec: str, model_size: str | None = None) -> str:
    """The name a task's peers meet under (the prefix of its DHT keys), known before its data loads
    for built-in tasks; a factory's task is built once to learn it."""
    return known_task_name(spec, model_size) or load_task(spec, model_size=model_size).name


def known_task_name(spec: str, model_size: str | None = None) -> str | None:
    """``task_name`` of a built-in or ``transformers`` task, which needs nothing built; None for a
    factory's."""
    if spec == "digits":
        return "digits"
    if spec == "textlm":
        return f"textlm-{model_size or DEFAULT_SIZE}"
    model_type = hf_model_type(spec)
    if model_type is not None:
        return f"hf-lm-{model_type}-{model_size or DEFAULT_HF_SIZE}"
    return None


def load_task(
    spec: str, shard: ShardSpec = WHOLE_DATA, device: torch.device | str = "cpu", model_size: str | None = None
) -> Task:
    """A built-in task by name, or ``package.module:factory``; ``model_size`` only for sized tasks."""
    model_type = hf_model_type(spec)
    if model_type is not None:
        size = model_size or DEFAULT_HF_SIZE
        return hf_lm_task(shard=shard, device=device, model_size=size, model_type=model_type)
    if model_size is not None and spec not in SIZED_TASKS:
        raise TaskError(f"--model-size applies to {', '.join(sorted(SIZED_TASKS))}, not to {spec!r}")
    if spec in BUILTIN_TASKS:
        options = {} if model_size is None else {"model_size": model_size}
        return BUILTIN_TASKS[spec](shard=shard, device=device, **options)
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskError(f"unknown task {spec!r}: use one of [{known}] or package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise TaskError(f"cannot load task factory {spec!r}: {error}") from None
    task = factory(shard=shard, device=torch.device(device))
    if not isinstance(task, Task):
        raise TaskError(f"task factory {spec!r} returned {type(task).__name__}, not peerd.tasks.Task")
    return task
