"""One process-wide budget for memory that remote peers make us hold before a message is complete.

A partially received record (in a connection's ``RecordDecoder``) or payload (in its
``RPCProtocol``) is memory a remote peer chose to make us commit, and it is held until the peer
finishes sending. Per-connection limits alone do not bound it: the admission limits let hundreds of
connections in, each of which may hold a record or payload half-sent. Every such buffer is charged
here when it is allocated or grown and refunded when the message completes or its connection closes.

A connection that would exceed the budget is closed (``ReceiveBudgetExceeded``), it does not wait:
waiting would keep its partial memory committed and its socket open while it waits for memory that
other stalled connections hold, and two peers streaming to each other could each wait on the other.
Closing frees the memory at once; an honest peer's call fails with ``ConnectionLost`` and is retried
by the layer above, as after any broken connection.
"""

from __future__ import annotations

from .framing import ProtocolError

__all__ = ["RECEIVE_BUDGET", "ReceiveBudget", "ReceiveBudgetExceeded", "process_budget"]

# Two maximal payloads (2 x 256 MiB) in flight at once, or ~480 connections each in the middle of a
# 1 MiB record. On a volunteer machine with 4 GiB of RAM that is an eighth of its memory, which a
# training process can spare; a larger swarm's hub raises it through ``process_budget().limit``.
RECEIVE_BUDGET = 512 << 20


class ReceiveBudgetExceeded(ProtocolError):
    """Accepting more partial data on this connection would exceed the process-wide budget."""


class ReceiveBudget:
    """A counter of bytes committed to incomplete incoming records and payloads."""

    __slots__ = ("limit", "used", "peak")

    def __init__(self, limit: int = RECEIVE_BUDGET):
        self.limit = limit
        self.used = 0
        self.peak = 0  # for tests and metrics: the most ever held at once

    def charge(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes``; raise ``ReceiveBudgetExceeded`` (and reserve nothing) if it would not fit."""
        if self.used + nbytes > self.limit:
            raise ReceiveBudgetExceeded(
                f"{what} of {nbytes} bytes would exceed the process-wide budget for incomplete "
                f"messages ({self.used} of {self.limit} bytes held)"
            )
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def refund(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "refunded more than was charged"


_PROCESS_BUDGET = ReceiveBudget()


def process_budget() -> ReceiveBudget:
    """The budget every connection of this process shares unless given its own."""
    return _PROCESS_BUDGET
