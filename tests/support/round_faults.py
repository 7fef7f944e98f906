"""The faults a member of an all-reduce round can have, written once for the in-process tests
(``tests/averaging/test_allreduce.py``) and the lab's processes (``lab_allreduce_peer.py``, the
faults benchmark): each misbehaves at one point of the round through ``stream_faults.Fault``.

A death is ``Fault.die``: in process, the victim's host is cancelled; a lab process mixes in
``ProcessDeath`` and exits at once, so the kernel closes its sockets as when a process is killed.
"""

from __future__ import annotations

import math
import os
import signal
import struct
import sys
from typing import Any

import trio

from tests.support.stream_faults import Fault


def part_index(body: Any) -> int | None:
    return body.get("part") if isinstance(body, dict) else None


def with_nan(payload: Any) -> bytearray:
    """A copy of a float32 payload whose first value is NaN."""
    bad = bytearray(payload)
    bad[:4] = struct.pack("<f", math.nan)
    return bad


class DiesWhileSending(Fault):
    async def send(self, stream, body, payload):
        if stream.outgoing and part_index(body) == 2:
            await self.die()
        await super().send(stream, body, payload)


class StallsWhileSending(Fault):
    async def send(self, stream, body, payload):
        if stream.outgoing and part_index(body) == 1:
            await trio.sleep(math.inf)
        await super().send(stream, body, payload)


class FreezesWhileSending(Fault):
    """Stops its own process (SIGSTOP) after its first part, while the others stream to it; the
    test then kills it. A frozen process reads nothing, so the others' sends to it block."""

    async def send(self, stream, body, payload):
        if stream.outgoing and part_index(body) == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        await super().send(stream, body, payload)


class DiesWhileReducing(Fault):
    """Receives every contribution, then vanishes instead of replying."""

    async def send(self, stream, body, payload):
        if not stream.outgoing:
            await self.die()
        await super().send(stream, body, payload)


class DiesWhileReplying(Fault):
    """Sends the first part of its averaged shard back, then vanishes."""

    async def send(self, stream, body, payload):
        if not stream.outgoing and part_index(body) == 1:
            await self.die()
        await super().send(stream, body, payload)


class StallsWhileReducing(Fault):
    async def send(self, stream, body, payload):
        if not stream.outgoing:
            await trio.sleep(math.inf)
        await super().send(stream, body, payload)


class RepliesWithNaN(Fault):
    """Reduces honestly, but the first part of its averaged shard reaches the senders as NaN."""

    async def send(self, stream, body, payload):
        if not stream.outgoing and part_index(body) == 0:
            payload = with_nan(payload)
        await super().send(stream, body, payload)


class CancelsMidRound(Fault):
    """Cancels its own call of the round (``run_scope``) after its first part."""

    async def send(self, stream, body, payload):
        if stream.outgoing and part_index(body) == 1:
            self.run_scope.cancel()
        await super().send(stream, body, payload)


def exit_process() -> None:
    sys.stdout.flush()
    os._exit(17)


class ProcessDeath:
    """Mixed in before a fault: its death ends the process at once, with no goodbye."""

    async def die(self) -> None:
        exit_process()


def dying_as_a_process(fault: type[Fault]) -> type[Fault]:
    """``fault`` whose death is the process's (``ProcessDeath``)."""
    return type(fault.__name__, (ProcessDeath, fault), {})
