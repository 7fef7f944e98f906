"""A trio loop in a background thread, for callers that are not trio code (autograd, plain scripts).

Remote experts are called from PyTorch's forward and backward, which are synchronous. Their RPCs
run on a trio loop that owns the connections; the calling thread blocks on a portal
(``trio.from_thread.run``) until the call's own deadline. This is a stand-in for the process-wide
facade planned in ``peer/background.py``: the only thing ``moe`` needs is ``BackgroundLoop.run``
and ``BackgroundLoop.enter``.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import trio

__all__ = ["BackgroundLoop"]

T = TypeVar("T")

# Starting the loop thread takes milliseconds; 10 s only trips when the machine is wedged.
START_TIMEOUT = 10.0


class BackgroundLoop:
    """One trio loop in a daemon thread; ``close()`` cancels everything it runs and joins it."""

    def __init__(self, name: str = "peerd-moe-loop"):
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise RuntimeError("the background trio loop did not start")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def body() -> None:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await trio.sleep_forever()

        try:
            trio.run(body)
        except BaseException as error:  # surfaced to the constructor if it happens during start-up
            self._error = error
            self._ready.set()

    @property
    def token(self) -> trio.lowlevel.TrioToken:
        assert self._token is not None
        return self._token

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` on the loop and block until it returns (deadlines are the
        function's own business: every network wait in ``moe`` has one)."""
        return trio.from_thread.run(async_fn, *args, trio_token=self.token)

    def enter(self, manager: AbstractAsyncContextManager[T]) -> T:
        """Enter an async context manager inside the loop; it is exited by ``close()``."""

        async def hold(task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with manager as value:
                task_status.started(value)
                await trio.sleep_forever()

        async def start() -> T:
            assert self._nursery is not None
            return await self._nursery.start(hold)

        return self.run(start)

    def close(self) -> None:
        if self._thread.is_alive() and self._nursery is not None:
            try:
                trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self.token)
            except trio.RunFinishedError:
                pass
        self._thread.join()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
