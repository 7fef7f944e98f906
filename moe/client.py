"""The calling side of expert RPCs: one host (and optional DHT node) on a trio loop, reachable from
the synchronous threads where PyTorch runs forward and backward.

``MoEClient`` is the bridge: ``client.run(async_fn, *args)`` blocks the calling thread until the
function finishes on the client's loop. In a plain script the loop is a background thread
(``MoEClient.start``); in trio code the client uses the current loop (``MoEClient.current``) and
the model runs in a worker thread (``trio.to_thread.run_sync``) so the loop stays free to serve
the calls.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import torch
import trio

from dht.node import DHTNode
from peer import LOCAL_DIFFICULTY, CallTimeoutError, Identity, PeerAddress, PeerHost, open_peer_host
from peer.background import ServiceHandle, get_loop

from .protocol import pack_tensors, unpack_tensors

__all__ = ["MoEClient", "ExpertCallError", "call_forward", "call_backward", "DEFAULT_TIMEOUT"]

T = TypeVar("T")

# One expert call: a 256 x 1024 batch takes ~0.1-0.5 s to compute on a CPU; 30 s only fires for a
# dead or hopelessly overloaded server.
DEFAULT_TIMEOUT = 30.0
# A reply may be at most this many times larger than the request (experts map a batch to a batch
# of the same shape; the slack covers experts that widen their output).
_MAX_REPLY_FACTOR = 16

_tokens = itertools.count(1)


class ExpertCallError(RuntimeError):
    """An expert answered with something that is not a valid result for the request."""


def next_token() -> int:
    """A process-unique call token pairing a forward with its backward (see moe.protocol)."""
    return next(_tokens)


def _check_reply(uid: str, reply: Any, batch: int, max_numel: int) -> torch.Tensor:
    body = reply.body
    try:
        if not isinstance(body, dict):
            raise ValueError("reply body is not a map")
        (tensor,) = unpack_tensors(body.get("tensors"), reply.payload, max_numel=max_numel)
    except ValueError as error:
        raise ExpertCallError(f"expert {uid} sent a malformed reply: {error}") from None
    if tensor.dim() == 0 or tensor.shape[0] != batch or not tensor.is_floating_point():
        raise ExpertCallError(f"expert {uid} returned {tensor.dtype} {list(tensor.shape)} for a batch of {batch}")
    return tensor


async def _call(host: PeerHost, address: PeerAddress, method: str, body: Any, payload: Any, timeout: float) -> Any:
    """One call with one deadline covering the dial as well as the call itself."""
    with trio.move_on_after(timeout):
        return await host.call(address, method, body, payload=payload, timeout=timeout)
    raise CallTimeoutError(f"{method} {body['uid']} at {address} did not answer within {timeout} s")


async def call_forward(
    host: PeerHost,
    address: PeerAddress,
    uid: str,
    inputs: torch.Tensor,
    *,
    keep_graph: bool = False,
    token: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    headers, payload = pack_tensors([inputs])
    body = {"uid": uid, "tensors": headers, "grad": keep_graph, "token": token}
    reply = await _call(host, address, "moe.forward", body, payload, timeout)
    return _check_reply(uid, reply, inputs.shape[0], max(inputs.numel(), 1) * _MAX_REPLY_FACTOR)


async def call_backward(
    host: PeerHost,
    address: PeerAddress,
    uid: str,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    *,
    token: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    headers, payload = pack_tensors([inputs, grad_outputs])
    body = {"uid": uid, "tensors": headers, "token": token}
    reply = await _call(host, address, "moe.backward", body, payload, timeout)
    grad = _check_reply(uid, reply, inputs.shape[0], max(inputs.numel(), 1))
    if grad.shape != inputs.shape:
        raise ExpertCallError(f"expert {uid} returned input gradients of shape {list(grad.shape)}")
    return grad


class MoEClient:
    """A host (plus optional DHT node) whose loop can be driven from a non-trio thread."""

    def __init__(
        self,
        host: PeerHost,
        *,
        dht: DHTNode | None = None,
        runner: Callable[..., Any],
        service: ServiceHandle | None = None,
    ):
        self.host = host
        self.dht = dht
        self._runner = runner
        self._service = service

    @classmethod
    def current(cls, host: PeerHost, *, dht: DHTNode | None = None) -> MoEClient:
        """A client on the calling trio loop; call its experts from worker threads only."""
        token = trio.lowlevel.current_trio_token()
        return cls(host, dht=dht, runner=functools.partial(trio.from_thread.run, trio_token=token))

    @classmethod
    def start(
        cls,
        initial_peers: Iterable[PeerAddress | str] = (),
        *,
        identity: Identity | None = None,
        run_id: str = "default",
        node_id_difficulty: int = LOCAL_DIFFICULTY,
    ) -> MoEClient:
        """A client in the process-wide background loop (``peer.background``, shared with the DHT
        and averager facades): a client-mode DHT node joined through ``initial_peers``, or just a
        host when there are none. Close it with ``close()``. ``node_id_difficulty`` must be the
        run's (``peerd join`` defaults to ``DEFAULT_DIFFICULTY``; local swarms use the low
        ``LOCAL_DIFFICULTY``, which is also this default so that scripts start at once)."""
        loop = get_loop()
        peers = list(initial_peers)
        if peers:
            service = loop.start_service(
                lambda: DHTNode.open(
                    identity=identity,
                    initial_peers=peers,
                    client_mode=True,
                    run_id=run_id,
                    node_id_difficulty=node_id_difficulty,
                )
            )
            return cls(service.value.host, dht=service.value, runner=loop.run, service=service)
        service = loop.start_service(
            lambda: open_peer_host(
                identity or Identity.generate(), listen=None, run_id=run_id, node_id_difficulty=node_id_difficulty
            )
        )
        return cls(service.value, runner=loop.run, service=service)

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` on the client's loop; blocks this (non-loop) thread until done."""
        return self._runner(async_fn, *args)

    def close(self) -> None:
        """Leave the swarm (for ``start`` clients; a no-op for ``current`` clients)."""
        if self._service is not None:
            self._service.close()
            self._service = None

    def __enter__(self) -> MoEClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
