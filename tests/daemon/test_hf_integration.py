"""Hugging Face ``transformers`` as peerd trains it: the ``hf-lm`` task (a causal LM from its config
class on the textlm corpus, ``peerd/hf_lm.py``) and two ``transformers.Trainer`` processes that are
swarm peers through ``SwarmOptimizer`` (``peerd/hf_trainer.py``, ``peerd/swarm_optimizer.py``)."""

from __future__ import annotations

import pytest
import torch

from peerd.hf_lm import HF_SIZES, hf_config
from peerd.task_types import TaskError
from peerd.tasks import check_task, load_task, task_name
from tests.support.script_peers import ScriptPeer


def test_any_model_type_is_built_from_its_config_in_a_preset_shape_and_learns():
    task = load_task("hf-lm", model_size="tiny")
    assert task.name == task_name("hf-lm", "tiny") == "hf-lm-gpt2-tiny"
    optimizer = task.make_optimizer(list(task.model.parameters()))
    batch = next(task.batches)
    assert batch[0].shape[1] == HF_SIZES["tiny"].context
    before = task.loss_fn(task.model, batch).item()
    for _ in range(5):
        task.loss_fn(task.model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert task.loss_fn(task.model, batch).item() < before - 0.5
    assert set(task.evaluate(task.model)) >= {"loss", "bits_per_byte", "accuracy"}
    from transformers import AutoModelForCausalLM

    for model_type in ("llama", "qwen2"):  # other architectures, same shape and byte vocabulary
        model = AutoModelForCausalLM.from_config(hf_config(model_type, "tiny"))
        assert model(input_ids=batch[0][:2]).logits.shape == (2, HF_SIZES["tiny"].context, 256)
    small = hf_config("gpt2", "gpt2-small")  # GPT-2 small's shape, with the byte vocabulary
    assert (small.n_embd, small.n_layer, small.n_head, small.n_positions, small.vocab_size) == (768, 12, 12, 1024, 256)
    with pytest.raises(TaskError, match="does not know model type 'nope'"):
        check_task("hf-lm/nope", "tiny")
    with pytest.raises(TaskError, match="no causal language model of type 't5'"):  # a config, no causal LM
        check_task("hf-lm/t5", "tiny")
    with pytest.raises(TaskError, match="unknown model size 'huge'"):
        check_task("hf-lm", "huge")


def test_two_transformers_trainers_train_as_one_swarm():
    with ScriptPeer("tests.support.hf_peer", "--steps", "30") as first:
        address = first.first_json(60)["address"]
        with ScriptPeer("tests.support.hf_peer", "--steps", "30", "--shard", "1", "--initial-peer", address) as second:
            results = [second.last_json(120), first.last_json(60)]
    for result in results:
        losses = result["losses"]
        assert losses[-1] < losses[0] - 0.5, losses  # it trains
        assert result["averaged"] >= 2 and result["epoch"] >= 3, result  # with the other peer
    assert torch.isfinite(torch.tensor([loss for result in results for loss in result["losses"]])).all()


def test_a_trainers_optimizer_step_counts_its_batch_for_the_swarm_and_runs_lightnings_closure(tmp_path):
    from transformers import TrainingArguments

    from peerd.hf_trainer import hf_swarm_optimizer
    from peerd.swarm_optimizer import SwarmOptimizer

    model = torch.nn.Linear(4, 2)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=4, use_cpu=True
    )
    optimizer = hf_swarm_optimizer(model, args, run_id="counting", target_batch_size=1000)
    try:
        assert optimizer.param_groups is optimizer.inner.param_groups  # schedulers move the real one
        # accelerate's wrapper (and a resumed checkpoint) reload the inner optimizer's state, which
        # replaces its groups: a scheduler made afterwards must still move the inner optimizer's
        optimizer.load_state_dict(optimizer.state_dict())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        scheduler.step()
        assert optimizer.inner.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.5 * args.learning_rate
        calls = []

        def closure() -> torch.Tensor:
            calls.append(1)
            loss = model(torch.ones(3, 4)).sum()
            loss.backward()
            return loss

        assert optimizer.step(closure) is not None and calls == [1]
        optimizer.step()
        assert optimizer.swarm.local_samples == 2 * 8 * 4 and optimizer.epoch == 0  # not at the target yet
    finally:
        optimizer.shutdown()
    with pytest.raises(ValueError, match="mode must be one of"):
        SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), run_id="x", batch_size_per_step=1, mode="nope")


@pytest.mark.slow
def test_a_transformers_trainer_under_torchrun_is_one_peer(tmp_path):
    """Two DDP ranks of one trainer are one peer: rank 0 alone joins and averages with the lone peer,
    and the other rank ends with rank 0's parameters."""
    import shutil

    torchrun = (shutil.which("torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()))
    with ScriptPeer("tests.support.hf_peer", "--steps", "30") as lone:
        address = lone.first_json(60)["address"]
        args = ("--steps", "30", "--shard", "1", "--initial-peer", address)
        with ScriptPeer("tests.support.hf_peer", *args, launcher=torchrun) as machine:
            ranks = {line["rank"]: line for line in machine.json_lines(180) if "rank" in line}
            alone = lone.last_json(60)
    assert set(ranks) == {0, 1}
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9)  # one model on the machine
    for result in (ranks[0], alone):
        assert result["losses"][-1] < result["losses"][0] - 0.5, result
        assert result["averaged"] >= 2, result  # the machine and the lone peer averaged together


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
