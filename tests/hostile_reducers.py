"""Reducers that lie about their shard, for tests and ``benchmarks/byzantine.py``: they aggregate
as honest ones do (and keep their true inputs for the senders' checks), then answer with
something else."""

from __future__ import annotations

from typing import Any

import torch

from averaging.allreduce import AllReduceService
from averaging.allreduce_protocol import ReducerShard
from averaging.compression import Codec


class LyingShard(ReducerShard):
    """Answers every part with its aggregate times ``FACTOR`` (a sign flip, scaled up)."""

    FACTOR = -10.0

    def reply_next(self, codec: Codec) -> None:
        before = len(self.replies)
        super().reply_next(codec)
        if len(self.replies) > before:
            body, _payload = self.replies[-1]
            averaged = self.reduction.part_average(body["part"])
            assert averaged is not None
            meta, payload = codec.encode(self.lie(averaged))
            self.replies[-1] = ({**body, "meta": meta}, payload)

    def lie(self, averaged: torch.Tensor) -> torch.Tensor:
        return averaged * self.FACTOR


def lying_service(host: Any) -> AllReduceService:
    """Install an all-reduce service whose reductions lie as ``host``'s (before any averager)."""
    service = AllReduceService(host, shard_type=LyingShard)
    host.provide_service(AllReduceService, service)
    return service
