"""``--data-shard auto``: the choice rule driven with records (no I/O), and three peers that
choose together over a real DHT."""

from __future__ import annotations

import math

import trio

from averaging.progress import PeerProgress, ProgressTracker
from dht.node import DHTNode
from peer import Identity
from peerd.data_shards import MAX_AUTO_SHARDS, ShardChoice, choose_shard, claim_shard, overlap


def peer_ids(count: int):
    return [Identity.generate().peer_id for _ in range(count)]


def trained(index: int, count: int) -> PeerProgress:
    return PeerProgress(epoch=3, samples=100, samples_per_s=50.0, shard=(index, count))


def test_overlap_of_shards_with_different_counts():
    assert overlap((0, 2), (0, 4)) == 0.5  # 0/4 is half of 0/2
    assert overlap((1, 2), (0, 4)) == 0.0  # odd and even positions never meet
    assert overlap((0, 4), (0, 2)) == 1.0  # all of 0/4 lies in 0/2
    assert overlap((2, 3), (1, 4)) == 0.25  # coprime counts always meet, in 1/lcm = 1/12 of the data
    assert all(overlap((j, 5), (0, 1)) == 1.0 for j in range(5))  # the whole data covers any shard


def test_a_lone_peer_takes_all_the_data_and_a_newcomer_fills_the_gap():
    me, a, b, c = peer_ids(4)
    assert choose_shard(me, {})[0] == (0, 1)
    assert choose_shard(me, {a: trained(0, 4), b: trained(1, 4), c: trained(3, 4)})[0] == (2, 4)
    # Three peers that took thirds: the fourth splits into quarters and takes one no third covers
    # more than another (each quarter meets each third in 1/12 of the data): coverage ties at 1.
    shard, _ = choose_shard(me, {a: trained(0, 3), b: trained(1, 3), c: trained(2, 3)})
    assert shard[1] == 4


def test_a_peer_that_chose_halves_alone_gets_the_other_half_not_an_overlapping_third():
    me, bootstrap, first = peer_ids(3)
    # the first replica saw only the bootstrap (which trains everything) and took a half
    shard, _ = choose_shard(me, {bootstrap: trained(0, 1), first: trained(0, 2)})
    assert shard == (1, 2) and overlap(shard, (0, 2)) == 0.0
    # but an equally covered smaller count does not replace the live count
    shard, _ = choose_shard(me, {bootstrap: trained(0, 2), first: trained(1, 2)})
    assert shard[1] == 3


def test_the_count_follows_the_live_peers_up_to_the_cap():
    me, *others = peer_ids(MAX_AUTO_SHARDS + 5)
    records = {peer: trained(i % MAX_AUTO_SHARDS, MAX_AUTO_SHARDS) for i, peer in enumerate(others)}
    index, count = choose_shard(me, records)[0]
    assert count == MAX_AUTO_SHARDS
    # the least covered: the shards that only one of the 20 others trains
    assert index >= (len(others) % MAX_AUTO_SHARDS)


def test_peers_choosing_at_once_settle_on_different_shards_in_rank_order():
    peers = peer_ids(5)
    choices = {peer: ShardChoice(peer) for peer in peers}
    published: dict = {}
    for _ in range(max(choice.max_rounds for choice in choices.values())):
        view = dict(published)  # everyone reads the records of the last round, then publishes
        for peer, choice in choices.items():
            if not choice.done:
                shard = choice.update({p: r for p, r in view.items() if p != peer})
                published[peer] = PeerProgress(0, 0, 0.0, shard, choosing=not choice.done)
        if all(choice.done for choice in choices.values()):
            break
    assert all(choice.done and choice.rounds < choice.max_rounds for choice in choices.values())
    shards = [choice.shard for choice in choices.values()]
    assert sorted(shards) == [(i, 5) for i in range(5)], shards


def test_a_chooser_waits_for_the_final_claim_of_an_earlier_ranked_peer_whose_reads_are_slow():
    # The bootstrap trains 0/3. The earlier-ranked chooser first saw only the bootstrap and picked a
    # half; its next read is slow (the bootstrap stalled), so that half stays in its record. The
    # later one must not settle on the other half meanwhile: the earlier one, once it reads again,
    # counts that final half and keeps its own, and the two split the data the bootstrap trains too.
    bootstrap, first, later = ordered_choosers()
    first_guess = PeerProgress(0, 0, 0.0, (1, 2), choosing=True)
    choice = ShardChoice(later)
    view = {bootstrap: trained(0, 3), first: first_guess}
    assert choice.update(view) == (0, 2)  # the other half of a counted half: the best guess for now
    choice.update(view)
    assert not choice.done  # unchanged, but it counts a claim that is still a choice
    first_choice = ShardChoice(first)
    first_final = first_choice.update({bootstrap: trained(0, 3), later: PeerProgress(0, 0, 0.0, (0, 2), choosing=True)})
    assert first_final[1] == 3  # it does not count the later one's choice: a third
    view = {bootstrap: trained(0, 3), first: PeerProgress(0, 0, 0.0, first_final)}
    shard = choice.update(view)
    choice.update(view)
    assert choice.done and sorted([(0, 3), first_final, shard]) == [(0, 3), (1, 3), (2, 3)]


def ordered_choosers():
    """Three peer IDs: the bootstrap, then two choosers of which the first ranks before the second
    (each counts the choices of those ranking before it: ``choose_shard``'s counted claims)."""
    bootstrap, a, b = peer_ids(3)
    counted = choose_shard(b, {a: PeerProgress(0, 0, 0.0, (0, 1), choosing=True)})[1]
    return (bootstrap, a, b) if counted else (bootstrap, b, a)


def test_simultaneous_choosers_with_an_identical_view_spread_by_peer_id():
    # Ties go by a hash of the peer ID: twelve peers that all see the same three claims do not all
    # take the same free shard.
    a, b, c = peer_ids(3)
    records = {a: trained(0, 4), b: trained(1, 4), c: trained(2, 4)}
    picks = {choose_shard(me, {**records})[0] for me in peer_ids(12)}
    assert picks == {(3, 4)}  # only one is least covered: everyone takes it
    picks = {choose_shard(me, {})[0] for me in peer_ids(2)}
    assert picks == {(0, 1)}
    # With several equally free shards, the choices spread: of 60 peers, each picking one of three
    # shards by a hash, all pick the same two with probability 3 * (2/3)**60 < 1e-10 (with 12 it
    # was 2%, and this test failed that often).
    free = {a: trained(0, 1)}
    spread = {choose_shard(me, {**free, b: PeerProgress(0, 0, 0.0)})[0] for me in peer_ids(60)}
    assert len(spread) == 3


def test_a_malformed_shard_claim_is_ignored_but_the_record_counts():
    for bad in ([5, 3], [-1, 2], [0, 0], "0/2", [0, 2, 1], [0.0, 2], [0, 1 << 40]):
        record = PeerProgress.from_wire({"epoch": 1, "samples": 5, "sps": 1.0, "shard": bad})
        assert record.shard is None and record.samples == 5
    record = PeerProgress.from_wire({"epoch": 1, "samples": 5, "sps": 1.0, "shard": [1, 2], "choosing": 1})
    assert record.shard == (1, 2) and not record.choosing  # only a literal true means choosing
    assert PeerProgress.from_wire(PeerProgress(0, 0, 0.0, (1, 2), choosing=True).to_wire()).choosing


async def run_node(initial, task_status=trio.TASK_STATUS_IGNORED):
    async with DHTNode.open(initial_peers=initial) as node:
        task_status.started(node)
        await trio.sleep(math.inf)


async def test_three_peers_started_together_pick_different_shards():
    async with trio.open_nursery() as nursery:
        bootstrap = await nursery.start(run_node, [])
        nodes = [await nursery.start(run_node, [bootstrap.address]) for _ in range(3)]
        shards: dict[int, tuple[int, int]] = {}

        async def choose(index: int) -> None:
            tracker = ProgressTracker(nodes[index], "run.digits")
            shards[index] = await claim_shard(tracker, settle=0.2)

        with trio.fail_after(20):
            async with trio.open_nursery() as choosers:
                for index in range(3):
                    choosers.start_soon(choose, index)
        assert sorted(shards.values()) == [(0, 3), (1, 3), (2, 3)], shards
        # The final claims are in the records, no longer marked as choosing: a late joiner counts
        # them and takes a quarter that splits one of the thirds.
        late = await nursery.start(run_node, [bootstrap.address])
        records = await ProgressTracker(late, "run.digits").records()
        assert {r.shard for r in records.values()} == set(shards.values())
        assert not any(r.choosing for r in records.values())
        assert choose_shard(late.host.peer_id, records)[0][1] == 4
        nursery.cancel_scope.cancel()


async def test_newcomers_count_a_given_shard_claimed_before_its_data_loads():
    """``peerd swarm``'s bootstrap trains ``--data-shard 0/3``; two peers choosing while its data
    still loaded (before its trainer's first progress record) took the halves, one overlapping it."""
    from peerd.data_shards import publish_claim

    async with trio.open_nursery() as nursery:
        bootstrap = await nursery.start(run_node, [])
        nodes = [await nursery.start(run_node, [bootstrap.address]) for _ in range(2)]
        await publish_claim(ProgressTracker(bootstrap, "run.digits"), (0, 3))
        shards: dict[int, tuple[int, int]] = {}

        async def choose(index: int) -> None:
            shards[index] = await claim_shard(ProgressTracker(nodes[index], "run.digits"), settle=0.2)

        with trio.fail_after(20):
            async with trio.open_nursery() as choosers:
                for index in range(2):
                    choosers.start_soon(choose, index)
        assert sorted(shards.values()) == [(1, 3), (2, 3)], shards
        nursery.cancel_scope.cancel()


def test_a_shard_setting_with_digits_int_cannot_read_is_refused_not_a_crash():
    """``str.isdigit`` accepts superscripts that ``int`` refuses: the setting's value must still get
    the named error (``SettingsError``), not a traceback out of ``join``."""
    import argparse

    import pytest

    from peerd.join_arguments import data_shard, data_shard_from_args
    from peerd.settings import SettingsError

    for text in ("\u00b2/3", "0/\u00b3", "1/2\u00b9"):
        with pytest.raises(argparse.ArgumentTypeError):
            data_shard(text)
        args = argparse.Namespace(data_shard=None, data_shard_setting=(text, "PEERD_DATA_SHARD"))
        with pytest.raises(SettingsError, match="PEERD_DATA_SHARD"):
            data_shard_from_args(args)


class _RecordingTracker:
    """A tracker with no DHT: no other peers, and every published record with its (virtual) time."""

    def __init__(self) -> None:
        self.me = Identity.generate().peer_id
        self.data_shard = None
        self.published: list[tuple[float, PeerProgress]] = []

    async def records(self) -> dict:
        return {}

    async def publish(self, progress: PeerProgress) -> None:
        self.published.append((trio.current_time(), progress))


async def test_a_claim_is_held_while_the_data_loads_longer_than_a_record_lives(autojump_clock):
    """A task whose data takes a minute to load: its final claim is stored again often enough that
    it never lapses (a newcomer choosing meanwhile counts it), until the hold is cancelled."""
    from averaging.progress import PROGRESS_TTL
    from peerd.data_shards import hold_claim

    tracker = _RecordingTracker()
    shard = await claim_shard(tracker, settle=0.5)
    claimed = len(tracker.published)
    with trio.move_on_after(60):
        await hold_claim(tracker, shard)
    held = tracker.published[claimed - 1 :]
    times = [t for t, _ in held]
    assert all(later - earlier < PROGRESS_TTL for earlier, later in zip(times, times[1:], strict=False))
    assert trio.current_time() - times[-1] < PROGRESS_TTL
    assert all(p.shard == shard and not p.choosing and p.samples == 0 for _, p in held)
