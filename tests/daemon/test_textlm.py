"""The ``textlm`` task: a deterministic file-level split of the standard library, disjoint shards,
a causal byte transformer that learns, and evaluation figures that agree with each other."""

import math
from pathlib import Path

import pytest
import torch

from averaging.optimizer_state import FUSED_ON_CPU
from peerd.tasks import ShardSpec, TaskError, load_task
from peerd.textlm import MODEL_SIZES, ByteTransformer, corpus_files, split_corpus, textlm_task


def _library(root: Path, files: int) -> Path:
    """A stand-in standard library: ``files`` modules plus ones the corpus must skip."""
    for index in range(files):
        folder = root / f"pkg{index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"module{index}.py").write_text(f"def function_{index}(value):\n    return value * {index}\n" * 20)
    for skipped in ("test", "site-packages"):
        (root / skipped).mkdir(exist_ok=True)
        (root / skipped / "ignored.py").write_text("IGNORED = True\n" * 50)
    return root


def test_corpus_skips_tests_and_installed_packages(tmp_path):
    root = _library(tmp_path, 12)
    files = corpus_files(root)
    assert len(files) == 12
    assert all("ignored" not in path.name for path in files)
    assert files == sorted(files, key=lambda path: path.relative_to(root).as_posix())


def test_shards_are_disjoint_cover_the_training_files_and_never_hold_held_out_text(tmp_path):
    root = _library(tmp_path, 200)
    shards = [split_corpus(ShardSpec(index, 3), root) for index in range(3)]
    whole_train, held_out = split_corpus(ShardSpec(0, 1), root)
    names = [{line for line in bytes(train.numpy()).split(b"\n") if line.startswith(b"def")} for train, _ in shards]
    held_names = {line for line in bytes(held_out.numpy()).split(b"\n") if line.startswith(b"def")}
    assert all(names) and held_names, "every shard and the held-out part hold some files"
    assert not names[0] & names[1] and not names[1] & names[2] and not names[0] & names[2]
    assert not (names[0] | names[1] | names[2]) & held_names
    assert sum(len(train) for train, _ in shards) == len(whole_train) - 2  # two fewer separators
    assert all(torch.equal(shard_held_out, held_out) for _, shard_held_out in shards)
    again = split_corpus(ShardSpec(1, 3), root)
    assert torch.equal(again[0], shards[1][0]), "the split is deterministic"


def test_the_real_standard_library_gives_megabytes_of_text():
    train, held_out = split_corpus(ShardSpec())
    assert len(train) > 1_000_000 and len(held_out) > 100_000
    assert 0.03 < len(held_out) / (len(train) + len(held_out)) < 0.3


def test_the_model_is_causal():
    torch.manual_seed(0)
    model = ByteTransformer(MODEL_SIZES["tiny"]).eval()
    tokens = torch.randint(0, 256, (2, 32))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, :20], after[:, :20], atol=1e-5)
    assert not torch.allclose(before[:, 20:], after[:, 20:], atol=1e-3)


def test_tiny_model_learns_and_reports_bits_per_byte(tmp_path):
    task = textlm_task(model_size="tiny", batch_size=8, root=_library(tmp_path, 40))
    optimizer = task.make_optimizer(list(task.model.parameters()))
    assert bool(optimizer.defaults["fused"]) == FUSED_ON_CPU  # one pass over each tensor a step, not several
    before = task.evaluate(task.model)
    assert before["bits_per_byte"] == pytest.approx(before["loss"] / math.log(2))
    for _ in range(60):
        task.loss_fn(task.model, next(task.batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = task.evaluate(task.model)
    assert after["bits_per_byte"] < before["bits_per_byte"] - 2.0, (before, after)
    assert after["accuracy"] > before["accuracy"]


def test_every_peer_starts_from_the_same_model(tmp_path):
    root = _library(tmp_path, 30)
    first = textlm_task(ShardSpec(0, 2), model_size="tiny", root=root)
    second = textlm_task(ShardSpec(1, 2), model_size="tiny", root=root)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_model_size_is_checked_by_name_and_task():
    with pytest.raises(TaskError, match="unknown model size 'huge'"):
        load_task("textlm", model_size="huge")
    with pytest.raises(TaskError, match="applies to textlm, not to 'digits'"):
        load_task("digits", model_size="small")
    assert load_task("textlm", model_size="tiny").name == "textlm-tiny"  # sizes never meet


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_runs_under_bf16_autocast_and_returns_float32_loss(tmp_path):
    task = textlm_task(device="cuda", model_size="tiny", root=_library(tmp_path, 20))
    loss = task.loss_fn(task.model, next(task.batches))
    assert loss.dtype == torch.float32 and loss.device.type == "cuda"
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in task.model.parameters())


async def test_two_peers_train_textlm_together_and_report_bits_per_byte(tmp_path):
    import trio

    from averaging.optimizer import CollaborativeOptimizer
    from peerd.training import Trainer
    from tests.daemon.test_training import FAST, open_swarm

    root = _library(tmp_path, 40)
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 2)
        trainers = []
        for index, node in enumerate(nodes):
            task = textlm_task(ShardSpec(index, 2), model_size="tiny", batch_size=8, root=root)
            optimizer = CollaborativeOptimizer(
                task.make_optimizer(list(task.model.parameters())),
                node,
                prefix="textlm-test",
                target_batch_size=32,
                target_group_size=2,
                **FAST,
            )
            trainers.append(Trainer(task, optimizer))
        first = trainers[0].task.evaluate(trainers[0].task.model)["bits_per_byte"]
        with trio.fail_after(120):
            async with trio.open_nursery() as inner:
                for trainer in trainers:
                    inner.start_soon(lambda trainer=trainer: trainer.run(max_epochs=12))
        nursery.cancel_scope.cancel()
    assert all(trainer.status.bits_per_byte < first - 1.0 for trainer in trainers), first
    assert any((trainer.optimizer.last_averaging or {}).get("group", 0) == 2 for trainer in trainers)


def test_join_refuses_a_model_size_for_an_unsized_task_in_one_line(tmp_path):
    import subprocess
    import sys

    command = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--task", "digits"]
    result = subprocess.run(
        [sys.executable, "-m", "peerd.cli", *command, "--model-size", "small"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith("--model-size applies to textlm, not to 'digits'")
    assert "Traceback" not in result.stderr


def test_swarm_trains_textlm_to_a_bits_per_byte_target(tmp_path):
    import json
    import subprocess
    import sys

    command = ["swarm", "--task", "textlm", "--model-size", "tiny", "--peers", "2", "--target-bpb", "5.0"]
    result = subprocess.run(
        [sys.executable, "-m", "peerd.cli", *command, "--timeout", "120", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-2000:]
    assert summary["reached"] is True and summary["bits_per_byte"] <= 5.0 and summary["target_bpb"] == 5.0
    assert summary["target_accuracy"] is None  # a text goal replaces the accuracy goal
    assert "bits/byte" in result.stdout  # the table shows the figure the goal is about
