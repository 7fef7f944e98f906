"""The reading side of an RPC connection: records in, ``RPCProtocol`` events out.

``RecordReader`` decrypts what the secure channel receives, feeds headers and payloads to the
connection's protocol object and hands the events (and the protocol's own refusals) to the
connection. It owns the deadlines that only reading knows: a message that stops arriving half-way,
and a record buffer given back once the connection goes quiet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from .framing import AEAD_TAG_SIZE, HEADER, ProtocolError
from .rpc_outgoing import TrafficCounter
from .rpc_protocol import RPCProtocol
from .secure_channel import SecureChannel

log = logging.getLogger("peerd.rpc")

__all__ = ["IDLE_BUFFER_RELEASE", "READ_BUDGET", "RECORD_COST", "STALLED_MESSAGE_TIMEOUT", "RecordReader"]

# The reader lets other tasks run after this much work, counting each record as its bytes plus a
# fixed cost: a bulk stream yields once per MiB, a flood of tiny records once per 64 records
# (a per-byte budget alone let 24-byte records hold the loop for ~0.5 s).
READ_BUDGET = 1 << 20
RECORD_COST = READ_BUDGET // 64
# A record or payload that has begun must keep arriving: with no progress for this long the
# connection is dropped with its partial message. 30 s outlasts five lost segments in a row on a
# healthy path (TCP's retransmission timeout doubles from 1 s: 1 + 2 + 4 + 8 + 16 s) and a
# volunteer's brief Wi-Fi dropout, and an honest sender is never blocked mid-message by us (credit
# was granted first). Progress, not an average rate over the whole message: a slow uplink shared
# by many flows (a donor serving downloads during an all-reduce) is slow, not stalled, and what a
# trickling sender can hold meanwhile is bounded by the receive budget and per-connection caps.
STALLED_MESSAGE_TIMEOUT = 30.0
# A connection that has been quiet this long returns its 1 MiB record buffer to the OS: bulk streams
# pause far less than a second between messages, so only connections between rounds pay one
# re-allocation (an mmap) for their next large record.
IDLE_BUFFER_RELEASE = 1.0


class RecordReader:
    """Reads one connection's records until the peer closes it (``run`` returns) or breaks the
    protocol (``ProtocolError``)."""

    def __init__(
        self,
        channel: SecureChannel,
        protocol: RPCProtocol,
        traffic: TrafficCounter,
        *,
        on_event: Callable[[Any], None],
        on_refusal: Callable[[bytes], None],
        payload_buffer: Callable[[int, Any, int], Any],
    ):
        """``on_event(event)`` for each protocol event; ``on_refusal(header)`` for a header the
        protocol wants sent back (a call over the limits); ``payload_buffer(call_id, body,
        nbytes)``: where an announced stream payload should go (None: a fresh buffer)."""
        self.channel = channel
        self.protocol = protocol
        self.traffic = traffic
        self.on_event = on_event
        self.on_refusal = on_refusal
        self.payload_buffer = payload_buffer

    async def run(self) -> None:
        channel, protocol = self.channel, self.protocol
        decoder, open_record, open_into = channel.decoder, channel.open, channel.open_into
        budget = READ_BUDGET
        while True:
            while (record := decoder.next_record()) is not None:
                self.traffic.bytes_received += len(record) + HEADER.size
                budget -= len(record) + RECORD_COST
                if protocol.awaiting_payload:
                    if protocol.payload_fits_record(len(record) - AEAD_TAG_SIZE):
                        # The whole payload in one record and nowhere in particular to put it: let
                        # the AEAD allocate the plaintext (one allocation, no buffer to fill).
                        events = protocol.payload_whole(open_record(record))
                    else:
                        target = protocol.payload_target(len(record) - AEAD_TAG_SIZE)
                        events = protocol.payload_received(open_into(record, target))
                        del target  # a fresh payload buffer may have to grow for the next record
                else:
                    events = protocol.receive_header(open_record(record))
                    if protocol.awaiting_payload:
                        if protocol.announced_data is not None:
                            self._supply_payload_buffer(*protocol.announced_data)
                for header in protocol.take_outbox():
                    self.on_refusal(header)
                for event in events:
                    self.on_event(event)
                if budget <= 0:
                    budget = READ_BUDGET
                    await trio.lowlevel.cancel_shielded_checkpoint()
            if protocol.awaiting_payload or decoder.buffered or decoder.holds_spare_buffer:
                more = await self._fill()
            else:  # between messages, as most reads start: no deadline, nothing to release
                more = await channel.fill()
            if not more:
                return

    async def _fill(self) -> bool:
        """Receive more bytes, within the deadline of any message in progress; give the record
        buffer back when the connection goes quiet between messages."""
        channel, decoder = self.channel, self.channel.decoder
        if self.protocol.awaiting_payload or decoder.buffered:
            try:
                return await channel.fill(STALLED_MESSAGE_TIMEOUT)
            except trio.TooSlowError:
                raise ProtocolError(
                    f"a message stalled mid-way (no progress for {STALLED_MESSAGE_TIMEOUT:g} s)"
                ) from None
        if decoder.holds_spare_buffer:
            try:
                return await channel.fill(IDLE_BUFFER_RELEASE)
            except trio.TooSlowError:
                decoder.release()
        return await channel.fill()

    def _supply_payload_buffer(self, call_id: int, body: Any) -> None:
        try:
            buffer = self.payload_buffer(call_id, body, self.protocol.payload_remaining)
            if buffer is not None:
                self.protocol.supply_payload_buffer(buffer)
        except Exception as error:  # the application's bug: it costs a copy, not the connection
            log.warning("a stream's buffer provider failed (%r); using a fresh buffer", error)
