"""The expert server: serves forward and backward of its experts over RPC, in batches.

Each request is validated (expert, dtype, shape, batch size) on the event loop and queued in its
expert's ``BatchQueue``; one runner task per expert takes batches and computes them on the server's
one compute thread (``ComputeThread``: batches of one sample or many, every optimizer step and
checkpoint; the loop's checks of requests start no parallel work, so the server's tensor work
holds one OpenMP team) behind one shared ``trio.CapacityLimiter`` (one batch at a time per server,
as Hivemind's runtime does: torch already spreads one batch over every core, and one-at-a-time
means a backward's optimizer step never races another batch of the same expert). Requests that
arrive while a batch is computing form the next batch, so concurrent callers are batched without
any waiting timer.

A forward that asks for gradients, computed alone, has its autograd graph kept for its backward
within per-caller and total budgets and for a limited time (``saved_graphs.py``).

``open_expert_server`` owns everything it starts (runners, the DHT heartbeat, periodic checkpoints,
the expiry of kept graphs) in one nursery: leaving the block stops them all and writes a final
checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from peer import BadRequest, Busy, Message, PeerAddress, PeerHost, PeerID, Request, Router
from peer.tensors import all_finite
from peer.worker_threads import ComputeThread

from .announce import HEARTBEAT_PERIOD, HEARTBEAT_TTL, run_heartbeat
from .batching import BatchQueue, Job
from .experts import ExpertBackend, RefusedGradient, SavedGraph
from .protocol import pack_tensors, unpack_tensors
from .saved_graphs import SavedGraphs

__all__ = ["ExpertServer", "open_expert_server", "DEFAULT_MAX_BATCH_SIZE", "ExpertFailed"]

log = logging.getLogger("peerd.moe")

# Hivemind's default: large enough that batching pays off, small enough that one batch of 1024-wide
# FFN activations stays well under a GiB.
DEFAULT_MAX_BATCH_SIZE = 4096
# Queued requests hold their tensors until computed (up to max_batch_size samples each, ~16 MiB at
# width 1024). A caller keeps a few batches in flight to hide latency; the server a few callers'.
PENDING_BATCHES_PER_PEER = 4
PENDING_BATCHES = 16
# A sequence dimension (``None`` in a sample shape) is bounded by this when sizing the receive limit.
MAX_SEQUENCE_LENGTH = 8192
# Periodic checkpoints: a crash loses at most this much training of the hosted experts.
CHECKPOINT_PERIOD = 300.0
# Writing the final checkpoint at shutdown: large experts on a slow disk take seconds, not minutes.
FINAL_CHECKPOINT_TIMEOUT = 60.0


class ExpertFailed(Exception):
    """The expert's own computation raised (reaches the caller as a RemoteError named ExpertFailed)."""


@dataclass(eq=False)
class Work:
    """One request's part of a batch: its tensors, the caller's token for a kept graph, and the
    event its handler waits on for the result."""

    tensors: list[torch.Tensor]
    token: Any
    keep_graph: bool
    done: trio.Event
    caller: PeerID | None = None  # whose request: backward clips gradients per calling peer


class ExpertServer:
    """Request validation, batch queues and compute for a set of experts. Use ``open_expert_server``."""

    def __init__(self, experts: Mapping[str, ExpertBackend], *, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE):
        if not experts:
            raise ValueError("an expert server needs at least one expert")
        self.experts = dict(experts)
        self.max_batch_size = max_batch_size
        self.queues = {uid: BatchQueue(max_batch_size) for uid in self.experts}
        self.compute_limiter = trio.CapacityLimiter(1)
        # every tensor computation of the server runs on this one thread, one sample or many: the
        # loop moves bytes and checks requests in numpy (ComputeThread: what a second team costs)
        self.compute = ComputeThread("peerd-experts")
        self.stats = {"requests": 0, "batches": 0, "samples": 0}
        self._wakeups = {uid: trio.Event() for uid in self.experts}
        # Samples waiting in the queues, per caller: each holds its request's tensors until computed.
        self._pending: dict[PeerID, int] = {}
        self._pending_total = 0
        self.max_pending_per_peer = PENDING_BATCHES_PER_PEER * max_batch_size
        self.max_pending = PENDING_BATCHES * max_batch_size
        self.graphs = SavedGraphs()  # forwards' graphs awaiting their backwards, by (expert, token)
        self._graph_kept = trio.Event()  # wakes the expiry of graphs (``expire_graphs``)

    def register(self, router: Router) -> None:
        router.add_unary("moe.forward", self._handle_forward)
        router.add_unary("moe.backward", self._handle_backward)
        router.add_unary("moe.info", self._handle_info)

    # ------------------------------------------------------------------ requests
    def _expert(self, body: Any) -> tuple[str, ExpertBackend]:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a map")
        uid = body.get("uid")
        backend = self.experts.get(uid) if isinstance(uid, str) else None
        if backend is None:
            hosted = sorted(self.experts)
            listing = ", ".join(hosted[:8]) + (", ..." if len(hosted) > 8 else "")
            raise BadRequest(f"unknown expert {str(uid)[:100]!r}; this server hosts {listing}")
        return uid, backend

    def _tensors(self, body: dict, payload: Any, backend: ExpertBackend, count: int) -> list[torch.Tensor]:
        per_sample = math.prod(MAX_SEQUENCE_LENGTH if d is None else d for d in backend.sample_shape)
        headers = body.get("tensors")
        batch = _claimed_batch_size(headers)
        if batch is not None and batch > self.max_batch_size:
            raise BadRequest(f"batch of {batch} samples exceeds max_batch_size {self.max_batch_size}")
        try:
            tensors = unpack_tensors(headers, payload, max_numel=self.max_batch_size * per_sample)
            if len(tensors) != count:
                raise ValueError(f"expected {count} tensor(s), got {len(tensors)}")
            for name, tensor in zip(("inputs", "grad_outputs"), tensors, strict=False):
                backend.check_input(tensor, name)
            if count == 2 and tensors[0].shape != tensors[1].shape:
                raise ValueError(f"grad_outputs shape {list(tensors[1].shape)} != inputs {list(tensors[0].shape)}")
        except ValueError as error:
            raise BadRequest(str(error)) from None
        return tensors

    @staticmethod
    def _token(request: Request) -> Any:
        token = request.body.get("token")
        if token is None:
            return None
        if type(token) is not int:
            raise BadRequest("token must be an integer")
        return (request.peer, token)  # scoped to the caller: nobody can consume another peer's graph

    async def _handle_forward(self, request: Request) -> Message:
        uid, backend = self._expert(request.body)
        tensors = self._tensors(request.body, request.payload, backend, 1)
        token = self._token(request)
        keep_graph = request.body.get("grad") is True and token is not None
        return await self._submit(request.peer, uid, "forward", Work(tensors, token, keep_graph, trio.Event()))

    async def _handle_backward(self, request: Request) -> Message:
        uid, backend = self._expert(request.body)
        tensors = self._tensors(request.body, request.payload, backend, 2)
        work = Work(tensors, self._token(request), False, trio.Event())
        return await self._submit(request.peer, uid, "backward", work)

    async def _handle_info(self, request: Request) -> dict:
        uid, backend = self._expert(request.body)
        return {
            "uid": uid,
            "sample_shape": list(backend.sample_shape),
            "dtype": str(backend.dtype).removeprefix("torch."),
            "max_batch_size": self.max_batch_size,
        }

    async def _submit(self, caller: PeerID, uid: str, kind: str, work: Work) -> Message:
        work.caller = caller
        job = Job(kind, work.tensors[0].shape[0], work)
        mine = self._pending.get(caller, 0)
        if mine + job.size > self.max_pending_per_peer or self._pending_total + job.size > self.max_pending:
            raise Busy(f"{mine} of your samples are already waiting on this server; retry when they are done")
        self._pending[caller] = mine + job.size
        self._pending_total += job.size
        queue = self.queues[uid]
        queue.add(job)
        self._wakeups[uid].set()
        try:
            await work.done.wait()
        finally:
            if not job.started:
                queue.remove(job)  # the caller gave up before we got to it
            self._pending[caller] -= job.size
            self._pending_total -= job.size
            if not self._pending[caller]:
                del self._pending[caller]
        self.stats["requests"] += 1
        if isinstance(job.error, RefusedGradient):
            raise BadRequest(f"expert {uid}: {job.error}")
        if job.error is not None:
            raise ExpertFailed(f"expert {uid} failed: {job.error!r}")
        headers, payload = pack_tensors([job.result])
        return Message({"tensors": headers}, payload)

    # ------------------------------------------------------------------ compute
    async def run_expert(self, uid: str) -> None:
        """Take and compute batches of one expert until cancelled."""
        queue, backend = self.queues[uid], self.experts[uid]
        while True:
            if not len(queue):
                self._wakeups[uid] = trio.Event()
                await self._wakeups[uid].wait()
                continue
            # Take the batch only once the compute slot is ours: requests that arrive while another
            # batch computes join this one.
            async with self.compute_limiter:
                # (closing: the batch stays queued; from here to the hand-over nothing yields)
                await trio.lowlevel.checkpoint_if_cancelled()
                batch = queue.next_batch()
                if not batch:
                    continue  # their callers gave up while we waited
                # A lone backward may reuse its forward's graph; any backward steps the optimizer,
                # which makes every kept graph of this expert stale.
                lone = batch[0].data.token if len(batch) == 1 else None
                saved = self.graphs.pop((uid, lone)) if lone is not None and batch[0].kind == "backward" else None
                if batch[0].kind == "backward":
                    self.graphs.drop_expert(uid)
                try:
                    results, graph = await self.compute.run(compute_batch, backend, batch, saved)
                except Exception as error:
                    log.warning("expert %s failed on a %s batch: %r", uid, batch[0].kind, error)
                    for job in batch:
                        job.error = error
                else:
                    for job, result in zip(batch, results, strict=True):
                        if isinstance(result, Exception):
                            job.error = result
                        else:
                            job.result = result
                    if graph is not None and self.graphs.keep(
                        (uid, lone), batch[0].data.caller, uid, graph, graph.nbytes, trio.current_time()
                    ):
                        self._graph_kept.set()
                    self.stats["batches"] += 1
                    self.stats["samples"] += sum(job.size for job in batch)
                for job in batch:
                    job.data.done.set()
                # The callers' replies go out while the step runs: they need only their input
                # gradients. The next batch waits for it, since it computes with the parameters.
                if backend.step_pending:
                    await _step(uid, backend, self.compute)

    async def expire_graphs(self) -> None:
        """Drop kept graphs whose lifetime is over, as it ends, until cancelled."""
        while True:
            deadline = self.graphs.next_expiry()
            if deadline is None:
                self._graph_kept = trio.Event()
                await self._graph_kept.wait()
                continue
            await trio.sleep_until(deadline)
            self.graphs.expire(trio.current_time())

    # ------------------------------------------------------------------ checkpoints
    async def save_checkpoint(self, directory: Path) -> None:
        """One file per expert (``UID.pt``), written between batches, never during one."""
        directory = Path(directory)
        for uid, backend in self.experts.items():
            async with self.compute_limiter:
                await self.compute.run(backend.save, directory / f"{uid}.pt")

    async def load_checkpoint(self, directory: Path) -> list[str]:
        """Load every expert that has a checkpoint file; returns their IDs."""
        loaded = []
        for uid, backend in self.experts.items():
            path = Path(directory) / f"{uid}.pt"
            if path.exists():
                async with self.compute_limiter:
                    await self.compute.run(backend.load, path)
                self.graphs.drop_expert(uid)  # graphs of the parameters it had
                loaded.append(uid)
        return loaded


def _claimed_batch_size(headers: Any) -> int | None:
    """The batch size the first header claims, read before sizes are validated so that an oversized
    batch is reported as such rather than as a generic size limit."""
    try:
        first = headers[0]["shape"][0]
    except (TypeError, KeyError, IndexError):
        return None
    return first if type(first) is int else None


def compute_batch(
    backend: ExpertBackend, batch: list[Job], saved: SavedGraph | None = None
) -> tuple[list[torch.Tensor | Exception], SavedGraph | None]:
    """Concatenate the batch, run it, split the result (views, no copies) back per job; a job whose
    own part came out non-finite gets an error instead, and the other jobs their results. A
    backward batch is concatenated in calling-peer order (``_backward_per_peer``), may use the
    ``saved`` graph of a lone job's forward and leaves its optimizer step to ``backend.step``; a
    lone forward that asks for gradients returns its graph beside the results."""
    if batch[0].kind == "backward":
        return _backward_per_peer(backend, batch, saved), None
    inputs, graph = _cat([job.data.tensors[0] for job in batch]), None
    if len(batch) == 1 and batch[0].data.keep_graph:
        out, graph = backend.forward_keeping_graph(inputs)
    else:
        out = backend.forward(inputs)
    return [
        part if all_finite(part) else RefusedGradient("the outputs for these inputs are not finite")
        for part in out.split([job.size for job in batch])
    ], graph


async def _step(uid: str, backend: ExpertBackend, compute: ComputeThread) -> None:
    """The optimizer step a backward batch left, run to its end even when the server is closing
    (its gradient was taken; a checkpoint written after it must hold the step)."""
    with trio.CancelScope(shield=True):
        try:
            await compute.run(backend.step)
        except Exception as error:
            log.warning("expert %s failed its optimizer step: %r", uid, error)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _backward_per_peer(
    backend: ExpertBackend, batch: list[Job], saved: SavedGraph | None
) -> list[torch.Tensor | Exception]:
    """One backward pass per calling peer, not per request: gradients are clipped per peer (the
    trust boundary), and a peer that splits its rows into many small requests costs one pass, not
    one per request (k requests would otherwise cost k passes over the whole batch)."""
    by_peer: dict[Any, list[int]] = {}
    for index, job in enumerate(batch):
        by_peer.setdefault(job.data.caller, []).append(index)
    order = [index for indices in by_peer.values() for index in indices]
    inputs = _cat([batch[i].data.tensors[0] for i in order])
    grads = _cat([batch[i].data.tensors[1] for i in order])
    sizes = [sum(batch[i].size for i in indices) for indices in by_peer.values()]
    per_peer = backend.input_gradients_per_caller(inputs, grads, sizes, saved)
    results: list[torch.Tensor | Exception | None] = [None] * len(batch)
    for indices, outcome in zip(by_peer.values(), per_peer, strict=True):
        parts = (
            [outcome] * len(indices)
            if isinstance(outcome, Exception)
            else outcome.split([batch[i].size for i in indices])
        )
        for index, part in zip(indices, parts, strict=True):
            results[index] = part
    return [result for result in results if result is not None]  # every index was filled above


@asynccontextmanager
async def open_expert_server(
    host: PeerHost,
    experts: Mapping[str, ExpertBackend],
    *,
    dht: Any = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    checkpoint_dir: Path | str | None = None,
    checkpoint_period: float = CHECKPOINT_PERIOD,
    heartbeat_period: float = HEARTBEAT_PERIOD,
    heartbeat_ttl: float = HEARTBEAT_TTL,
    announce_address: PeerAddress | None = None,
) -> AsyncIterator[ExpertServer]:
    """Serve ``experts`` on ``host`` for the duration of the block.

    With ``checkpoint_dir``, experts start from their checkpoints there (if any) and are saved every
    ``checkpoint_period`` seconds and on exit. With ``dht`` (a ``DHTNode``), the experts are
    announced before the block starts and re-announced every ``heartbeat_period`` seconds, under
    ``announce_address`` (default: the host's listen address; set it when that is a wildcard).
    """
    address = announce_address or host.listen_address
    if dht is not None:
        if address is None:
            raise ValueError("announced experts need a listening host")
        if address.peer_id not in (None, dht.host.peer_id):
            # Readers take an announcement's address only from the peer it names (moe/announce.py).
            raise ValueError("announce experts through the DHT node of the peer that serves them")
    server = ExpertServer(experts, max_batch_size=max_batch_size)
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if directory is not None:
        loaded = await server.load_checkpoint(directory)
        if loaded:
            log.info("loaded %d expert checkpoints from %s", len(loaded), directory)
    server.register(host.router)
    try:
        async with trio.open_nursery() as nursery:
            for uid in server.experts:
                nursery.start_soon(server.run_expert, uid)
            nursery.start_soon(server.expire_graphs)
            if directory is not None:
                nursery.start_soon(_checkpoint_loop, server, directory, checkpoint_period)
            if dht is not None and address is not None:
                await nursery.start(
                    lambda task_status: run_heartbeat(
                        dht,
                        sorted(server.experts),
                        lambda: host.public_address if host.presence.announced else address,
                        period=heartbeat_period,
                        ttl=heartbeat_ttl,
                        task_status=task_status,
                    )
                )
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if directory is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(FINAL_CHECKPOINT_TIMEOUT):
                await server.save_checkpoint(directory)


async def _checkpoint_loop(server: ExpertServer, directory: Path, period: float) -> None:
    while True:
        await trio.sleep(period)
        try:
            await server.save_checkpoint(directory)
        except OSError as error:  # a full disk must not take the experts offline
            log.warning("checkpoint to %s failed: %r", directory, error)
