"""How long a matchmaking peer lets declarations spread before it reads them (``averaging/settling.py``)."""

from __future__ import annotations

import pytest
import trio

from averaging.gathering import Declaration
from averaging.group import AveragingMode
from averaging.settling import DEFAULT_SETTLE, EARLY_SETTLE_VIEW, SETTLE_READS, settle
from peer import Identity, PeerID


def declared(peer: PeerID, round_number: int) -> Declaration:
    return Declaration(peer, None, 1.0, AveragingMode.NODE, "s", round_number)


async def test_a_peer_waits_as_long_as_its_store_took_within_a_quarter_of_the_deadline(autojump_clock):
    me = declared(Identity.generate().peer_id, 3)

    async def read() -> dict:
        raise AssertionError("a peer with no last view reads nothing while it settles")

    for stored_in, timeout, waited in (
        (0.1, 30.0, DEFAULT_SETTLE),
        (2.0, 30.0, 2.0),
        (20.0, 30.0, 7.5),
        (0.1, 1.0, 0.25),
    ):
        began = trio.current_time()
        waits = {"settle_time": None, "timeout": timeout, "stored_in": stored_in}
        assert await settle(me, read, frozenset(), trio.Event(), **waits) is None
        assert trio.current_time() - began == pytest.approx(waited)


async def test_a_join_waiting_for_our_choice_ends_the_settle_in_a_large_swarm(autojump_clock):
    me = declared(Identity.generate().peer_id, 3)
    last_view = frozenset(Identity.generate().peer_id for _ in range(EARLY_SETTLE_VIEW))
    asked = trio.Event()

    async def read() -> dict:
        raise AssertionError("a large swarm's peer does not poll the declarations")

    async with trio.open_nursery() as nursery:
        began = trio.current_time()

        async def ask_later() -> None:
            await trio.sleep(0.3)
            asked.set()

        nursery.start_soon(ask_later)
        assert await settle(me, read, last_view, asked, settle_time=None, timeout=30.0, stored_in=5.0) is None
        assert trio.current_time() - began == pytest.approx(0.3)


async def test_a_small_swarm_reads_until_everyone_of_the_last_view_declared_the_round(autojump_clock):
    me = declared(Identity.generate().peer_id, 3)
    others = [Identity.generate().peer_id for _ in range(3)]
    reads: list[float] = []

    async def read() -> dict:
        reads.append(trio.current_time())
        declared_now = others if len(reads) >= 3 else others[:2]  # (the third lands on the third read)
        return {me.peer_id: me, **{peer: declared(peer, 3) for peer in declared_now}}

    began = trio.current_time()
    view = await settle(me, read, frozenset(others), trio.Event(), settle_time=2.0, timeout=30.0, stored_in=0.1)
    assert view is not None and set(others) <= set(view)
    assert len(reads) == 3 and trio.current_time() - began < 2.0


async def test_a_small_swarm_whose_last_view_never_completes_waits_out_the_settle(autojump_clock):
    me = declared(Identity.generate().peer_id, 3)
    gone = Identity.generate().peer_id  # (in the last view; it left, and never declares again)
    reads: list[float] = []

    async def read() -> dict:
        reads.append(trio.current_time())
        return {me.peer_id: me}

    began = trio.current_time()
    assert await settle(me, read, frozenset({gone}), trio.Event(), settle_time=1.0, timeout=30.0, stored_in=0.1) is None
    assert trio.current_time() - began == pytest.approx(1.0)
    assert 1 <= len(reads) <= SETTLE_READS
