"""The process-wide background trio loop that synchronous facades (``dht.DHT``, later the averager
and experts) run their trio components on.

One thread, one ``trio.run``, started lazily by the first user and shared by every later one: a
script that embeds a DHT node, an averager and an expert server still has one event loop, so their
connections share one pool and their tasks one scheduler. Nothing here knows about the DHT.

- ``run(async_fn, *args)``: run a coroutine function in the loop and wait for its result.
- ``submit(async_fn, *args)``: the same, returning a ``concurrent.futures.Future`` (cancelling the
  future cancels the task).
- ``start_service(cm_factory)``: enter an async context manager (``DHTNode.open(...)``) in the loop
  and keep it open until ``handle.close()``; the handle carries the object it yielded.
- At interpreter exit, every service is closed and the loop stops.

Calling ``run`` from inside the loop thread would deadlock, so it raises instead.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import trio

__all__ = ["BackgroundLoop", "ServiceHandle", "get_loop", "run", "submit", "start_service"]

T = TypeVar("T")
log = logging.getLogger("peerd.background")

# Closing services at exit: long enough for peers to be told goodbye, short enough not to hang exit.
SHUTDOWN_TIMEOUT = 10.0


class ServiceHandle(Generic[T]):
    """A context manager kept open in the background loop; ``value`` is what it yielded."""

    def __init__(self, loop: BackgroundLoop, value: T, stop: trio.Event, stopped: threading.Event):
        self.value = value
        self._loop = loop
        self._stop = stop
        self._stopped = stopped

    def close(self, timeout: float | None = SHUTDOWN_TIMEOUT) -> None:
        """Leave the context manager (in the loop) and wait until it has exited."""
        if not self._stopped.is_set() and self._loop.is_running:
            self._loop.call_soon(self._stop.set)
        self._stopped.wait(timeout)

    @property
    def closed(self) -> bool:
        return self._stopped.is_set()


class BackgroundLoop:
    """A trio loop in a daemon thread. Use ``get_loop()`` for the shared one."""

    def __init__(self, name: str = "peerd-trio") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._ready = threading.Event()
        self._services: list[ServiceHandle[Any]] = []
        self._startup_error: BaseException | None = None

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._ready.clear()
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise RuntimeError("the background trio loop failed to start") from self._startup_error

    def _main(self) -> None:
        try:
            trio.run(self._root)
        except BaseException as error:  # reported to the thread that called start()
            self._startup_error = error
        finally:
            self._token = None
            self._nursery = None
            self._ready.set()

    async def _root(self) -> None:
        async with trio.open_nursery() as nursery:
            self._token = trio.lowlevel.current_trio_token()
            self._nursery = nursery
            self._ready.set()
            await trio.sleep_forever()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._token is not None

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Close every service, then stop the loop and join its thread."""
        for service in list(self._services):
            service.close(timeout)
        if self.is_running:
            nursery = self._nursery
            assert nursery is not None
            self.call_soon(nursery.cancel_scope.cancel)
        if self._thread is not None and not self.in_loop_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ running things
    def _token_or_start(self) -> trio.lowlevel.TrioToken:
        if not self.is_running:
            self.start()
        assert self._token is not None
        return self._token

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a synchronous function in the loop soon (thread-safe, does not wait)."""
        self._token_or_start().run_sync_soon(fn, *args)

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` in the loop; block until it returns (or re-raise what it raised)."""
        if self.in_loop_thread():
            raise RuntimeError("called a blocking facade method from inside the background trio loop")
        return self.submit(async_fn, *args).result()

    def submit(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``async_fn(*args)`` in the loop; its outcome arrives in the returned future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        scope = trio.CancelScope()

        # The future stays PENDING while the task runs (never set_running_or_notify_cancel), so that
        # ``future.cancel()`` works on a running task too: it cancels the task's scope.
        async def task() -> None:
            if future.cancelled():
                return
            try:
                with scope:
                    result = await async_fn(*args)
            except BaseException as error:  # the caller's future carries it; the loop stays up
                _settle(future, exception=error if isinstance(error, Exception) else RuntimeError(repr(error)))
                return
            if scope.cancelled_caught:
                _settle(future, exception=concurrent.futures.CancelledError())
            else:
                _settle(future, result=result)

        def on_done(done: concurrent.futures.Future[T]) -> None:
            if done.cancelled() and self.is_running:
                self.call_soon(scope.cancel)

        future.add_done_callback(on_done)
        token = self._token_or_start()
        token.run_sync_soon(self._spawn, task)
        return future

    def _spawn(self, task: Callable[[], Awaitable[None]]) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(task)

    def start_service(
        self, cm_factory: Callable[[], AbstractAsyncContextManager[T]], timeout: float | None = None
    ) -> ServiceHandle[T]:
        """Enter ``cm_factory()`` in the loop and keep it open; raises what entering it raised."""
        stop = trio.Event()
        stopped = threading.Event()
        entered: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def service() -> None:
            try:
                async with cm_factory() as value:
                    entered.set_result(value)
                    await stop.wait()
            except trio.Cancelled:
                if not entered.done():
                    entered.set_exception(RuntimeError("the background trio loop stopped"))
                raise
            except BaseException as error:  # one failing service must not take down the shared loop
                if not entered.done():
                    entered.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))
                else:
                    log.error("background service %r failed", cm_factory, exc_info=True)
            finally:
                stopped.set()

        token = self._token_or_start()
        token.run_sync_soon(self._spawn, service)
        value = entered.result(timeout)
        handle: ServiceHandle[T] = ServiceHandle(self, value, stop, stopped)
        self._services.append(handle)
        return handle


def _settle(
    future: concurrent.futures.Future[Any], *, result: Any = None, exception: BaseException | None = None
) -> None:
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled by the caller meanwhile
        pass


_shared: BackgroundLoop | None = None
_shared_lock = threading.Lock()


def get_loop() -> BackgroundLoop:
    """The process-wide loop (started on first use; stopped at interpreter exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BackgroundLoop()
            atexit.register(_shared.stop)
        return _shared


def run(async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    return get_loop().run(async_fn, *args)


def submit(async_fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
    return get_loop().submit(async_fn, *args)


def start_service(cm_factory: Callable[[], AbstractAsyncContextManager[T]]) -> ServiceHandle[T]:
    return get_loop().start_service(cm_factory)
