"""Where the all-reduce's received parts live: float32 buffers reused from round to round, leased
for as long as a round needs them, and the stream buffer provider that decrypts parts straight into
them when their codec allows it."""

from __future__ import annotations

from typing import Any

import torch

from peer.tensors import tensor_bytes

from .compression import codec_of

__all__ = ["BufferLease", "PartBuffers", "PartSink"]


class PartBuffers:
    """Float32 buffers for received parts, reused from round to round.

    A received part is kept until its whole shard is in (a sender's contribution, a reducer's
    average). Fresh buffers for that made the heap grow and shrink by about 1.5x the tensor size
    every round, and the page faults cost more CPU than decrypting the data did. So parts are
    decrypted straight into buffers from here (``PartSink``), a reducer's running sum is one of
    them too, and buffers come back when the lease they were taken under closes. What is kept is
    bounded by what one round held at a time.
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

    def lease(self) -> BufferLease:
        """A lease to take buffers under; use it as a ``with`` block (see ``BufferLease``)."""
        return BufferLease(self)

    def _take(self, numel: int) -> torch.Tensor:
        self._last_taken[numel] = self._round
        free = self._free.get(numel)
        return free.pop() if free else torch.empty(numel, dtype=torch.float32)

    def _give(self, buffer: torch.Tensor) -> None:
        if buffer.numel() in self._last_taken:  # else a size nobody has asked for lately
            self._free.setdefault(buffer.numel(), []).append(buffer)

    @property
    def pooled_bytes(self) -> int:
        return sum(4 * buffer.numel() for free in self._free.values() for buffer in free)


class BufferLease:
    """Buffers taken from a pool for one purpose; every one goes back when the lease closes.

    The lease is open while at least one ``with lease:`` block runs; blocks may nest or overlap
    (a reducer's averaged shard is held by its round and by every handler still sending replies
    from it) and the last one to exit closes it, so no path can forget to give a buffer back.
    A buffer that may still be touched after that (lent to a connection whose message never
    arrived, or queued for sending by a reply that was cut short) is ``forfeit``ed instead: it
    is left to the garbage collector, never handed out again. Only the event loop's thread may
    take, forfeit or close (the pool is not locked).
    """

    def __init__(self, pool: PartBuffers) -> None:
        self._pool = pool
        self._held: dict[int, torch.Tensor] = {}  # id -> buffer
        self._holders = 0
        self._closed = False

    def take(self, numel: int) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this buffer lease is closed")
        buffer = self._pool._take(numel)
        self._held[id(buffer)] = buffer
        return buffer

    def forfeit(self, buffer: torch.Tensor) -> None:
        self._held.pop(id(buffer), None)

    def forfeit_all(self) -> None:
        self._held.clear()

    def __enter__(self) -> BufferLease:
        if self._closed:
            raise RuntimeError("this buffer lease is closed")
        self._holders += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._closed = True
            for buffer in self._held.values():
                self._pool._give(buffer)
            self._held.clear()


class PartSink:
    """A stream's buffer provider: a part whose codec can receive its payload in place (raw
    float32: the bytes are the values) is decrypted straight into a leased buffer, with no copy
    and no allocation; ``target`` then hands out the buffer each part's values belong in.

    The part sizes may be unknown when the first parts arrive (a reducer's handler learns them
    from its round, which may start after the sender started streaming): until then any
    such part gets a buffer of its own size, and ``target`` checks the size once it is known.
    Closing the sink forfeits every buffer lent but never claimed (the connection's reader may
    still write into it) and lends nothing more.
    """

    # What one part may make us lend before its size can be checked (the stream's credit window
    # bounds how many such parts are in flight).
    MAX_UNCHECKED_PART = 64 << 20

    def __init__(self, lease: BufferLease, part_sizes: list[int] | None = None):
        self.lease = lease
        self.part_sizes = part_sizes
        self._lent: dict[int, tuple[memoryview, torch.Tensor]] = {}
        self._closed = False

    def provide(self, body: Any, nbytes: int) -> memoryview | None:
        """The stream's buffer provider (``body`` comes from the network: anything unexpected gets
        a fresh buffer, and the normal checks refuse it later)."""
        if self._closed or not isinstance(body, dict):
            return None
        index, meta = body.get("part"), body.get("meta")
        if type(index) is not int or index < 0 or index in self._lent:
            return None
        try:
            numel = codec_of(meta).in_place_numel(meta, nbytes)
        except ValueError:
            return None
        if numel is None:
            return None
        if self.part_sizes is None:
            if nbytes > self.MAX_UNCHECKED_PART:
                return None
        elif index >= len(self.part_sizes) or numel != self.part_sizes[index]:
            return None
        values = self.lease.take(numel)
        view = tensor_bytes(values)
        self._lent[index] = (view, values)
        return view

    __call__ = provide  # a sink is its stream's buffer provider

    def target(self, index: int, payload: Any, numel: int) -> tuple[torch.Tensor, bool]:
        """Where part ``index``'s ``numel`` values go, and whether its payload is already there:
        the buffer the payload was received into, or else a buffer leased from the pool for its
        codec to decode into."""
        lent = self._lent.get(index)
        if lent is not None and payload is lent[0] and lent[1].numel() == numel:
            del self._lent[index]
            return lent[1], True
        return self.lease.take(numel), False

    def close(self) -> None:
        self._closed = True
        for _view, values in self._lent.values():
            self.lease.forfeit(values)
        self._lent.clear()

    def __enter__(self) -> PartSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
