"""A newcomer joining a training swarm in one process: what ``benchmarks/join.py`` measures and
``tests/averaging/test_delayed_updates.py`` bounds. ``veterans`` peers (real ``DHTNode`` and
``CollaborativeOptimizer`` on the ``digits`` task, the test suite's short deadlines) train; once
they reach epoch ``joined_at`` one more peer starts, loads a donor's state and trains on, every
peer to epoch ``joined_at + epochs``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from tests.daemon.test_training import make_trainer, open_swarm

__all__ = ["NewcomerRun", "run_newcomer"]


@dataclass
class NewcomerRun:
    """What the newcomer did: after each of its steps, its epoch, its last round's record and
    whether the step ended an epoch; and how often it loaded state (or tried to)."""

    rounds: list[tuple[int, dict, bool]] = field(default_factory=list)
    loads: int = 0


async def run_newcomer(
    schedule: Callable[[trio.Nursery], dict[str, Any]], *, veterans: int, joined_at: int, epochs: int, timeout: float
) -> NewcomerRun:
    """One swarm, one newcomer; ``schedule(background)``: each trainer's optimizer options (its
    update schedule and matchmaking), with their tasks in ``background``."""
    run = NewcomerRun()
    async with trio.open_nursery() as nursery:
        nodes = await open_swarm(nursery, veterans + 1)
        async with trio.open_nursery() as background:
            trainers = [make_trainer(node, i, veterans + 1, **schedule(background)) for i, node in enumerate(nodes)]
            newcomer = trainers[-1]
            step, load = newcomer.optimizer.step, newcomer.optimizer.load_state_from_peers

            async def recorded_step(batch_size: int) -> bool:
                stepped = await step(batch_size)
                run.rounds.append((newcomer.optimizer.epoch, dict(newcomer.optimizer.last_averaging or {}), stepped))
                return stepped

            async def counted_load(*args, **kwargs) -> None:
                run.loads += 1
                await load(*args, **kwargs)

            newcomer.optimizer.step = recorded_step
            newcomer.optimizer.load_state_from_peers = counted_load

            async def train(trainer, start_at: int) -> None:
                while trainers[0].optimizer.epoch < start_at:
                    await trio.sleep(0.05)
                await trainer.run(max_epochs=joined_at + epochs)

            with trio.fail_after(timeout):
                async with trio.open_nursery() as swarm:
                    for trainer in trainers[:-1]:
                        swarm.start_soon(train, trainer, 0)
                    swarm.start_soon(train, newcomer, joined_at)
            background.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    return run
