"""Training on a machine of several ranks (``machine.py``): rank 0's trainer, which leads each
slice and is the swarm's peer, and the loop every other rank follows.

Rank 0 trains as a lone peer does (``training.Trainer``), except that each slice is computed by all
ranks under DDP, and the samples it gives its optimizer (and so the swarm) are the machine's. Its
optimizer's step, averaging included, runs between slices while the followers wait for the next
orders; the parameters it leaves reach them at the start of the next slice. When its training ends
(a target reached, the peer stopped) it tells the followers to stop, so they exit 0.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch
import trio

from peer.worker_threads import run_blocking

from .exit_codes import EXIT_RANK_FAILED
from .machine import (
    ParameterWrites,
    RankGroup,
    RankReport,
    SliceOrders,
    exchange_orders,
    gather_reports,
    leave_rank_group,
    rank_shard,
    share_shard,
)
from .machine_sharded import ReplicatedCompute, ShardedCompute, machine_compute
from .ranks import RankError
from .tasks import Task, load_task
from .training import Trainer, TrainingStatus

__all__ = ["MachineTrainer", "follow_rank_zero", "run_follower"]

log = logging.getLogger("peerd.training")

# Rank 0 tells the followers to stop when its training ends; a follower that does not take the
# order within this long (it died, or hangs) is left to the launcher.
RELEASE_TIMEOUT_S = 5.0


class MachineTrainer(Trainer):
    """Rank 0's trainer: leads each slice on every rank of ``group``; the swarm sees one peer
    whose samples are the whole machine's. ``compute`` holds ``task.model`` for the slices
    (``machine_compute``: under DDP, or sharded under FSDP); ``inner``: the torch optimizer that
    ``optimizer`` (the swarm's) steps ``task.model`` with."""

    def __init__(
        self,
        task: Task,
        optimizer: Any,
        group: RankGroup,
        compute: ReplicatedCompute | ShardedCompute,
        inner: torch.optim.Optimizer,
        **options: Any,
    ):
        super().__init__(task, optimizer, **options)
        self.group = group
        self.compute = compute
        self._writes = ParameterWrites(list(task.model.parameters()), inner)  # every rank started from these
        self._last = RankReport(0)
        self._samples = [0] * group.world_size
        self._shares = 0  # slices that began with rank 0's parameters (they had changed)
        self.status.ranks = self._ranks_status([RankReport(0)] * group.world_size)

    def _lead_slice(self, orders: SliceOrders, batches: list) -> tuple[float, list[RankReport]]:
        exchange_orders(self.group, orders)
        if orders.parameters_changed:
            self.compute.receive_parameters()
        mine = RankReport(sum(len(batch[0]) for batch in batches), self._last.loss, self._last.batch_s)
        reports = gather_reports(self.group, mine)
        started = self.clock()
        machine = sum(report.samples for report in reports)
        loss = self.compute.forward_backward(self.task.loss_fn, batches, machine)
        self.compute.deliver_gradients()
        self._batch_s = (self.clock() - started) / len(batches)
        self._last = RankReport(mine.samples, loss, self._batch_s)
        return loss, reports

    async def compute_slice(self) -> tuple[float, int]:
        orders = SliceOrders(self.slice_size(), parameters_changed=self._writes.take())
        batches = [next(self.task.batches) for _ in range(orders.batches)]
        loss, reports = await run_blocking(self._lead_slice, orders, batches)
        self._shares += orders.parameters_changed
        for rank, report in enumerate(reports):
            self._samples[rank] += report.samples
        self.status.ranks = self._ranks_status(reports)
        return loss, sum(report.samples for report in reports)

    def _ranks_status(self, reports: list[RankReport]) -> dict[str, Any]:
        """What ``/status`` shows under ``ranks``: the group, how many slices began with rank 0's
        parameters (about one per swarm step in collaborative mode, every slice in local updates),
        and each rank's samples so far and its last slice's loss and per-batch time (rank 0's as
        of this slice, the others' one behind)."""
        rows = []
        for rank, report in enumerate(reports):
            loss = self._last.loss if rank == 0 else report.loss
            batch_s = self._last.batch_s if rank == 0 else report.batch_s
            rows.append(
                {
                    "rank": rank,
                    "samples": self._samples[rank],
                    "loss": None if math.isnan(loss) else round(loss, 5),
                    "batch_ms": None if math.isnan(batch_s) else round(batch_s * 1000, 3),
                }
            )
        group = self.group
        return {
            "world_size": group.world_size,
            "backend": group.backend,
            "device": str(group.device),
            "model": self.compute.kind,  # ddp: whole on every rank; fsdp: sharded over them
            "parameters_shared": self._shares,
            "ranks": rows,
        }

    async def run(self, **limits: Any) -> TrainingStatus:
        """Train as ``Trainer.run`` does; then tell the followers to stop (unless the group broke)."""
        broken = False
        try:
            return await super().run(**limits)
        except RankError:
            broken = True
            if trio.current_effective_deadline() == -math.inf:
                # stopped by a signal that reached every rank (torchrun's SIGTERM, a terminal's
                # Ctrl-C): a follower that left first is part of the stop, not a failure
                await trio.lowlevel.checkpoint()
            raise
        finally:
            if not broken:
                with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
                    await trio.to_thread.run_sync(self._release, abandon_on_cancel=True)

    def _release(self) -> None:
        try:
            exchange_orders(self.group, SliceOrders(stop=True))
        except RankError as error:
            log.warning("could not tell the other ranks to stop: %s", error)
            return
        leave_rank_group()  # the machine's last collective


def follow_rank_zero(group: RankGroup, task_spec: str, model_size: str | None) -> None:
    """A follower's life: learn the machine's shard, load this rank's part of it, then compute
    each slice rank 0 orders until it says stop. Raises RankError when the group breaks."""
    shard = rank_shard(share_shard(group), group)
    task = load_task(task_spec, shard=shard, device=group.task_device, model_size=model_size)
    compute = machine_compute(group, task.model)
    last = RankReport(0)
    while True:
        orders = exchange_orders(group)
        if orders.stop:
            leave_rank_group()  # rank 0 leaves too, after this order
            return
        if orders.parameters_changed:
            compute.receive_parameters()
        batches = [next(task.batches) for _ in range(orders.batches)]
        mine = RankReport(sum(len(batch[0]) for batch in batches), last.loss, last.batch_s)
        reports = gather_reports(group, mine)
        started = time.perf_counter()
        machine = sum(report.samples for report in reports)
        loss = compute.forward_backward(task.loss_fn, batches, machine)
        compute.deliver_gradients()
        last = RankReport(mine.samples, loss, (time.perf_counter() - started) / len(batches))


def run_follower(group: RankGroup, task_spec: str, model_size: str | None) -> int:
    """Follow rank 0 in a worker thread, so that SIGINT and SIGTERM reach this (main) thread even
    while a collective blocks; returns the exit code: 0 when rank 0 said stop, EXIT_RANK_FAILED
    (after a log line) when the group broke. Other errors (a task that fails to load) propagate."""
    outcome: dict[str, Any] = {}

    def follow() -> None:
        try:
            follow_rank_zero(group, task_spec, model_size)
            outcome["code"] = 0
        except RankError as error:
            log.warning("rank %d stops: %s", group.rank, error)
            outcome["code"] = EXIT_RANK_FAILED
        except BaseException as error:  # re-raised in the main thread, which reports it
            outcome["error"] = error

    thread = threading.Thread(target=follow, name=f"peerd-rank-{group.rank}", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["code"]
