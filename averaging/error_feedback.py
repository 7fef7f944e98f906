"""Error feedback for lossy averaging: what rounding drops this round is sent in the next one.

A peer that sends its pseudo-gradient as 8-bit values loses up to half a quantisation step per
value per round. Alone that error is small, but it is biased for values that stay below a step
round after round (they are always rounded away), and over hundreds of rounds it adds up. With
error feedback (as in 1-bit SGD, EF-SGD and DiLoCo's int8 variants) each peer keeps the residual
``sent - decoded`` of its last contribution and adds it to the next one, so nothing is lost for
good: over any run of rounds the sum of what was transmitted equals the sum of what was meant to
be, up to the last residual.

Which values were rounded is known exactly: parts of shards reduced by another peer were encoded
with the round's codec (``AllReduceResult.plan`` says where each part starts, which fixes how a
blockwise codec's blocks fall); our own shard, and shards whose reducer failed (they kept our
local values), were never encoded. A part whose average left us out (the reducer dropped us as a
sender before it) lost all of our contribution to it: that whole slice is owed to the next round.
Plain tensor arithmetic, no I/O: callers run it in a thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peer import PeerID

from .allreduce import AllReduceResult
from .compression import Codec, get_codec

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residual of one peer's contributions to rounds averaged with ``codec``."""

    def __init__(self, tensors: Sequence[torch.Tensor], codec: str | Codec, me: PeerID | None = None):
        self.codec = get_codec(codec)
        self.me = me  # our peer ID: a shard whose average left us out owes our whole contribution
        self.residual = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32)
        self._sent: torch.Tensor | None = None

    def add_residual(self, tensors: Sequence[torch.Tensor]) -> None:
        """Add what earlier rounds dropped into ``tensors`` (in place), and remember the sum as
        this round's contribution."""
        offset = 0
        with torch.no_grad():
            for tensor in tensors:
                size = tensor.numel()
                tensor.add_(self.residual[offset : offset + size].view_as(tensor).to(tensor.dtype))
                offset += size
            self._sent = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])

    def move_into(self, params: Sequence[torch.Tensor]) -> None:
        """Leave what is still owed in the parameters rather than in the residual: ``params -=
        residual`` (a delta is ``start - params``), so the next round's delta carries it by itself.

        For a sparse codec with outer learning rate 1 and no outer momentum, where a round applies
        only a few values of each chunk: each peer's parameters then stay where its own training
        took them, less what the swarm's average already applied, instead of falling back to the
        shared start and relearning the rest (``local_updates.py``)."""
        offset = 0
        with torch.no_grad():
            for param in params:
                size = param.numel()
                owed = self.residual[offset : offset + size].view_as(param)
                param.sub_(owed.to(param.device, param.dtype))
                offset += size
        self.residual.zero_()

    def reset(self) -> None:
        """Forget the residual (our parameters were replaced: what earlier rounds dropped no
        longer belongs to them)."""
        self.residual.zero_()
        self._sent = None

    def owe_all(self, tensors: Sequence[torch.Tensor]) -> None:
        """After a round that averaged nothing, with a sparse codec: it applies nothing either
        (``tensors`` zeroed) and all of this round's contribution stays owed. Applying our whole
        delta instead, as a dense round's fallback does, would move this peer's shared start by
        all of its unsent progress, away from every other peer's."""
        sent, self._sent = self._sent, None
        with torch.no_grad():
            if sent is None:
                self.residual.zero_()
            else:
                self.residual.copy_(sent)
            for tensor in tensors:
                tensor.zero_()

    def settle(self, result: AllReduceResult | None, averaged: Sequence[torch.Tensor] | None = None) -> None:
        """After the round: the new residual is what the round's encoding dropped from our
        contribution (``result`` None: the round failed and our values were used as they are).

        A sparse codec's average keeps only some values of each chunk (``Codec.sparse``): then
        ``averaged`` (the tensors as the round left them) says which, and of every value the
        average left out our whole contribution stays owed. Our own shard's contribution went in
        encoded as well (``sparse_codec.as_sent``), so it is settled as the others are.

        Not kept by anyone: the rounding of the reducers' replies (the average at 2 or 4 bits) is
        shared by the whole group, and no peer's residual holds it."""
        sent, self._sent = self._sent, None
        self.residual.zero_()
        if sent is None or result is None or result.plan is None:
            return
        kept = None
        if self.codec.sparse:
            if averaged is None:
                raise ValueError(f"{self.codec.name} is sparse: settle needs the averaged tensors")
            kept = torch.cat([t.detach().reshape(-1) for t in averaged]) != 0
        plan = result.plan
        for index in range(plan.num_shards):
            if index in result.local_shards:
                if kept is not None:  # a sparse round wrote zeros there: all of our contribution stays owed
                    start, end = plan.shard_bounds(index)
                    self.residual[start:end] = sent[start:end]
                continue  # a dense round's: our local values were applied as they are
            parts = plan.parts(index)
            if index == result.my_shard and kept is None:
                continue  # our own reduction, of our exact values (a sparse codec's go in as sent)
            per_part = result.part_contributors.get(index)
            if per_part is None or len(per_part) != len(parts):  # the shard's list holds for each part
                per_part = [result.contributors.get(index)] * len(parts)
            for (start, end), contributors in zip(parts, per_part, strict=True):
                values = sent[start:end]
                if self.me is not None and contributors is not None and self.me not in contributors:
                    self.residual[start:end] = values  # averaged without us: none of it arrived
                    continue
                meta, payload = self.codec.encode(values)
                decoded = self.codec.decode(meta, payload, end - start)
                if kept is not None:
                    decoded.mul_(kept[start:end])
                torch.sub(values, decoded, out=self.residual[start:end])
