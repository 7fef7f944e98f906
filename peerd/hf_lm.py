"""``hf-lm``: any Hugging Face ``transformers`` causal language model, built from its config class
(no weights or tokenizer downloaded), trained on the ``textlm`` corpus (Python's standard library,
as bytes: ``textlm.py``), so a swarm can train the architectures people use (GPT-2, Llama, Qwen,
GPT-NeoX...) with nothing fetched from the network.

``--task hf-lm`` is GPT-2; ``--task hf-lm/MODEL_TYPE`` is any model type ``transformers`` knows
(``hf-lm/llama``, ``hf-lm/qwen2``), built by ``AutoConfig.for_model`` with a 256-byte vocabulary.
``--model-size`` picks a preset shape (``HF_SIZES``), the same for every model type: ``tiny`` for
tests, ``small`` for CPUs, ``gpt2-small`` GPT-2 small's shape (12 layers of 768, 1,024 positions;
85 M parameters with the byte vocabulary). Needs the ``hf`` extra (``pip install 'peerd[hf]'``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from averaging.optimizer_state import fused_where_supported

from .task_types import ShardSpec, Task, TaskError
from .textlm import SEPARATOR, byte_lm_objectives, endless_text_windows, split_corpus

__all__ = ["HF_SIZES", "HF_TASK", "HfShape", "hf_config", "hf_lm_task", "hf_model_type"]

HF_TASK = "hf-lm"
DEFAULT_MODEL_TYPE = "gpt2"
VOCAB = 256  # bytes


@dataclass(frozen=True)
class HfShape:
    hidden: int
    layers: int
    heads: int
    context: int  # bytes per training window (and the model's positions)


HF_SIZES: dict[str, HfShape] = {
    "tiny": HfShape(hidden=64, layers=2, heads=2, context=64),  # tests: trains in seconds on a CPU
    "small": HfShape(hidden=256, layers=4, heads=4, context=128),  # ~3 M parameters, CPUs
    "gpt2-small": HfShape(hidden=768, layers=12, heads=12, context=1024),  # GPT-2 small's shape, GPUs
}
DEFAULT_HF_SIZE = "small"


def hf_model_type(spec: str) -> str | None:
    """The model type a task spec names (``hf-lm``: GPT-2), or None for a spec that is not ours."""
    if spec == HF_TASK:
        return DEFAULT_MODEL_TYPE
    prefix = HF_TASK + "/"
    return spec[len(prefix) :] or None if spec.startswith(prefix) else None


def _transformers():
    try:
        import transformers
    except ImportError:
        raise TaskError("the hf-lm task needs transformers: pip install 'peerd[hf]'") from None
    return transformers


def _causal_lm_types() -> Collection[str]:
    """The model types ``AutoModelForCausalLM`` builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def hf_config(model_type: str, size: str):
    """The config of ``model_type`` in the preset shape ``size``, with the byte vocabulary."""
    if size not in HF_SIZES:
        raise TaskError(f"unknown model size {size!r} for hf-lm: use one of {', '.join(HF_SIZES)}")
    shape = HF_SIZES[size]
    transformers = _transformers()
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError:
        known = "transformers.CONFIG_MAPPING lists them"
        raise TaskError(f"transformers does not know model type {model_type!r} ({known})") from None
    if model_type not in _causal_lm_types():  # e.g. t5: a config, but no causal LM to build
        raise TaskError(f"transformers has no causal language model of type {model_type!r} (hf-lm trains those)")
    options = dict(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=4 * shape.hidden,
        max_position_embeddings=shape.context,
        bos_token_id=SEPARATOR,
        eos_token_id=SEPARATOR,
    )
    if "num_key_value_heads" in config_class().to_dict():
        options["num_key_value_heads"] = shape.heads  # plain multi-head attention in every model type
    return config_class(**options)


def hf_lm_task(
    shard: ShardSpec | None = None,
    device: torch.device | str = "cpu",
    model_size: str = DEFAULT_HF_SIZE,
    model_type: str = DEFAULT_MODEL_TYPE,
    batch_size: int = 16,
) -> Task:
    """A ``model_type`` causal LM from its config (see the module docstring) on the textlm corpus."""
    config = hf_config(model_type, model_size)
    shape = HF_SIZES[model_size]
    device = torch.device(device)
    shard = shard or ShardSpec()
    train, held_out = split_corpus(shard)
    if len(train) <= shape.context + 1 or len(held_out) <= shape.context + 1:
        raise TaskError(f"this shard holds too little text for {shape.context}-byte windows")
    torch.manual_seed(0)  # every peer starts from the same initial model
    model = _transformers().AutoModelForCausalLM.from_config(config).to(device)
    loss_fn, evaluate = byte_lm_objectives(
        held_out, shape.context, device, lambda model, tokens: model(input_ids=tokens).logits
    )

    return Task(
        name=f"hf-lm-{model_type}-{model_size}",  # peers of another architecture or size never meet
        model=model,
        make_optimizer=lambda params: fused_where_supported(
            torch.optim.AdamW, params, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01
        ),
        batches=endless_text_windows(train, batch_size, shape.context, seed=1000 + shard.index),
        loss_fn=loss_fn,
        evaluate=evaluate,
        batch_size=batch_size,
        target_batch_size=64,
    )
