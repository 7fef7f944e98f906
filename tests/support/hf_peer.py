"""A ``transformers.Trainer`` that is a swarm peer (``peerd/hf_trainer.py``), for
tests/daemon/test_hf_integration.py: trains the ``hf-lm`` task's tiny GPT-2 on its textlm shard for
``--steps`` optimizer steps and on until ``--rounds`` rounds averaged with another peer (200 at
most). It prints its address first (its DHT node starts before transformers
loads, so the other peer can start meanwhile) and, last, one JSON line: the losses it logged, the
swarm epoch it reached and how many of its rounds averaged with another peer. Under torchrun the
job is one peer: rank 0 prints, and each rank trains on its own part of the shard."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from dht import DHT


def train(dht: DHT | None, shard: int, steps: int, rounds: int) -> dict:
    # transformers and torch load here, after the address is out
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from peerd.hf_trainer import PeerdCallback, hf_swarm_optimizer
    from peerd.tasks import ShardSpec, load_task

    class Windows(torch.utils.data.IterableDataset):
        """The task's endless byte windows, a sample at a time (the model shifts its labels)."""

        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            for inputs, _targets in self.batches:
                for row in inputs:
                    yield {"input_ids": row, "labels": row}

    class CountRounds(TrainerCallback):
        """Counts rounds averaged with another peer; stops after ``steps`` steps once ``rounds`` of
        them did (a peer that started first must not finish before the other has joined). Under
        torchrun rank 0 decides for every rank (the same step on each)."""

        def __init__(self, optimizer):
            self.optimizer, self.averaged, self.last = optimizer, 0, None

        def on_step_end(self, args, state, control, **kwargs):
            record = self.optimizer.swarm.last_round if self.optimizer.swarm is not None else None
            if record is not None and record is not self.last:
                self.last = record
                self.averaged += int(record.averaged and record.group >= 2)
            done = torch.tensor([int(state.global_step >= steps and self.averaged >= rounds)])
            if torch.distributed.is_initialized():
                torch.distributed.broadcast(done, 0)
            if done.item():
                control.should_training_stop = True

    rank, ranks = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    task = load_task("hf-lm", shard=ShardSpec(shard + 2 * rank, 2 * ranks), model_size="tiny")
    with tempfile.TemporaryDirectory() as output:
        args = TrainingArguments(
            output_dir=output, max_steps=200, per_device_train_batch_size=8, learning_rate=3e-3,
            lr_scheduler_type="constant", logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0, warmup_steps=0,
        )  # fmt: skip
        optimizer = hf_swarm_optimizer(task.model, args, run_id="hf-test", target_batch_size=64, dht=dht)
        counter = CountRounds(optimizer)
        callbacks = [counter, PeerdCallback(optimizer)]
        trainer = Trainer(
            model=task.model, args=args, train_dataset=Windows(task.batches), optimizers=(optimizer, None),
            callbacks=callbacks,
        )  # fmt: skip
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    checksum = sum(float(param.double().sum()) for param in task.model.parameters())
    result = {"losses": losses, "epoch": optimizer.epoch, "averaged": counter.averaged}
    return {**result, "rank": rank, "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    dht = None
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone is the swarm's peer
        dht = DHT([options.initial_peer] if options.initial_peer else [], start=True, run_id="hf-test")
        print(json.dumps({"address": str(dht.address)}), flush=True)
    result = train(dht, options.shard, options.steps, options.rounds)
    print(json.dumps(result), flush=True)
    if dht is not None:
        dht.shutdown()


if __name__ == "__main__":
    main()
