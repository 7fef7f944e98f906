"""A Lightning ``Trainer`` that is a swarm peer through ``PeerdStrategy``
(``peerd/lightning_strategy.py``), for tests/daemon/test_lightning_integration.py: a small MLP on
its half of the digits data for ``--steps`` steps. Initial peers come from ``PEERD_INITIAL_PEERS``
as a user's would. It trains ``--steps`` steps and on until ``--rounds`` rounds averaged with another
peer (``--max-steps`` at most). Prints its address first and, last, one JSON line: held-out accuracy before and
after, the swarm epoch it reached and how many of its rounds averaged with another peer."""

from __future__ import annotations

import argparse
import json

import pytorch_lightning as pl
import torch
from torch import nn

from peerd.lightning_strategy import PeerdStrategy
from peerd.tasks import ShardSpec, digits_task


class Batches(torch.utils.data.IterableDataset):
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


class Digits(pl.LightningModule):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        return nn.functional.cross_entropy(self.model(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class Announce(pl.Callback):
    """Prints the peer's address once the strategy has joined the swarm, counts averaged rounds, and
    stops training after ``steps`` steps once ``rounds`` rounds averaged with another peer (so a
    peer that started first does not finish before the other has joined)."""

    def __init__(self, steps: int, rounds: int):
        self.steps, self.rounds = steps, rounds
        self.averaged, self.last = 0, None

    def on_train_start(self, trainer, module):
        print(json.dumps({"address": str(trainer.strategy.address)}), flush=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
        record = trainer.strategy.swarm_optimizer.swarm.last_round
        if record is not None and record is not self.last:
            self.last = record
            self.averaged += int(record.averaged and record.group >= 2)
        if trainer.global_step >= self.steps and self.averaged >= self.rounds:
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=400)
    options = parser.parse_args()
    task = digits_task(ShardSpec(options.shard, 2), batch_size=16)
    before = task.evaluate(task.model)["accuracy"]
    announce = Announce(options.steps, options.rounds)
    strategy = PeerdStrategy(target_batch_size=64, run_id="lightning-test")
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=options.max_steps, callbacks=[announce], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Digits(task.model), torch.utils.data.DataLoader(Batches(task.batches), batch_size=None))
    after = task.evaluate(task.model)["accuracy"]
    result = {"before": before, "after": after, "epoch": strategy.swarm_optimizer.epoch, "averaged": announce.averaged}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
