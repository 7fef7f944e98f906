"""``Later``: the result of one task that runs in a nursery, collected by another task later.

Trio has no futures, on purpose: a value floating free of any task hides who waits for it and
what cancels it. The rounds that run behind the trainer (a delayed gradient round, an overlapped
local-updates round, a group formed ahead of the step) still need exactly one: started by the
step, collected by a later step or cancelled when the optimizer moves on. ``Later`` is that, and
no more: the task lives in the caller's nursery (it ends with it), cancelling it is a cancel
scope made with the object (so a cancel before the task even started still takes), and waiting
for it waits until the task is out, however it ended, so that the buffers it used are free.
An exception from the task is not kept: it goes to the nursery, as any task's does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import trio

__all__ = ["Later", "TaskSpawner"]

T = TypeVar("T")


class TaskSpawner(Protocol):
    """Where a ``Later``'s task runs: a nursery, or a host (``PeerHost.start_soon``: its tasks end
    with the host)."""

    def start_soon(self, task: Callable[..., Awaitable[Any]], *args: Any) -> Any: ...


class Later(Generic[T]):
    """``await work()`` run in ``nursery``; its value, once it returned, for whoever collects it."""

    def __init__(self, nursery: TaskSpawner, work: Callable[[], Awaitable[T]]):
        self._scope = trio.CancelScope()
        self._exited = trio.Event()
        self._value: T | None = None
        self._returned = False
        nursery.start_soon(self._run, work)

    async def _run(self, work: Callable[[], Awaitable[T]]) -> None:
        try:
            with self._scope:
                self._value = await work()
                self._returned = True
        finally:
            self._exited.set()

    @property
    def ready(self) -> bool:
        """The work returned: its value is here."""
        return self._returned

    @property
    def over(self) -> bool:
        """The task is out, whether the work returned, was cancelled or failed."""
        return self._exited.is_set()

    def cancel(self) -> None:
        """Cancel the work (before it started, too); ``wait`` still waits until it is out."""
        self._scope.cancel()

    async def wait(self) -> T | None:
        """Wait until the task is out; its value, or None if the work did not return."""
        await self._exited.wait()
        return self._value if self._returned else None

    def value(self) -> T:
        """The value of work that returned (check ``ready`` first)."""
        if not self._returned:
            raise RuntimeError("the work has not returned a value")
        return self._value  # type: ignore[return-value]
