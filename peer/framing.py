"""Length-prefixed records, sans I/O.

Every byte on a peerd connection is a record: a 4-byte big-endian length, then that many bytes.
During the Noise handshake a record holds one handshake message; afterwards it holds one AEAD
ciphertext. The decoder owns its receive buffer so that the socket can ``recv_into`` it directly
(no intermediate ``bytes`` per read) and hands out views of complete records.
"""

from __future__ import annotations

import struct

__all__ = ["FrameTooLarge", "ProtocolError", "RecordDecoder", "HEADER"]

HEADER = struct.Struct(">I")
# A record carries at most 1 MiB of plaintext plus the 16-byte AEAD tag. 1 MiB is large enough that
# per-record costs (one AEAD call, one header) vanish next to the copy and encryption of the bytes,
# and small enough that a record never holds the event loop for more than ~0.2 ms to decrypt.
MAX_RECORD_PLAINTEXT = 1 << 20
AEAD_TAG_SIZE = 16
MAX_RECORD_SIZE = MAX_RECORD_PLAINTEXT + AEAD_TAG_SIZE


class ProtocolError(Exception):
    """The remote side broke the wire protocol; the connection is unusable afterwards."""


class FrameTooLarge(ProtocolError):
    pass


class RecordDecoder:
    """Splits a byte stream into records of at most ``max_record_size`` bytes.

    Use it as ``view = decoder.writable(); n = sock.recv_into(view); decoder.commit(n)`` then drain
    ``decoder.next_record()`` until it returns None. A returned view stays valid until the next call
    to ``writable`` (which may compact the buffer). ``receive_data`` does the same for tests.
    """

    def __init__(self, max_record_size: int = MAX_RECORD_SIZE, initial_size: int = 64 * 1024):
        self.max_record_size = max_record_size
        # The buffer starts small (an idle or handshaking connection costs little) and grows to hold
        # several maximal records, which keeps compaction (a copy of the partial record at the
        # tail) to at most once per three records' worth of bytes.
        self._max_buffer = 4 * (max_record_size + HEADER.size)
        self._buffer = bytearray(min(initial_size, self._max_buffer))
        self._view = memoryview(self._buffer)
        self._start = 0  # first unconsumed byte
        self._end = 0  # one past the last received byte
        self._failed: ProtocolError | None = None

    def writable(self, min_free: int = 64 * 1024) -> memoryview:
        """A view of free buffer space to receive into; compacts or grows the buffer as needed."""
        if self._start == self._end:
            self._start = self._end = 0
        pending = self._end - self._start
        needed = min_free
        if pending >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer, self._start)
            if length <= self.max_record_size:
                needed = max(needed, HEADER.size + length - pending)
        if len(self._buffer) - self._end < needed:
            tail = self._view[self._start : self._end]
            if pending + needed > len(self._buffer):
                # Jump straight to room for several records of this size: growing by doubling
                # would compact (copy) on nearly every large record.
                size = max(2 * len(self._buffer), min(4 * (pending + needed), self._max_buffer), pending + needed)
                grown = bytearray(size)
                grown[:pending] = tail
                self._buffer, self._view = grown, memoryview(grown)
            else:
                # Assign through the memoryview: bytearray slice assignment from any object other
                # than a bytearray first copies it into a temporary bytearray (a fresh allocation
                # of up to a record, page faults included). Overlapping views are not promised
                # memmove semantics, so that rare case goes through one temporary copy.
                self._view[:pending] = tail if pending <= self._start else bytes(tail)
            self._start, self._end = 0, pending
        return self._view[self._end :]

    def take_buffered(self) -> bytes:
        """Remove and return the unconsumed bytes (hand-over from the handshake decoder)."""
        data = bytes(self._view[self._start : self._end])
        self._start = self._end = 0
        return data

    def commit(self, nbytes: int) -> None:
        self._end += nbytes

    def receive_data(self, data: bytes) -> None:
        """Copy ``data`` into the buffer (convenience for tests and handshakes)."""
        offset = 0
        while offset < len(data):
            view = self.writable(min_free=min(len(data) - offset, self._max_buffer // 2))
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
