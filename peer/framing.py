"""Length-prefixed records, sans I/O.

Every byte on a peerd connection is a record: a 4-byte big-endian length, then that many bytes.
During the Noise handshake a record holds one handshake message; afterwards it holds one AEAD
ciphertext. The decoder owns its receive buffer so that the socket can ``recv_into`` it directly
(no intermediate ``bytes`` per read) and hands out views of complete records.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

__all__ = ["FrameTooLarge", "ProtocolError", "RecordDecoder", "HEADER", "IDLE_BUFFER_SIZE", "READ_SLACK"]

HEADER = struct.Struct(">I")
# A record carries at most 1 MiB of plaintext plus the 16-byte AEAD tag. 1 MiB is large enough that
# per-record costs (one AEAD call, one header) vanish next to the copy and encryption of the bytes,
# and small enough that a record never holds the event loop for more than ~0.2 ms to decrypt.
MAX_RECORD_PLAINTEXT = 1 << 20
AEAD_TAG_SIZE = 16
MAX_RECORD_SIZE = MAX_RECORD_PLAINTEXT + AEAD_TAG_SIZE
# What one read may take beyond the record in progress: 64 KiB is the most a loopback or LAN socket
# hands over per wakeup without SO_RCVLOWAT, so small records still arrive many per syscall, and it
# is the room a large record may start at without the buffer having to move it (see writable()).
READ_SLACK = 64 * 1024
# What an idle connection's decoder holds: a peer keeps a connection to each of the dozens of peers
# its DHT and groups talk to, and most of them are quiet most of the time.
IDLE_BUFFER_SIZE = 4 * 1024


class ProtocolError(Exception):
    """The remote side broke the wire protocol; the connection is unusable afterwards."""


class FrameTooLarge(ProtocolError):
    pass


class RecordDecoder:
    """Splits a byte stream into records of at most ``max_record_size`` bytes.

    Use it as ``view = decoder.writable(); n = sock.recv_into(view); decoder.commit(n)`` then drain
    ``decoder.next_record()`` until it returns None. A returned view stays valid until the next call
    to ``writable`` (which may compact the buffer). ``receive_data`` does the same for tests.

    Memory: the decoder holds at most one record plus ``READ_SLACK``. It starts with a small buffer
    (an idle or handshaking connection costs ``IDLE_BUFFER_SIZE``), widens it to ``READ_SLACK`` when
    a record needs more or a read filled it (traffic is arriving faster than the small buffer takes
    it), and switches to one of the full size when a record needs it; that large buffer is an
    anonymous mapping, so the pages a record has not reached are never committed (a record left
    half-sent costs half a record) and ``release()`` returns all of it to the OS, which the C heap
    would not reliably do for many freed 1 MiB blocks. The large buffer is charged to ``budget`` (a
    ``ReceiveBudget``) while held.
    """

    def __init__(
        self, max_record_size: int = MAX_RECORD_SIZE, initial_size: int = IDLE_BUFFER_SIZE, budget: Any = None
    ):
        self.max_record_size = max_record_size
        self._capacity = HEADER.size + max_record_size + READ_SLACK
        self._initial_size = min(initial_size, self._capacity)
        self._budget = budget
        self._charged = 0  # what the large buffer costs the budget while we hold it
        self._buffer: Any = bytearray(self._initial_size)
        self._view = memoryview(self._buffer)
        self._start = 0  # first unconsumed byte
        self._end = 0  # one past the last received byte
        self._offered = 0  # the size of the last view writable() handed out
        self._filled = False  # the last read took all of it: widen before the next
        self._failed: ProtocolError | None = None

    def writable(self, min_free: int = READ_SLACK) -> memoryview:
        """A view of free buffer space to receive into; compacts or grows the buffer as needed.

        While a record larger than ``READ_SLACK`` is incomplete the view ends where that record
        does, and otherwise it holds at most ``READ_SLACK`` bytes: so a large record starts within
        the first ``READ_SLACK`` bytes of the buffer and always fits without being moved (moving a
        partial record is a copy of up to a record), at the cost of at most one extra read per large
        record."""
        if self._failed is not None:
            raise self._failed
        if self._start == self._end:
            self._start = self._end = 0
        pending = self._end - self._start
        needed, limit = HEADER.size, max(1, min(min_free, READ_SLACK))
        if pending >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer, self._start)
            missing = HEADER.size + length - pending
            if length <= self.max_record_size and missing > 0:
                needed = missing
                if HEADER.size + length > READ_SLACK:
                    limit = missing
        if len(self._buffer) < READ_SLACK and (self._filled or pending + needed > len(self._buffer)):
            if pending + needed <= READ_SLACK:
                self._widen(READ_SLACK)
        self._filled = False
        free = len(self._buffer) - self._end
        if free < needed or free < min(limit, len(self._buffer) // 4):
            tail = self._view[self._start : self._end]
            if pending + needed > self._capacity:
                raise RuntimeError("complete records must be drained before more bytes are received")
            if pending + needed > len(self._buffer):
                self._grow(tail)
            else:
                # Assign through the memoryview: bytearray slice assignment from any object other
                # than a bytearray first copies it into a temporary bytearray. Overlapping views
                # are not promised memmove semantics, so that case goes through one temporary copy.
                self._view[:pending] = tail if pending <= self._start else bytes(tail)
            self._start, self._end = 0, pending
        view = self._view[self._end : self._end + limit]
        self._offered = len(view)
        return view

    def _widen(self, size: int) -> None:
        """Move the unconsumed bytes into a plain buffer of ``size`` bytes, from its start."""
        wide = bytearray(size)
        pending = self._end - self._start
        wide[:pending] = self._view[self._start : self._end]
        self._buffer, self._view = wide, memoryview(wide)
        self._start, self._end = 0, pending

    def _grow(self, tail: memoryview) -> None:
        if self._budget is not None:
            try:
                self._budget.charge(self._capacity, "a record buffer")
            except ProtocolError as error:
                self._failed = error
                raise
            self._charged = self._capacity
        grown = mmap.mmap(-1, self._capacity)
        view = memoryview(grown)
        view[: len(tail)] = tail
        self._buffer, self._view = grown, view

    def release(self, *, closing: bool = False) -> bool:
        """Give back whatever the buffer holds beyond its idle size if no partial record is in it
        (or ``closing``: the connection is done and nothing in the buffer matters any more); True
        if memory was returned."""
        if not self.holds_spare_buffer:
            return False
        if self._end > self._start and not closing:
            return False
        leftover = bytes(self._view[self._start : self._end]) if not closing else b""
        self._buffer = bytearray(max(self._initial_size, len(leftover)))
        self._view = memoryview(self._buffer)
        self._view[: len(leftover)] = leftover
        self._start, self._end = 0, len(leftover)
        if self._charged and self._budget is not None:
            self._budget.refund(self._charged)
        self._charged = 0
        return True

    @property
    def buffer_size(self) -> int:
        """Bytes of buffer held now, used or not (what this connection's receiving costs)."""
        return len(self._buffer)

    @property
    def holds_large_buffer(self) -> bool:
        return isinstance(self._buffer, mmap.mmap)

    @property
    def holds_spare_buffer(self) -> bool:
        """More buffer than an idle connection needs (``release`` gives it back)."""
        return self._charged > 0 or isinstance(self._buffer, mmap.mmap) or len(self._buffer) > self._initial_size

    def take_buffered(self) -> bytes:
        """Remove and return the unconsumed bytes (hand-over from the handshake decoder)."""
        data = bytes(self._view[self._start : self._end])
        self._start = self._end = 0
        return data

    def commit(self, nbytes: int) -> None:
        self._end += nbytes
        self._filled = nbytes >= self._offered > 0

    def receive_data(self, data: bytes) -> None:
        """Copy ``data`` into the buffer (convenience for tests and handshakes)."""
        offset = 0
        while offset < len(data):
            view = self.writable(min_free=min(len(data) - offset, READ_SLACK))
            chunk = min(len(view), len(data) - offset)
            view[:chunk] = data[offset : offset + chunk]
            del view
            self.commit(chunk)
            offset += chunk

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def missing(self) -> int:
        """Bytes still to come before the record in progress is complete (0 if unknown)."""
        pending = self._end - self._start
        if pending < HEADER.size:
            return 0
        (length,) = HEADER.unpack_from(self._buffer, self._start)
        return max(0, HEADER.size + length - pending)

    def next_record(self) -> memoryview | None:
        """The next complete record body, or None if more bytes are needed."""
        if self._failed is not None:
            raise self._failed
        available = self._end - self._start
        if available < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer, self._start)
        if length > self.max_record_size:
            self._failed = FrameTooLarge(f"record of {length} bytes announced; the limit is {self.max_record_size}")
            raise self._failed
        if available < HEADER.size + length:
            return None
        body_start = self._start + HEADER.size
        self._start = body_start + length
        return self._view[body_start : self._start]
