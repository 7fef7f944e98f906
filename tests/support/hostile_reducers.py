"""Reducers that lie about their shard, for tests and ``benchmarks/byzantine.py``: they aggregate
as honest ones do, then answer with something else. ``LyingShard`` keeps its true inputs for the
senders' checks; ``fabricating_service`` answers each check with inputs made to fit its lie;
``CensoringShard`` aggregates truly but leaves chosen senders out, as if they had stalled."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from averaging.allreduce import AllReduceService
from averaging.commitments import SignedPart, commit, part_digest
from averaging.compression import Codec, get_codec
from averaging.reducer_shard import ReducerShard
from averaging.verification import KeptInputs, PartInputs, radius_from


class LyingShard(ReducerShard):
    """Answers every part with its aggregate times ``FACTOR`` (a sign flip, scaled up); the lies
    it sent go into ``lies`` ((group ID, part index) -> values) in a checked round, if given."""

    FACTOR = -10.0

    def __init__(self, *args: Any, lies: dict[tuple[bytes, int], torch.Tensor] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lies = lies if lies is not None else {}

    def reply_next(self, codec: Codec) -> None:
        before = len(self.replies)
        super().reply_next(codec)
        if len(self.replies) > before:
            body, _payload = self.replies[-1]
            averaged = self.reduction.part_average(body["part"])
            assert averaged is not None
            lie = self.lie(averaged)
            if self.signing is not None:
                self.lies[(self.signing.group_id, body["part"])] = lie
            meta, payload = codec.encode(lie)
            self.replies[-1] = ({**body, "meta": meta}, payload)

    def lie(self, averaged: torch.Tensor) -> torch.Tensor:
        return averaged * self.FACTOR


def lying_service(host: Any) -> AllReduceService:
    """Install an all-reduce service whose reductions lie as ``host``'s (before any averager)."""
    service = AllReduceService(host, shard_type=LyingShard)
    host.provide_service(AllReduceService, service)
    return service


class FabricatedInputs(KeptInputs):
    """Answers each checker with its own contribution as it sent it and every other contribution
    (ours included) equal to the lie we replied: CenteredClip of those, from ours, is the lie. The
    other senders' commitments are passed on unchanged (we cannot sign theirs); ours we make anew,
    to the lie."""

    def __init__(self, host: Any):
        super().__init__()
        self.host = host
        self.lies: dict[tuple[bytes, int], torch.Tensor] = {}  # filled by our ``LyingShard``s

    def answer(self, group_id: Any, index: Any, asker: Any, now: float) -> PartInputs:
        true = super().answer(group_id, index, asker, now)
        lie = self.lies[(group_id, index)]
        values = true.values.clone()
        me = self.host.identity
        plain, signed = get_codec("none"), list(true.signed)
        for row, sender in enumerate(true.senders):
            if sender == asker:
                continue
            values[row] = lie
            meta, payload = plain.encode(lie)
            if sender == me.peer_id:  # ours we may sign as we like
                digests = [part_digest(meta, payload) if part == index else bytes(32) for part in range(index + 1)]
                commitment = commit(me, group_id, true.weights[row], [(me.peer_id, digests)])
                signed[row] = SignedPart(commitment, meta, bytes(payload))
            elif row < len(signed):
                signed[row] = SignedPart(signed[row].commitment, meta, bytes(payload))
        start = true.senders.index(me.peer_id)
        tau = radius_from(values, start)
        return PartInputs(true.senders, true.weights, values, tau, true.aggregation, start, signed)


def fabricating_service(host: Any) -> AllReduceService:
    """A service whose reductions lie as ``LyingShard`` does and whose check answers fabricate
    the other senders' inputs to fit the lie (``FabricatedInputs``)."""
    kept = FabricatedInputs(host)
    return AllReduceService(host, shard_type=partial(LyingShard, lies=kept.lies), kept=kept)


class CensoringShard(ReducerShard):
    """Leaves the senders in ``victims`` out of its average from the start, saying they stalled
    (an honest reducer's words for a sender that fell silent), and aggregates the rest truly."""

    def __init__(self, *args: Any, victims: set | frozenset = frozenset(), **kwargs: Any):
        super().__init__(*args, **kwargs)
        for sender in [s for s in self.reduction.expected if s in victims]:
            self.drop(sender, "no byte for 5 s")
