"""``Averager``: the synchronous face of ``GroupAverager`` for plain PyTorch scripts.

It runs in the process-wide background trio loop (``peer.background``) next to the ``DHT``
facade it is given, so a script needs no async code at all:

    dht = DHT(initial_peers=["127.0.0.1:31337"], start=True)
    avg = Averager([model.weight, model.bias], dht, prefix="run1", target_group_size=4)
    result = avg.step(weight=1.0, timeout=30)
    with avg.get_tensors() as tensors:
        ...
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .allreduce import AllReduceResult
from .averager import GroupAverager
from .step_ahead import StepAhead

__all__ = ["Averager"]


class Averager:
    """Averages ``tensors`` in place with other peers of ``prefix``; see ``GroupAverager``."""

    def __init__(self, tensors: Sequence[torch.Tensor], dht, *, prefix: str, **options: Any):
        self._dht = dht
        self._loop = dht._loop

        async def create() -> GroupAverager:
            return GroupAverager(tensors, dht.node, prefix=prefix, **options)

        self._averager: GroupAverager = self._loop.run(create)
        # Steps called in a rhythm (a training loop's) find their group formed ahead.
        self._steps = StepAhead(self._averager, self._averager.host)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self._averager.tensors

    def step(
        self, weight: float = 1.0, timeout: float | None = None, *, return_future: bool = False
    ) -> AllReduceResult | concurrent.futures.Future[AllReduceResult]:
        """Find a group and average; raises MatchmakingError if none formed within ``timeout``.
        Once steps come in a rhythm, each finds its group formed ahead (``step_ahead.py``)."""
        future = self._loop.submit(self._step, weight, timeout)
        return future if return_future else future.result()

    async def _step(self, weight: float, timeout: float | None) -> AllReduceResult:
        return (await self._steps.step(weight, timeout)).result

    @contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, with no round changing them while the block runs."""
        tensors = self._loop.run(self._averager.hold_tensors)
        try:
            yield tensors
        finally:
            self._loop.call_soon(self._averager.release_tensors)

    def load_state_from_peers(self, timeout: float = 30.0) -> Any:
        return self._loop.run(self._averager.load_state_from_peers, timeout)

    def shutdown(self) -> None:
        """Leave: the other peers stop counting on this one at once (see ``GroupAverager.leave``).
        Call it before shutting down the DHT."""
        self._loop.run(self._leave)

    async def _leave(self) -> None:
        await self._steps.close()
        await self._averager.leave()
