"""Helpers for tests and benchmarks that run many DHT nodes in one process.

``lazy_send_buffers()`` works around a cost of the current wire layer: every ``peer.rpc.Connection``
allocates (and zeroes) a 4 MiB send buffer up front, i.e. ~2 ms and 4 MiB of RSS per connection.
A 50-node swarm in one process holds ~2,500 connections (10 GB). The shim starts each buffer at
64 KiB and grows it only when one record does not fit: the same wire bytes, a fraction of the memory.
It is idempotent and process-wide; use it only in tests and benchmarks (the proper fix belongs in
``peer/rpc.py``; see the DHT report).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

import peer.rpc as _rpc

from .node import DHTConfig, DHTNode

__all__ = ["lazy_send_buffers", "open_swarm", "Swarm", "jaccard"]

_INITIAL_SEND_BUFFER = 64 * 1024
_patched = False


async def _growing_write_loop(self: Any) -> None:
    buffer = self._send_buffer
    view = memoryview(buffer)
    cipher, stream = self.channel.send_cipher, self.channel.stream
    overhead = _rpc._RECORD_OVERHEAD
    while True:
        while not self._outgoing:
            self._wakeup_writer = trio.Event()
            await self._wakeup_writer.wait()
        position = 0
        while self._outgoing:
            item = self._outgoing.popleft()
            chunks = [item.header]
            if item.payload is not None:
                payload, step = item.payload, _rpc.MAX_RECORD_PLAINTEXT
                chunks.extend(payload[i : i + step] for i in range(0, len(payload), step))
            for chunk in chunks:
                needed = len(chunk) + overhead
                if position + needed > len(buffer):
                    if position:
                        await stream.send_all(view[:position])
                        position = 0
                    if needed > len(buffer):
                        view.release()
                        buffer = self._send_buffer = bytearray(max(needed, 2 * len(buffer)))
                        view = memoryview(buffer)
                position += cipher.seal_into(chunk, view[position:])
            if item.encrypted is not None:
                item.encrypted.set()
            if position >= len(buffer) // 2:
                break
        if position:
            await stream.send_all(view[:position])


def lazy_send_buffers() -> None:
    """Make new connections start with a small, growing send buffer (see the module docstring)."""
    global _patched
    if _patched:
        return
    _rpc.SEND_BUFFER_SIZE = _INITIAL_SEND_BUFFER
    _rpc.Connection._write_loop = _growing_write_loop  # type: ignore[method-assign]
    _patched = True


class Swarm:
    """Nodes that each run in their own task, so any one can be killed without the others."""

    def __init__(self, nursery: trio.Nursery, config: DHTConfig | None, validators: Sequence[Any]):
        self.nodes: list[DHTNode] = []
        self._nursery = nursery
        self._config = config
        self._validators = validators
        self._stops: dict[int, tuple[trio.CancelScope, trio.Event]] = {}

    async def _run(self, options: dict[str, Any], task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with DHTNode.open(config=self._config, validators=self._validators, **options) as node:
                    self._stops[id(node)] = (scope, stopped)
                    task_status.started(node)
                    await trio.sleep_forever()
        finally:
            stopped.set()

    async def add(self, initial_peers: Sequence[Any] = (), **options: Any) -> DHTNode:
        """Start one more node (not added to ``nodes`` if it is a client)."""
        node = await self._nursery.start(self._run, {"initial_peers": list(initial_peers), **options})
        if not node.client_mode:
            self.nodes.append(node)
        return node

    async def kill(self, node: DHTNode) -> None:
        """Stop ``node`` now: its listener closes and its connections drop."""
        scope, stopped = self._stops.pop(id(node))
        scope.cancel()
        await stopped.wait()
        if node in self.nodes:
            self.nodes.remove(node)


@asynccontextmanager
async def open_swarm(
    count: int,
    *,
    config: DHTConfig | None = None,
    seed: int | None = None,
    validators: Sequence[Any] = (),
) -> AsyncIterator[Swarm]:
    """``count`` nodes on 127.0.0.1, each bootstrapped from a random earlier one."""
    lazy_send_buffers()
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, config, validators)
        await swarm.add()
        for _ in range(count - 1):
            await swarm.add([swarm.nodes[rng.randrange(len(swarm.nodes))].address])
        try:
            yield swarm
        finally:
            nursery.cancel_scope.cancel()


def jaccard(a: Sequence[Any], b: Sequence[Any]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0
