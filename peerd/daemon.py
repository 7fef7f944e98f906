"""The peerd daemon: composes the layers into one trio program.

    host (listener + connection pool)  ->  DHT node  ->  trainer (optional)  ->  status server

Nothing here knows about argparse; ``peerd/cli.py`` turns flags and ``PEERD_*`` variables into a
``DaemonConfig``. Everything the daemon starts lives in its nursery, so cancelling ``run_daemon``
(SIGINT/SIGTERM in the CLI) stops it all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import socket
import time
from typing import Any

import trio

from dht import DHTConfig, DHTNode
from moe.hosting import host_experts
from peer import PeerAddress, PeerHost, Request, Router, open_peer_host
from peer.nat import NatTraversal, relay_limits
from peer.worker_threads import run_blocking

from .daemon_config import DaemonConfig
from .metrics import PeerMetrics
from .ports import naming_port
from .status_pages import StatusPages
from .status_server import serve_http

__all__ = ["DaemonConfig", "Daemon", "run_daemon", "add_builtin_methods"]

log = logging.getLogger("peerd")


def add_builtin_methods(router: Router, host_getter) -> None:
    """Methods every peer serves: ``peer.ping`` answers who we are (a cheap liveness probe)."""

    @router.unary("peer.ping")
    async def ping(request: Request) -> dict:
        host: PeerHost = host_getter()
        return {"peer_id": str(host.peer_id), "time": time.time()}


class Daemon:
    """One running peer; ``status()`` and ``metrics()`` describe it for humans and Prometheus, and
    ``pages`` serves them with the dashboard on the status port."""

    def __init__(self, config: DaemonConfig):
        self.config = config
        self.host: PeerHost | None = None
        self.dht = None
        self.trainer = None
        self.nat: NatTraversal | None = None
        self.status_port: int | None = None
        self.data_shard: str | None = None  # "I/N" once chosen
        self.started = time.time()
        self.pages = StatusPages(self.status, lambda: self.trainer.optimizer.swarm if self.trainer else None)

    def status(self) -> dict[str, Any]:
        host = self.host
        status: dict[str, Any] = {
            "peer_id": str(self.config.identity.peer_id),
            "address": str(host.listen_address) if host and host.listen_address else None,
            "run_id": self.config.network.run_id,
            "uptime_s": round(time.time() - self.started, 1),
            "connected_peers": len(host.connected_peers) if host else 0,
            "bytes_sent": host.traffic.bytes_sent if host else 0,
            "bytes_received": host.traffic.bytes_received if host else 0,
            "task": self.config.training.task,
            "data_shard": self.data_shard,
            "epoch": None,
            "samples_per_s": None,
            "loss": None,
            "accuracy": None,
            "bits_per_byte": None,
            "evaluated_samples": None,
            "peers_known": len(host.connected_peers) + 1 if host else 1,
            "last_averaging": None,
            "reachability": self.nat.status() if self.nat is not None else None,
        }
        if self.trainer is not None:
            training = self.trainer.status
            status.update(
                epoch=training.epoch,
                samples=training.samples,
                samples_per_s=round(training.samples_per_s, 2),
                loss=None if math.isnan(training.loss) else round(training.loss, 5),
                accuracy=training.accuracy,
                bits_per_byte=training.bits_per_byte,
                evaluated_samples=training.evaluated_samples,
                peers_known=training.peers_known,
                last_averaging=training.last_averaging,
            )
            if training.ranks is not None:
                status["ranks"] = training.ranks
        return status

    def metrics(self) -> str:
        return self.pages.metrics.render()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        network, status = self.config.network, self.config.status
        router = Router()
        add_builtin_methods(router, lambda: self.host)
        listen = None if network.client_mode else network.listen
        async with contextlib.AsyncExitStack() as stack:
            with naming_port("listen", *network.listen, "--listen HOST:PORT"):
                host = await stack.enter_async_context(
                    open_peer_host(
                        self.config.identity,
                        listen=listen,
                        router=router,
                        run_id=network.run_id,
                        client_mode=network.client_mode,
                        node_id_difficulty=network.node_id_difficulty,
                        node_id=network.node_id,
                        access=network.access,
                    )
                )
            self.host = host
            limits = relay_limits(network.relay_mib_per_s)
            self.nat = NatTraversal(host, relay=network.relay, limits=limits, initial_peers=network.initial_peers)
            async with trio.open_nursery() as nursery:
                host.on_connection.append(functools.partial(_log_connection, nursery, self.pages.metrics))
                if status.port is not None:
                    with naming_port("status", status.host, status.port, "--status-port"):
                        port = await nursery.start(
                            functools.partial(serve_http, host=status.host), status.port, self.pages.routes()
                        )
                    log.info("status on http://%s:%d/status", status.host, port)
                    self.status_port = port
                    nursery.start_soon(self.pages.keep_history)
                task_status.started(self)
                dht_config = DHTConfig(bootstrap_timeout=network.bootstrap_timeout)
                async with DHTNode.open(host=host, initial_peers=network.initial_peers, config=dht_config) as dht:
                    self.dht = dht
                    nursery.start_soon(self.nat.run)
                    if self.config.experts is not None:
                        nursery.start_soon(self._serve_experts, dht)
                    if self.config.training.task is not None:
                        await self._train(dht)
                    await trio.sleep(math.inf)

    async def _serve_experts(self, dht) -> None:
        hosting, experts = self.config.experts
        if hosting.device is None:
            hosting.device = self.config.device
        address = self.host.listen_address
        if address is not None and address.host in ("0.0.0.0", "::"):
            address = PeerAddress(_reachable_host(), address.port, address.peer_id)
        await host_experts(self.host, dht, hosting, experts=experts, announce_address=address)

    def _swarm_prefix(self, task_name: str) -> str:
        """The DHT keys' prefix of the swarm that trains ``task_name`` in this run: peers that
        average in fragments (``--fragments``) are a swarm of their own, as their rounds are."""
        training = self.config.training
        fragments = training.fragments if training.mode == "local-updates" else 1
        return f"{self.config.network.run_id}.{task_name}" + (f".{fragments}fragments" if fragments > 1 else "")

    def _held_out(self, task):
        """The held-out gradient this peer scores contributions against (``--score-contributions``),
        or None; a task without held-out batches scores none, and says so."""
        from .held_out import held_out_gradient  # torch loads only in peers that train

        if not self.config.averaging.score_contributions:
            return None
        gradient = held_out_gradient(task)
        if gradient is None:
            log.warning("task %s has no held-out batches: contributions are not scored", task.name)
        else:
            log.info("scoring contributions against task %s's held-out batches", task.name)
        return gradient

    async def _load_task(self, dht, device: str):
        """This peer's data shard (chosen with the swarm for ``auto``) and its task, loaded on it.
        A machine of several ranks is one peer on that shard: each rank loads its own part of it
        (``machine.rank_shard``), which rank 0 tells the others here."""
        from averaging.progress import ProgressTracker  # torch loads only in peers that train

        from .data_shards import claim_shard, hold_claim, publish_claim
        from .tasks import ShardSpec, known_task_name, load_task, task_name

        training, ranks = self.config.training, self.config.ranks
        shard = training.data_shard or ShardSpec()
        claim = None
        if shard == "auto":
            name = await trio.to_thread.run_sync(task_name, training.task, training.model_size)
            claim = ProgressTracker(dht, self._swarm_prefix(name))
            shard = ShardSpec(*await claim_shard(claim))
        elif (name := known_task_name(training.task, training.model_size)) is not None:
            # a given shard is claimed too, while the data loads (a factory's name would need it built)
            claim = ProgressTracker(dht, self._swarm_prefix(name))
            await publish_claim(claim, (shard.index, shard.count))
        if claim is not None:  # (the status names the shard once it is claimed: peerd swarm waits so)
            self.data_shard = f"{shard.index}/{shard.count}"
        async with trio.open_nursery() as loading:
            if claim is not None:  # newcomers must count our shard while the data loads
                loading.start_soon(hold_claim, claim, (shard.index, shard.count))
            mine = shard
            if ranks is not None:
                from .machine import rank_shard, share_shard  # torch loads only in peers that train

                await run_blocking(share_shard, ranks, shard)
                mine = rank_shard(shard, ranks)
            task = await trio.to_thread.run_sync(
                lambda: load_task(training.task, shard=mine, device=device, model_size=training.model_size)
            )
            loading.cancel_scope.cancel()
        if claim is None:  # a factory's task: claimed once built, under the name it has
            await publish_claim(ProgressTracker(dht, self._swarm_prefix(task.name)), (shard.index, shard.count))
            self.data_shard = f"{shard.index}/{shard.count}"
        return shard, task

    async def _train(self, dht) -> None:
        # torch (through averaging and the task) loads only in peers that train
        import torch

        from averaging import CollaborativeOptimizer, LocalUpdatesOptimizer
        from averaging.local_rounds import OverlappedRounds
        from averaging.match_ahead import MatchAhead
        from averaging.settings import COLLABORATIVE, LOCAL_UPDATES
        from averaging.update_schedules import DelayedUpdates, ImmediateUpdates

        training, averaging = self.config.training, self.config.averaging
        ranks = self.config.ranks
        device = ranks.task_device if ranks else self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        shard, task = await self._load_task(dht, device)
        inner = task.make_optimizer(list(task.model.parameters()))
        prefix = self._swarm_prefix(task.name)
        async with trio.open_nursery() as background:
            local_updates = training.mode == "local-updates"
            settings = (LOCAL_UPDATES if local_updates else COLLABORATIVE).replace(
                aggregation=averaging.aggregation,
                uplink=averaging.uplink_mbit * 1e6 / 8 if averaging.uplink_mbit else None,
                **({} if averaging.compression is None else {"codec": averaging.compression}),
            )
            held_out = self._held_out(task)
            if local_updates:
                # each round's averaging overlaps the next round's local steps, in `background`
                optimizer = LocalUpdatesOptimizer(
                    inner,
                    dht,
                    prefix=prefix,
                    local_steps=training.local_steps,
                    fragments=fragments_for(training.fragments, training.local_steps, task.model),
                    outer_lr=training.outer_lr,
                    rounds=OverlappedRounds(background),
                    settings=settings,
                    held_out=held_out,
                )
            else:
                optimizer = CollaborativeOptimizer(
                    inner,
                    dht,
                    prefix=prefix,
                    target_batch_size=training.target_batch_size or task.target_batch_size,
                    updates=DelayedUpdates(background) if averaging.delay_updates else ImmediateUpdates(),
                    matching=MatchAhead(background),  # the next epoch's group forms ahead of the step
                    settings=settings,
                    held_out=held_out,
                )
            optimizer.tracker.data_shard = (shard.index, shard.count)  # what auto-choosing newcomers count
            self.trainer = await self._trainer(task, optimizer, inner)
            self.trainer.round_observers.append(self.pages.observe_round)
            log.info("training task %s on %s (%s mode)", task.name, ranks.device if ranks else device, training.mode)
            await self.trainer.run()
            background.cancel_scope.cancel()

    async def _trainer(self, task, optimizer, inner):
        """A lone peer's trainer, or rank 0's of a machine of several ranks (``machine_training.py``);
        ``inner``: the torch optimizer ``optimizer`` steps the task's model with."""
        from .training import Trainer  # torch loads only in peers that train

        ranks = self.config.ranks
        if ranks is None:
            return Trainer(task, optimizer)
        from .machine_sharded import machine_compute  # torch loads only in peers that train
        from .machine_training import MachineTrainer

        compute = await run_blocking(machine_compute, ranks, task.model)
        log.info(
            "training as rank 0 of %d ranks (%s on %s, %s)", ranks.world_size, ranks.backend, ranks.device, compute.kind
        )
        return MachineTrainer(task, optimizer, ranks, compute, inner)


def fragments_for(wanted: int, local_steps: int, model) -> int:
    """``--fragments``, or, past the model's parameter tensors (a fragment holds whole ones), the
    most of them that split ``local_steps`` evenly: every peer of the swarm (``_swarm_prefix``:
    the same task, the same count asked) gets the same."""
    tensors = sum(1 for _ in model.parameters())
    if wanted <= tensors:
        return wanted
    count = max(count for count in range(1, tensors + 1) if local_steps % count == 0)
    log.warning("--fragments %d: the model has %d parameter tensors, so %d fragments", wanted, tensors, count)
    return count


def _reachable_host() -> str:
    """This machine's address as others on its network see it (a container's IP under compose)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _log_connection(nursery: trio.Nursery, metrics: PeerMetrics, connection, incoming: bool) -> None:
    if incoming:
        log.info("peer %s connected", connection.remote_peer_id)
    else:
        log.info("met peer %s at %s", connection.remote_peer_id, connection.remote_listen_address)
    nursery.start_soon(_log_when_dropped, connection, metrics)


async def _log_when_dropped(connection, metrics: PeerMetrics) -> None:
    """Say when a peer goes away (it left, died or the link broke); not when we closed it ourselves
    (shutting down, or a newer connection from the same peer replaced it), nor when either side
    retired it for being idle."""
    await connection.closed.wait()
    if connection.close_reason != "connection closed locally" and not connection.retired:
        log.info("peer %s dropped: %s", connection.remote_peer_id, connection.close_reason)
        metrics.connection_dropped()


async def run_daemon(config: DaemonConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a peer until cancelled. ``task_status.started`` gets the ``Daemon`` once it listens."""
    await Daemon(config).run(task_status=task_status)
