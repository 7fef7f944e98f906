"""All-reduce deadlines that follow the bytes, between in-process peers on 127.0.0.1: a slow but
live sender keeps its place, one that stops is dropped one stall interval after its last byte, one
that died before sending is dropped at once, and a round measures this peer's link."""

from __future__ import annotations

import math

import torch
import trio
import trio.testing

from averaging.allreduce import RoundSettings
from averaging.group import AveragingMode
from averaging.link_speed import DeadlineRules
from averaging.partition import DEFAULT_PART_SIZE, AllReducePlan
from tests.averaging.test_allreduce import PART_SIZE, flat, make_group, random_tensors, start_peers
from tests.support.stream_faults import Fault

# Short enough to keep these tests quick, long enough for a loaded 2-core machine to schedule
# every peer of a round well within it.
STALL = 0.6
RULES = DeadlineRules(stall=STALL, slack=2.0)


class SendsSlowly(Fault):
    """Takes its time over every part it sends, but keeps sending."""

    async def send(self, stream, body, payload):
        if stream.outgoing and isinstance(body, dict) and "part" in body:
            await trio.sleep(STALL / 3)
        await super().send(stream, body, payload)


class StopsSending(Fault):
    """Sends its first part, then nothing more, without closing anything."""

    async def send(self, stream, body, payload):
        if stream.outgoing and isinstance(body, dict) and body.get("part", 0) >= 1:
            await trio.sleep_forever()
        await super().send(stream, body, payload)


def expected_average(tensors, part_contributors, plan, index) -> torch.Tensor:
    """Per part of each averaged shard (``part_contributors``: shard -> per part, the indices of
    its contributors), the average of those contributors' values; elsewhere peer ``index``'s own."""
    expected = flat(tensors[index]).clone()
    for shard, parts in part_contributors.items():
        for (start, end), contributors in zip(plan.parts(shard), parts, strict=True):
            expected[start:end] = sum(flat(tensors[c])[start:end] for c in contributors) / len(contributors)
    return expected


def every_part(plan, shards: dict[int, list[int]]) -> dict[int, list[list[int]]]:
    return {shard: [contributors] * plan.num_parts(shard) for shard, contributors in shards.items()}


async def run_all(peers, group, tensors, indices, **options) -> dict:
    results, times = {}, {}

    async def one(i: int) -> None:
        start = trio.current_time()
        settings = RoundSettings(**{"part_size": PART_SIZE, **options})
        results[i] = await peers[i].service.run(group, tensors[i], settings=settings)
        times[i] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        for i in indices:
            nursery.start_soon(one, i)
    return results, times


async def test_a_slow_sender_that_keeps_delivering_keeps_its_place():
    """Peer 2 needs several stall intervals for its parts, delivering one every third of one: no
    fixed deadline of that length would keep it, the progress-driven one does."""
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3, faults={2: SendsSlowly()})
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(3)]
        results, times = await run_all(peers, group, tensors, range(3), deadlines=RULES)
        plan = AllReducePlan.build(flat(tensors[0]).numel(), [1.0] * 3, PART_SIZE)
        assert max(plan.num_parts(i) for i in range(3)) * STALL / 3 > 2 * STALL  # it did take long
        expected = sum(flat(t) for t in tensors) / 3
        for i in (0, 1):
            assert not results[i].failed_peers, results[i]
            assert torch_close(flat(tensors[i]), expected)
        nursery.cancel_scope.cancel()


async def test_a_sender_that_stops_is_dropped_one_stall_interval_after_its_last_byte():
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3, faults={2: StopsSending()})
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(3)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        results, times = await run_all(peers, group, tensors, range(3), deadlines=RULES)
        nursery.cancel_scope.cancel()
    plan = AllReducePlan.build(flat(tensors[0]).numel(), [1.0] * 3, PART_SIZE)
    for i in (0, 1):
        assert peers[2].host.peer_id in results[i].failed_peers
        assert times[i] < STALL + 1.0, times  # not the slack or the cap
        ids = [peer.host.peer_id for peer in peers]
        contributors = {s: sorted(ids.index(p) for p in c) for s, c in results[i].contributors.items()}
        assert contributors[0] == contributors[1] == [0, 1]  # the healthy reducers dropped peer 2
        # ... after its first part was averaged with the others': it is in that part, in no other
        parts = {
            s: [sorted(ids.index(p) for p in c) for c in by_part] for s, by_part in results[i].part_contributors.items()
        }
        assert parts[0] == parts[1] == [[0, 1, 2]] + [[0, 1]] * (plan.num_parts(0) - 1)
        assert torch_close(flat(tensors[i]), expected_average(originals, parts, plan, i))


class SendsLateThenFallsSilent(Fault):
    """Its first part goes out ``delay`` seconds late, then nothing more, nothing closed: a
    machine switched off mid-round, as far as its partners can tell."""

    def __init__(self, delay: float):
        self.delay = delay

    async def send(self, stream, body, payload):
        if stream.outgoing and isinstance(body, dict) and "part" in body:
            await trio.sleep(self.delay if body["part"] == 0 else math.inf)
        await super().send(stream, body, payload)


async def test_senders_outwait_a_reducer_that_waits_for_a_silent_sender():
    """A reducer answers once every sender still in the round has delivered, and gives up on a
    silent one only at its deadline for that sender, counted from when the reducer itself heard
    of the round; the senders waiting for its answers must outwait that, whatever their own start.
    (Their wait was capped at the same slack: on the simulated internet a group member whose
    machine went off mid-round made the members that heard of the group first give up on every
    reducer that heard of it later, and their whole round failed.) Peer 3 hears of the round
    0.2 s after the others; peer 2, a client, sends its first part and falls silent."""
    rules = DeadlineRules(stall=1.0, slack=1.0)
    modes = [AveragingMode.NODE, AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.NODE]
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 4, faults={2: SendsLateThenFallsSilent(0.3)}, client_indices=(2,))
        group = make_group(peers, modes=modes)
        tensors = [random_tensors(i) for i in range(4)]
        results: dict = {}

        async def one(i: int) -> None:
            await trio.sleep(0.2 if i == 3 else 0.0)
            settings = RoundSettings(part_size=PART_SIZE, deadlines=rules)
            results[i] = await peers[i].service.run(group, tensors[i], settings=settings)

        async with trio.open_nursery() as round_:
            for i in range(4):
                round_.start_soon(one, i)
        nursery.cancel_scope.cancel()
    for i in (0, 1, 3):
        assert peers[2].host.peer_id in results[i].failed_peers
        assert not results[i].local_shards, (i, results[i].local_shards)


async def test_a_sender_that_died_before_sending_is_dropped_at_once():
    """Peer 2's process is gone before the round: dialing it is refused, and that is enough to
    drop it as a sender too, instead of waiting for its first byte (or a fixed deadline)."""
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3)
        group = make_group(peers)
        peers[2].scope.cancel()
        await trio.testing.wait_all_tasks_blocked()  # its listener is closed
        tensors = [random_tensors(i) for i in range(3)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        results, times = await run_all(peers, group, tensors, (0, 1), sender_timeout=5.0)
        nursery.cancel_scope.cancel()
    plan = AllReducePlan.build(flat(tensors[0]).numel(), [1.0] * 3, PART_SIZE)
    for i in (0, 1):
        assert times[i] < 1.0, f"a dead sender was noticed only after {times[i]:.1f} s"
        assert peers[2].host.peer_id in results[i].failed_peers
        assert list(results[i].local_shards) == [2]  # its shard: the dead peer reduced it
        assert torch_close(
            flat(tensors[i]), expected_average(originals, every_part(plan, {0: [0, 1], 1: [0, 1]}), plan, i)
        )


async def test_a_round_measures_this_peers_link():
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 2)
        group = make_group(peers)
        tensors = [[torch.randn(1 << 20)] for _ in range(2)]  # 4 MiB each: enough to measure
        results, _ = await run_all(peers, group, tensors, (0, 1), part_size=DEFAULT_PART_SIZE)
        small, _ = await run_all(peers, make_group(peers), [random_tensors(i) for i in range(2)], (0, 1))
        nursery.cancel_scope.cancel()
    for i in (0, 1):
        assert results[i].link_rate is not None and results[i].link_rate > 10e6  # loopback: fast
        assert results[i].plan is not None and results[i].seconds > 0
        assert small[i].link_rate is None  # a few hundred values say nothing about the link


def torch_close(actual, expected) -> bool:
    return torch.allclose(actual, expected, atol=1e-6)


class HoldsBackItsLastPart(Fault):
    """Sends every part but the last one of each shard at once; that one only once released."""

    def __init__(self, last: int):
        self.last = last
        self.release = trio.Event()

    async def send(self, stream, body, payload):
        if stream.outgoing and isinstance(body, dict) and body.get("part") == self.last:
            await self.release.wait()
        await super().send(stream, body, payload)


class NotesReplies(Fault):
    """Notes every averaged part that reaches this peer as a sender from ``reducer``."""

    def __init__(self, wanted: int):
        self.reducer = None
        self.replies: list[int] = []
        self.wanted = wanted
        self.enough = trio.Event()  # ``wanted`` replies have arrived

    async def receive(self, stream):
        message = await super().receive(stream)
        if stream.outgoing and stream.peer == self.reducer and isinstance(message.body, dict):
            self.replies.append(message.body.get("part"))
            if len(self.replies) >= self.wanted:
                self.enough.set()
        return message


async def test_averaged_parts_flow_back_while_a_slow_sender_still_holds_back_its_last_part():
    """Part by part: a reducer answers each part as soon as every sender has delivered it, so
    peer 0 gets the averages of every part but the last of peer 1's shard while peer 2 still
    holds back its last part, and the rest once peer 2 sends it."""
    plan = AllReducePlan.build(flat(random_tensors(0)).numel(), [1.0] * 3, PART_SIZE)
    last = plan.num_parts(1) - 1
    assert last >= 2 and len({plan.num_parts(i) for i in range(3)}) == 1
    notes, holds_back = NotesReplies(wanted=last), HoldsBackItsLastPart(last)
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3, faults={0: notes, 2: holds_back})
        group = make_group(peers)
        notes.reducer = peers[1].host.peer_id
        tensors = [random_tensors(i) for i in range(3)]
        expected = sum(flat(t) for t in tensors) / 3
        results: dict = {}

        async def release_once_the_first_parts_are_back() -> None:
            with trio.fail_after(10):
                await notes.enough.wait()
            assert notes.replies == list(range(last))  # in order, all but the one peer 2 holds back
            assert not results, "the round ended before peer 2 sent its last part"
            holds_back.release.set()

        nursery.start_soon(release_once_the_first_parts_are_back)
        results, _times = await run_all(peers, group, tensors, range(3))
        nursery.cancel_scope.cancel()
    assert holds_back.release.is_set()
    for i in range(3):
        assert results[i].succeeded, results[i]
        assert torch_close(flat(tensors[i]), expected)


class HoldsItsPartsBack(Fault):
    """Sends each stream's header, then holds its parts back for longer than a stall interval
    (a reducer drops it), then sends them: a sender whose process was not scheduled for a while."""

    def __init__(self, pause: float):
        self.pause = pause

    async def send(self, stream, body, payload):
        if stream.outgoing and isinstance(body, dict) and body.get("part") == 0:
            await trio.sleep(self.pause)
        await super().send(stream, body, payload)


async def test_a_sender_dropped_for_lateness_takes_the_averages_and_bans_no_honest_reducer():
    """Reducers that drop a late sender say so in the contributors they name. The late sender's
    checks take that as the open outcome it is (every reducer left it out: it was late), not as
    a lie, and it takes their averages as the others do. (Its checks banned both honest reducers
    for ten minutes, "it left our contribution out", and split the swarm.) The late peer itself
    waits patiently for the reducers' replies, so that it does receive and check both."""
    async with trio.open_nursery() as nursery:
        peers = await start_peers(nursery, 3, faults={2: HoldsItsPartsBack(3 * STALL)})
        group = make_group(peers)
        tensors = [random_tensors(i) for i in range(3)]
        results: dict = {}

        async def one(i: int, rules: DeadlineRules) -> None:
            settings = RoundSettings(part_size=PART_SIZE, deadlines=rules, aggregation="centered-clip")
            results[i] = await peers[i].service.run(group, tensors[i], settings=settings)

        async with trio.open_nursery() as round_:
            for i in range(3):
                round_.start_soon(one, i, RULES if i < 2 else DeadlineRules(stall=10 * STALL, slack=20.0))
        nursery.cancel_scope.cancel()
    late, ids = peers[2].host.peer_id, [peer.host.peer_id for peer in peers]
    for i in (0, 1):
        assert late in results[i].failed_peers
        assert all(late not in part for part in results[i].part_contributors[i])  # dropped before its first part
    assert sorted(results[2].local_shards) == [], results[2].local_shards
    for shard in (0, 1):  # the late peer holds what the others hold there
        start, end = results[2].plan.shard_bounds(shard)
        assert torch.equal(flat(tensors[2])[start:end], flat(tensors[shard])[start:end])
    checks = peers[2].service.checks
    assert checks.passed == 2 and checks.caught == 0
    assert not any(peer in checks.banned for peer in ids) and not checks.exclusions, dict(checks.banned.until)
