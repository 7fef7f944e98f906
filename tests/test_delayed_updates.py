"""Delayed parameter updates in collaborative mode: an epoch's gradients are averaged in the
background while the next epoch accumulates, and the swarm still converges together."""

from __future__ import annotations

import trio

from tests.test_training import make_trainer, open_swarm


async def test_three_peers_with_delayed_updates_reach_the_target_and_accumulate_while_averaging():
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, 3)
        async with trio.open_nursery() as background:
            trainers = [make_trainer(node, i, 3, delay_updates=background) for i, node in enumerate(nodes)]
            overlapped = [0, 0, 0]  # batches accumulated while this peer's round ran in the background
            statuses = {}

            async def train(i):
                trainer = trainers[i]
                original = trainer.optimizer.step

                async def counting_step(batch_size):
                    optimizer = trainer.optimizer
                    if optimizer.averaging_in_background:
                        overlapped[i] += 1
                    stepped = await original(batch_size)
                    if stepped:  # launched: the epoch counts, its step has not landed, and donors
                        # must not label the parameters before it with the new epoch
                        assert optimizer.replica.state.state_metadata()["epoch"] == optimizer.epoch - 1
                    return stepped

                trainer.optimizer.step = counting_step
                statuses[i] = await trainer.run(max_epochs=60, target_accuracy=0.9)

            with trio.fail_after(120):
                async with trio.open_nursery() as inner:
                    for i in range(3):
                        inner.start_soon(train, i)
            background.cancel_scope.cancel()
        assert max(s.accuracy for s in statuses.values()) >= 0.9
        assert all(count > 0 for count in overlapped), overlapped
        averaged = [t.optimizer.last_averaging for t in trainers]
        assert any(record and record["averaged"] and record["group"] >= 2 for record in averaged), averaged
        epochs = [t.optimizer.epoch for t in trainers]
        assert max(epochs) - min(epochs) <= 1, epochs
        nursery.cancel_scope.cancel()


def test_join_refuses_an_unknown_compression_in_one_line(tmp_path):
    import subprocess
    import sys

    command = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--task", "digits"]
    result = subprocess.run(
        [sys.executable, "-m", "peer.daemon.cli", *command, "--compression", "zip", "--delay-updates"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "unknown codec 'zip'" in result.stderr and "blockwise_8bit" in result.stderr
    assert "Traceback" not in result.stderr


def test_delay_updates_outside_collaborative_training_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    for extra in (["--task", "digits", "--mode", "local-updates"], []):
        command = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "k"), "--delay-updates", *extra]
        result = subprocess.run(
            [sys.executable, "-m", "peer.daemon.cli", *command], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1, result.stderr
        assert "--delay-updates applies to training (--task) in collaborative mode only" in result.stderr
