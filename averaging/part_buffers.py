"""Where the all-reduce's received parts live: float32 buffers reused from round to round, and the
stream buffer provider that decrypts uncompressed parts straight into them."""

from __future__ import annotations

from typing import Any

import torch

from peer.tensors import tensor_bytes

from .flat_parts import RAW_META

__all__ = ["PartBuffers", "RawPartSink"]


class PartBuffers:
    """Float32 buffers for received parts, reused from round to round.

    A received part is kept until its whole shard is in (a sender's contribution, a reducer's
    average). Fresh buffers for that made the heap grow and shrink by about 1.5x the tensor size
    every round, and the page faults cost more CPU than decrypting the data did. So parts are
    decrypted straight into buffers from here (``RawPartSink``; compressed parts come out of
    their codec), a reducer's running sum is one of them too, and buffers come back when their
    round no longer needs them. What is kept is bounded by what one round held at a time.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._round = 0
        self._last_taken: dict[int, int] = {}  # buffer size -> round it was last taken in

    def start_round(self) -> None:
        """Forget buffer sizes that neither this round nor the last one took. Sizes follow the
        group (its members, their order, their declared bandwidths), so without this every new
        shard size would stay pooled for good, and a peer changing its bandwidth every round
        could grow our memory without bound."""
        self._round += 1
        for numel in [n for n, last in self._last_taken.items() if last < self._round - 1]:
            del self._last_taken[numel]
            self._free.pop(numel, None)

    def take(self, numel: int) -> torch.Tensor:
        self._last_taken[numel] = self._round
        free = self._free.get(numel)
        return free.pop() if free else torch.empty(numel, dtype=torch.float32)

    def give(self, buffers) -> None:
        for buffer in buffers:
            if buffer.numel() in self._last_taken:  # else a size nobody has asked for lately
                self._free.setdefault(buffer.numel(), []).append(buffer)

    @property
    def pooled_bytes(self) -> int:
        return sum(4 * buffer.numel() for free in self._free.values() for buffer in free)


class RawPartSink:
    """Receives uncompressed parts straight into pooled float32 buffers: the stream decrypts each
    part into the buffer it will be reduced or written back from, with no copy and no allocation.

    The part sizes may be unknown when the first parts arrive (a reducer's handler learns them
    from its session, which may be announced after the sender started streaming): until then any
    raw part gets a buffer of its own size, and ``claim`` checks the size once it is known. A
    buffer is returned to the pool only by whoever claimed it with the right size; one lent but
    never claimed is dropped, since the connection's reader may still write into it.
    """

    # What one part may make us lend before its size can be checked (the stream's credit window
    # bounds how many such parts are in flight).
    MAX_UNCHECKED_PART = 64 << 20

    def __init__(self, buffers: PartBuffers, part_sizes: list[int] | None = None):
        self._buffers = buffers
        self.part_sizes = part_sizes
        self._lent: dict[int, tuple[memoryview, torch.Tensor]] = {}

    def provide(self, body: Any, nbytes: int) -> memoryview | None:
        """The stream's buffer provider (``body`` comes from the network: anything unexpected gets
        a fresh buffer, and the normal checks refuse it later)."""
        if not (isinstance(body, dict) and body.get("meta") == RAW_META):
            return None
        index = body.get("part")
        if type(index) is not int or index < 0 or index in self._lent or nbytes <= 0 or nbytes % 4:
            return None
        if self.part_sizes is None:
            if nbytes > self.MAX_UNCHECKED_PART:
                return None
        elif index >= len(self.part_sizes) or nbytes != 4 * self.part_sizes[index]:
            return None
        values = self._buffers.take(nbytes // 4)
        view = tensor_bytes(values)
        self._lent[index] = (view, values)
        return view

    __call__ = provide  # a sink is its stream's buffer provider

    def claim(self, index: int, payload: Any, numel: int) -> torch.Tensor | None:
        """The values of part ``index`` if its payload arrived in our buffer with the expected
        ``numel``, else None."""
        lent = self._lent.get(index)
        if lent is None or payload is not lent[0] or lent[1].numel() != numel:
            return None
        del self._lent[index]
        return lent[1]
