"""The send queue (``peer/rpc_outgoing.py``): its fast path (a message written by its sender while the
writer is idle) and its reply budgets (what a peer that does not read its answers makes us hold).
Driven against a scripted channel whose kernel takes as many bytes as a test says, so partial writes
happen exactly where wanted; the bytes it receives are decrypted in order."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

import peer.rpc_outgoing
from peer import Identity, Router, open_peer_host
from peer.framing import RecordDecoder
from peer.record_cipher import TransportCipher
from peer.rpc_outgoing import RepliesUnread, ReplyBudget, SendQueue, TrafficCounter


class ScriptedChannel:
    """What SendQueue needs of a SecureChannel. ``send_now`` takes at most ``kernel_room`` bytes (all
    if None); ``send_all`` blocks while ``blocked`` is set (a peer that stopped reading)."""

    can_send_now = True

    def __init__(self) -> None:
        key = os.urandom(32)
        self._send_cipher = TransportCipher(key)
        self._receive_cipher = TransportCipher(key)
        self._decoder = RecordDecoder()
        self._messages: list[bytes] = []
        self.kernel_room: int | None = None
        self.blocked = False
        self.unblocked = trio.Event()
        self.direct_writes = 0

    def seal_into(self, plaintext, out: memoryview) -> int:
        return self._send_cipher.seal_into(plaintext, out)

    def send_now(self, data: memoryview) -> int:
        taken = len(data) if self.kernel_room is None else min(self.kernel_room, len(data))
        self.direct_writes += 1
        self._receive(data[:taken])
        return taken

    async def send_all(self, data: memoryview) -> None:
        while self.blocked:
            await self.unblocked.wait()
        self._receive(data)
        await trio.lowlevel.checkpoint()

    def _receive(self, data: memoryview) -> None:
        self._decoder.receive_data(bytes(data))
        while (record := self._decoder.next_record()) is not None:
            self._messages.append(self._receive_cipher.open(record))

    def received(self) -> list[bytes]:
        """The messages that arrived whole since the last call, in order."""
        messages, self._messages = self._messages, []
        return messages


async def settle() -> None:
    for _ in range(10):
        await trio.lowlevel.checkpoint()


async def test_a_fast_send_that_the_kernel_takes_in_part_keeps_every_message_in_order():
    channel = ScriptedChannel()
    queue = SendQueue(channel, TrafficCounter())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.write_loop)
        await settle()
        queue.append(b"first", direct=True)  # the writer is idle: written at once, whole
        assert channel.direct_writes == 1 and channel.received() == [b"first"]
        channel.kernel_room = 10  # the socket buffer is nearly full: part of the next one fits
        queue.append(b"second" * 10, direct=True)
        queue.append(b"third", direct=True)  # something is queued ahead: no fast path
        queue.append(b"fourth")
        assert channel.direct_writes == 2
        channel.kernel_room = None
        await settle()
        assert channel.received() == [b"second" * 10, b"third", b"fourth"]
        queue.append(b"fifth", direct=True)  # idle again: fast again
        assert channel.direct_writes == 3 and channel.received() == [b"fifth"]
        nursery.cancel_scope.cancel()


async def test_concurrent_senders_keep_their_order_whichever_path_each_takes():
    channel = ScriptedChannel()
    channel.kernel_room = 7  # every fast send is cut short: its tail queues ahead of the rest
    queue = SendQueue(channel, TrafficCounter())
    sent: list[bytes] = []

    async def sender(name: int) -> None:
        pauses = random.Random(name)
        for i in range(20):
            message = f"{name}:{i}".encode() * (1 + i % 3)
            sent.append(message)  # the order in which the queue is handed the messages
            queue.append(message, direct=i % 2 == 0)
            for _ in range(pauses.randrange(12)):  # sometimes long enough for the writer to idle
                await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.write_loop)
        async with trio.open_nursery() as senders:
            for name in range(5):
                senders.start_soon(sender, name)
        await settle()
        nursery.cancel_scope.cancel()
    assert channel.direct_writes > 0
    assert channel.received() == sent  # decrypts in order: records sealed in the order they went out


async def test_an_empty_payload_adds_no_record_on_either_path():
    # Its header announces 0 payload bytes, so the receiver takes the next record for a header: an
    # empty record there is undecodable and fails the connection.
    channel = ScriptedChannel()
    queue = SendQueue(channel, TrafficCounter())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.write_loop)
        await settle()
        fast, queued = trio.Event(), trio.Event()
        queue.append(b"fast", memoryview(b""), fast, direct=True)  # the writer is idle: fast path
        assert queue.append_result(b"reply", memoryview(b""), direct=True)
        assert channel.direct_writes == 2 and fast.is_set()
        queue.append(b"queued", memoryview(b""), queued)  # through the writer
        assert queue.append_result(b"queued reply", memoryview(b""))
        with trio.fail_after(5):
            await queued.wait()
        await settle()
        assert channel.received() == [b"fast", b"reply", b"queued", b"queued reply"]
        nursery.cancel_scope.cancel()


async def test_a_fast_send_cut_off_by_a_dying_connection_is_reported_only_on_release():
    """The tail the kernel did not take is the sender's message too: its ``encrypted`` event must
    not say "gone out" until the tail has, so a connection that dies first fails the send."""
    channel = ScriptedChannel()
    queue = SendQueue(channel, TrafficCounter())
    encrypted = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.write_loop)
        await settle()
        channel.kernel_room, channel.blocked = 10, True  # the peer stopped reading
        queue.append(b"header", memoryview(bytes(1000)), encrypted, direct=True)
        await settle()
        assert not encrypted.is_set()  # the writer is stuck sending the tail
        nursery.cancel_scope.cancel()  # the connection dies
    assert not encrypted.is_set()
    queue.release()  # after the connection has recorded its error, as Connection.run does
    assert encrypted.is_set()


async def test_a_fast_send_whose_tail_goes_out_sets_its_event_then():
    channel = ScriptedChannel()
    queue = SendQueue(channel, TrafficCounter())
    encrypted = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.write_loop)
        await settle()
        channel.kernel_room = 10
        queue.append(b"header", memoryview(bytes(1000)), encrypted, direct=True)
        with trio.fail_after(5):
            await encrypted.wait()
        assert channel.received() == [b"header", bytes(1000)]
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def echo_connection() -> AsyncIterator:
    """A client's connection to a server whose ``echo`` method returns what it is sent."""
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return request.body

    async with (
        open_peer_host(Identity.generate(), router=router) as server,
        open_peer_host(Identity.generate(), listen=None) as client,
    ):
        yield await client.connect(server.listen_address)


async def test_only_a_lone_call_is_written_by_its_caller():
    """Sequential calls skip the writer; a burst of concurrent calls goes through it in batches (one
    syscall per message there cost ~35% more CPU per call)."""
    async with echo_connection() as connection:
        writes = 0
        send_now = connection.channel.send_now

        def counting(data: memoryview) -> int:
            nonlocal writes
            writes += 1
            return send_now(data)

        assert (await connection.call("echo", "the writer has started", timeout=5)).body
        connection.channel.send_now = counting
        for i in range(20):
            assert (await connection.call("echo", i, timeout=5)).body == i
        assert writes == 20

        async def call(i: int) -> None:
            assert (await connection.call("echo", i, timeout=5)).body == i

        writes = 0
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(call, i)
        assert writes <= 2  # at most the first of the burst, and the last stragglers


async def test_link_progress_counts_what_the_fast_path_sent():
    # The all-reduce's deadlines read link_progress; bytes a lone call wrote itself count too.
    async with echo_connection() as connection:
        await connection.call("echo", "warm", timeout=5)
        before_delivered, _ = connection.link_progress()
        before_sent = connection.traffic.bytes_sent
        for _ in range(50):
            await connection.call("echo", "x" * 1000, timeout=5)  # each alone: the fast path
        sent = connection.traffic.bytes_sent - before_sent
        assert sent > 50_000
        with trio.fail_after(5):  # until the kernel has seen the ACKs of what was sent
            while connection.link_progress()[0] - before_delivered < sent:
                await trio.sleep(0.01)


# ---------------------------------------------------------------------- reply budgets
KIB = 1 << 10


async def test_results_for_a_peer_that_does_not_read_stop_at_its_budget(monkeypatch):
    """Every result was queued until 272 MiB were unread (the issue's 40 unread 15 MiB DHT answers
    held +300 MB); now a result that does not fit is not queued, and the caller refuses instead."""
    result = memoryview(bytes(30 * KIB))
    monkeypatch.setattr(peer.rpc_outgoing, "REPLY_BUDGET_PER_CONNECTION", 3 * (len(b"result") + len(result)))
    channel, budget = ScriptedChannel(), ReplyBudget(limit=1 << 30)
    channel.blocked = True  # the peer stopped reading
    queue = SendQueue(channel, TrafficCounter(), budget)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.write_loop)
        admitted = []
        for _ in range(40):
            await settle()
            admitted.append(queue.append_result(b"result", result))
        # The first is being written (the writer waits on the socket with it) and still counts,
        # as it holds its payload until it is out; two more went into the queue, none after them.
        assert admitted == [True] * 3 + [False] * 37
        assert queue.backlogged and budget.used == queue.queued_results == 3 * (6 + 30 * KIB)
        channel.blocked = False  # the peer reads: what was queued goes out and stops counting
        channel.unblocked.set()
        await settle()
        assert budget.used == 0 and not queue.backlogged
        assert queue.append_result(b"result", result)
        nursery.cancel_scope.cancel()


async def test_one_result_larger_than_the_budget_is_queued_while_nothing_else_is(monkeypatch):
    monkeypatch.setattr(peer.rpc_outgoing, "REPLY_BUDGET_PER_CONNECTION", 10 * KIB)
    channel, budget = ScriptedChannel(), ReplyBudget(limit=20 * KIB)
    channel.blocked = True
    queue = SendQueue(channel, TrafficCounter(), budget)  # (no writer: nothing leaves the queue)
    assert queue.append_result(b"big", memoryview(bytes(50 * KIB)))  # alone: never refused for its size
    assert not queue.append_result(b"small", memoryview(bytes(KIB)))
    other = SendQueue(ScriptedChannel(), TrafficCounter(), budget)  # another peer's connection
    assert not other.append_result(b"small", memoryview(bytes(KIB)))  # the process-wide total is full
    queue.release()  # the connection is gone: what it held goes back to the total
    assert budget.used == 0 and other.append_result(b"small", memoryview(bytes(KIB)))


async def test_errors_for_a_peer_that_reads_nothing_close_it_past_their_room(monkeypatch):
    monkeypatch.setattr(peer.rpc_outgoing, "ERROR_ROOM", 10 * KIB)
    queue = SendQueue(ScriptedChannel(), TrafficCounter(), ReplyBudget())
    for _ in range(10):
        queue.append_error(b"e" * KIB)
    with pytest.raises(RepliesUnread):
        queue.append_error(b"e" * KIB)
