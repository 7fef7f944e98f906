"""Hugging Face ``transformers`` as peerd trains it: the ``hf-lm`` task (a causal LM from its config
class on the textlm corpus, ``peerd/hf_lm.py``) and two ``transformers.Trainer`` processes that are
swarm peers through ``SwarmOptimizer`` (``peerd/hf_trainer.py``, ``peerd/swarm_optimizer.py``)."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from peerd.hf_lm import HF_SIZES, hf_config
from peerd.task_types import TaskError
from peerd.tasks import check_task, load_task, task_name

ROOT = Path(__file__).resolve().parents[2]


def test_any_model_type_is_built_from_its_config_in_a_preset_shape_and_learns():
    for spec in ("hf-lm", "hf-lm/llama"):
        task = load_task(spec, model_size="tiny")
        assert task.name == task_name(spec, "tiny")
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
    small = hf_config("gpt2", "gpt2-small")  # GPT-2 small's shape, with the byte vocabulary
    assert (small.n_embd, small.n_layer, small.n_head, small.n_positions, small.vocab_size) == (768, 12, 12, 1024, 256)
    with pytest.raises(TaskError, match="does not know model type 'nope'"):
        check_task("hf-lm/nope", "tiny")
    with pytest.raises(TaskError, match="unknown model size 'huge'"):
        check_task("hf-lm", "huge")


def hf_peer(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tests.support.hf_peer", *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_line(process: subprocess.Popen, timeout: float) -> dict:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if selector.select(deadline - time.monotonic()):
                line = process.stdout.readline()
                if line.startswith("{"):
                    return json.loads(line)
                assert line, process.stderr.read()
    raise AssertionError(f"no line within {timeout} s")


def last_json(process: subprocess.Popen, timeout: float) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return json.loads([line for line in out.splitlines() if line.startswith('{"losses"')][-1])


def test_two_transformers_trainers_train_as_one_swarm():
    first = hf_peer("--steps", "30")
    second = None
    try:
        address = first_line(first, 60)["address"]
        second = hf_peer("--steps", "30", "--shard", "1", "--initial-peer", address)
        results = [last_json(second, 120), last_json(first, 60)]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
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
