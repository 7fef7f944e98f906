"""The payload of one incoming message while its records arrive, sans I/O.

A header announces a payload of up to ``MAX_PAYLOAD`` bytes; the bytes follow in records of at most
1 MiB. What we allocate follows what has arrived, not what was announced: a peer that announces
256 MiB and sends one MiB has made us commit about two. Three kinds of destination:

* a buffer the application supplied (a stream's buffer provider): filled in place, no allocation,
  which is the all-reduce's path; it is the application's memory, so it is not charged;
* a fresh ``bytearray`` grown as records arrive, doubling, so committed memory is at most twice
  what was received and the growth costs ``log2(payload / record)`` reallocations;
* nothing, for a message that no live call will read (late traffic after a cancel): its records
  are decrypted into one scratch record and dropped.

Fresh buffers are charged to a ``ReceiveBudget`` as they grow and refunded when the payload is
complete (the message then belongs to its call) or abandoned (the connection closed mid-payload).
"""

from __future__ import annotations

from typing import Any

from .buffers import byte_view
from .framing import MAX_RECORD_PLAINTEXT

__all__ = ["IncomingPayload"]

# The first allocation for a fresh payload: one record, the unit in which payload bytes arrive.
FIRST_STEP = MAX_RECORD_PLAINTEXT
_SCRATCH = bytearray(MAX_RECORD_PLAINTEXT)  # where discarded payloads are decrypted (never read)


class IncomingPayload:
    __slots__ = ("header", "length", "filled", "discard", "supplied", "_buffer", "_budget", "_charged")

    def __init__(self, length: int, budget: Any, *, discard: bool = False, header: Any = None):
        self.header = header  # the message header that announced the payload
        self.length = length
        self.filled = 0
        self.discard = discard
        self.supplied = False
        self._buffer: Any = None
        self._budget = budget
        self._charged = 0

    @property
    def started(self) -> bool:
        return self.filled > 0 or self._buffer is not None

    def supply(self, buffer: Any) -> None:
        view = byte_view(buffer)
        if view.readonly:
            raise ValueError("a payload buffer must be writable")
        if len(view) != self.length:
            raise ValueError(f"payload buffer holds {len(view)} bytes, the payload has {self.length}")
        self._buffer, self.supplied = buffer, True

    def target(self, nbytes: int | None = None) -> memoryview:
        """Room for the next ``nbytes`` of payload (all that remains if None)."""
        remaining = self.length - self.filled
        nbytes = remaining if nbytes is None else min(nbytes, remaining)
        if self.discard:
            return memoryview(_SCRATCH)[: min(nbytes, len(_SCRATCH))]
        if self._buffer is None or (not self.supplied and len(self._buffer) < self.filled + nbytes):
            self._grow(self.filled + nbytes)
        return byte_view(self._buffer)[self.filled : self.filled + nbytes]

    def _grow(self, needed: int) -> None:
        current = 0 if self._buffer is None else len(self._buffer)
        size = min(self.length, max(needed, 2 * current, FIRST_STEP))
        if self._budget is not None:
            self._budget.charge(size - current, "a payload buffer")
        self._charged += size - current
        if self._buffer is None:
            self._buffer = bytearray(size)
            return
        try:
            # bytes(n) of a large size is calloc'ed (untouched zero pages), and a large bytearray
            # is usually extended in place by realloc: the growth costs about one zero-fill.
            self._buffer += bytes(size - current)
        except BufferError:  # a view handed out earlier is still alive: move to a new buffer
            grown = bytearray(size)
            grown[:current] = self._buffer
            self._buffer = grown

    def received(self, nbytes: int) -> bool:
        """Count ``nbytes`` written into the last target; True once the payload is complete."""
        self.filled += nbytes
        return self.filled >= self.length

    def take(self) -> Any:
        """The completed payload (None if discarded); refunds the budget."""
        self.release()
        return None if self.discard else (self._buffer if self._buffer is not None else bytearray())

    def release(self) -> None:
        if self._charged and self._budget is not None:
            self._budget.refund(self._charged)
        self._charged = 0
