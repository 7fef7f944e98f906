"""The tasks a DHT node starts on the side (eviction pings, caching a value on the lookup path).

They run in the node's nursery, so leaving ``DHTNode.open`` cancels them; once the node is stopping,
new ones are not started at all (its host may live on, e.g. in the daemon, and still deliver calls).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["Background"]


class Background:
    def __init__(self, nursery: trio.Nursery):
        self._nursery = nursery
        self.running = True

    def start_soon(self, task: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Start ``task(*args)`` unless the node is stopping (then the work is simply not done);
        whether it started."""
        if self.running:
            self._nursery.start_soon(task, *args)
        return self.running

    def stop(self) -> None:
        self.running = False
