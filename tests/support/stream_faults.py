"""Fault injection for stream RPCs: wrappers around a peer host, its connections and its streams
that let a test decide what happens to every message a peer sends (and watch what it receives).

A component under test gets a ``FaultyHost`` in place of its real host; its outgoing streams (opened
through ``connect``) and its incoming ones (handlers registered on ``host.router``) are wrapped,
and every ``send`` goes through ``Fault.send``, which may pass the message on, change it, repeat
it, drop it, stall, or end the whole peer; every ``receive`` goes through ``Fault.receive``.
Nothing inside the component is overridden.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any

import trio


class Fault:
    """Passes every message on unchanged; subclasses misbehave. ``peer_scope`` (the cancel scope
    of the victim's whole host) and ``run_scope`` (the victim's call under test) are set by the
    test that uses them."""

    peer_scope: trio.CancelScope
    run_scope: trio.CancelScope

    async def send(self, stream: FaultyStream, body: Any, payload: Any) -> None:
        await stream.inner.send(body, payload)

    async def receive(self, stream: FaultyStream) -> Any:
        """What a ``stream.receive()`` of this peer's returns (subclasses may watch or change it)."""
        return await stream.inner.receive()

    async def die(self) -> None:
        """The whole peer vanishes: host, connections, everything."""
        self.peer_scope.cancel()
        await trio.sleep(math.inf)


class FaultyStream:
    """``outgoing``: this peer opened the stream (else it serves a call another peer opened)."""

    def __init__(self, inner: Any, fault: Fault, *, outgoing: bool):
        self.inner = inner
        self.outgoing = outgoing
        self._fault = fault

    async def send(self, body: Any = None, payload: Any = None) -> None:
        await self._fault.send(self, body, payload)

    async def receive(self) -> Any:
        return await self._fault.receive(self)

    def __aiter__(self):
        return self.inner.__aiter__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultyConnection:
    def __init__(self, inner: Any, fault: Fault):
        self._inner = inner
        self._fault = fault

    @asynccontextmanager
    async def stream(self, method: str, **options: Any):
        async with self._inner.stream(method, **options) as stream:
            yield FaultyStream(stream, self._fault, outgoing=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FaultyRouter:
    def __init__(self, inner: Any, fault: Fault):
        self._inner = inner
        self._fault = fault

    def add_stream(self, name: str, handler: Any, **options: Any) -> None:
        fault = self._fault

        async def faulty_handler(stream: Any) -> Any:
            return await handler(FaultyStream(stream, fault, outgoing=False))

        self._inner.add_stream(name, faulty_handler, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FaultyHost:
    def __init__(self, inner: Any, fault: Fault):
        self._inner = inner
        self._fault = fault
        self.router = FaultyRouter(inner.router, fault)

    async def connect(self, address: Any) -> FaultyConnection:
        return FaultyConnection(await self._inner.connect(address), self._fault)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
