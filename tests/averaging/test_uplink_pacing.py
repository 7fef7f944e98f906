"""A peer paces each connection of a round to its share of its uplink (``averaging/uplink.py``):
the shares follow the bytes each connection carries, a paced connection sends no faster than its
cap, and the caps are lifted when the round ends. The uplink is the operator's figure where one was
declared, else measured by the rounds themselves (``UplinkEstimate``)."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct

import pytest
import torch
import trio

from averaging.allreduce import AllReduceService, RoundSettings
from averaging.averager import GroupAverager
from averaging.group import AveragingMode, GroupInfo, GroupMember
from averaging.local_updates import LocalUpdatesOptimizer
from averaging.optimizer import CollaborativeOptimizer
from averaging.partition import AllReducePlan
from averaging.round_links import ConnectionCaps
from averaging.uplink import (
    AVERAGES,
    MAX_LOWERING,
    MIN_EVEN_SHARE,
    PACING_SHARE,
    PARTS,
    UplinkEstimate,
    UploadFigures,
    uplink_shares,
)
from dht import DHTNode
from peer import Identity, PeerAddress, Router, open_peer_host
from peer.tcp_options import SO_MAX_PACING_RATE, set_pacing_rate
from tests.daemon.test_training import open_swarm

UPLINK = 1_000_000.0


def group_of(modes: list[AveragingMode], bandwidths: list[float]) -> GroupInfo:
    members = []
    for index, (mode, bandwidth) in enumerate(zip(modes, bandwidths, strict=True)):
        peer = Identity.generate().peer_id
        address = None if mode is AveragingMode.CLIENT else PeerAddress(f"10.0.0.{index + 1}", 1000, peer)
        members.append(GroupMember(peer, address, 0.0 if mode is AveragingMode.CLIENT else bandwidth, mode))
    return GroupInfo(os.urandom(16), tuple(members))


def test_equal_shards_split_the_uplink_evenly_between_the_other_members():
    group = group_of([AveragingMode.NODE] * 4, [1.0] * 4)
    plan = AllReducePlan.build(4_000_000, [1.0] * 4)
    me = group.members[0].peer_id
    shares = uplink_shares(plan, group, me, UPLINK)
    others = [m.peer_id for m in group.members[1:]]
    assert set(shares) == {(peer, kind) for peer in others for kind in (PARTS, AVERAGES)}
    for peer in others:  # one connection per pair carries both: a third of the uplink each
        assert shares[(peer, PARTS)] + shares[(peer, AVERAGES)] == pytest.approx(UPLINK * PACING_SHARE / 3)


def test_shares_follow_the_bytes_each_connection_carries():
    group = group_of([AveragingMode.NODE, AveragingMode.NODE, AveragingMode.NODE, AveragingMode.CLIENT], [1, 2, 3, 0])
    plan = AllReducePlan.build(6_000_000, [1.0, 2.0, 3.0])
    sizes = plan.shard_sizes  # 1M, 2M, 3M
    me, second, third, client = (m.peer_id for m in group.members)
    shares = uplink_shares(plan, group, me, UPLINK)
    # to a reducer: our part of its shard, and our shard's average back; to the client: the average
    owed = {
        (second, PARTS): sizes[1],
        (second, AVERAGES): sizes[0],
        (third, PARTS): sizes[2],
        (third, AVERAGES): sizes[0],
        (client, AVERAGES): sizes[0],
    }
    total = sum(owed.values())
    assert shares == pytest.approx({key: UPLINK * PACING_SHARE * values / total for key, values in owed.items()})
    assert sum(shares.values()) == pytest.approx(UPLINK * PACING_SHARE)
    # a client only sends: its part of each reducer's shard, in proportion to the shard
    from_client = uplink_shares(plan, group, client, UPLINK)
    expected = {
        (p, PARTS): UPLINK * PACING_SHARE * s / sum(sizes) for p, s in zip((me, second, third), sizes, strict=True)
    }
    assert from_client == pytest.approx(expected)


def sink_router() -> Router:
    router = Router()

    @router.stream("sink")
    async def sink(stream) -> None:
        async for _ in stream:
            pass
        await stream.send("done")

    return router


async def send_through(connection, payload: bytes) -> float:
    started = trio.current_time()
    async with connection.stream("sink", timeout=30) as stream:
        await stream.send(None, payload)
        await stream.end()
        assert (await stream.receive()).body == "done"
    return trio.current_time() - started


async def test_a_paced_connection_sends_no_faster_than_its_cap():
    async with open_peer_host(Identity.generate(), router=sink_router()) as server:
        async with open_peer_host(Identity.generate(), listen=None) as client:
            connection = await client.connect(server.listen_address)
            payload = bytes(2 << 20)
            assert connection.set_pacing_rate(4 << 20)  # 4 MiB/s: 2 MiB take half a second
            paced = await send_through(connection, payload)
            assert paced >= 0.35
            assert connection.set_pacing_rate(None)
            assert await send_through(connection, payload) < paced / 2


async def test_a_round_paces_its_connections_while_it_runs_and_lifts_the_caps_after():
    values = 1 << 20  # 4 MiB of float32: each of 3 peers sends 2 x 2/3 of it, ~5.6 MB
    uplink = 8e6
    async with trio.open_nursery() as nursery:
        hosts, services = [], []

        async def run_host(address: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with open_peer_host(Identity.generate(), router=sink_router(), listen=(address, 0)) as host:
                task_status.started((host, AllReduceService(host)))
                await trio.sleep_forever()

        for i in range(3):  # each on a loopback address of its own: peers on one host are left unpaced
            host, service = await nursery.start(run_host, f"127.0.0.{i + 2}")
            hosts.append(host)
            services.append(service)
        members = tuple(GroupMember(h.peer_id, h.listen_address, 1.0, AveragingMode.NODE) for h in hosts)
        group = GroupInfo(os.urandom(16), members)
        tensors = [[torch.full((values,), float(i))] for i in range(3)]
        seconds = {}

        async def one(i: int) -> None:
            started = trio.current_time()
            result = await services[i].run(
                group, tensors[i], settings=RoundSettings(uplink=uplink, sender_timeout=30, reducer_timeout=60)
            )
            assert result.succeeded
            seconds[i] = trio.current_time() - started

        async with trio.open_nursery() as round_:
            for i in range(3):
                round_.start_soon(one, i)
        for i in range(3):
            assert torch.equal(tensors[i][0], torch.full((values,), 1.0))
        # each peer's upload at its paced share of 8 MB/s: ~0.7 s; unpaced, loopback takes a tenth
        assert max(seconds.values()) >= 0.5
        # the round is over: the same connection sends at loopback speed again
        connection = hosts[0].connection_to(hosts[1].peer_id)
        assert connection is not None
        assert await send_through(connection, bytes(4 << 20)) < max(seconds.values()) / 2
        nursery.cancel_scope.cancel()


async def test_both_optimizers_hand_a_declared_uplink_to_every_averager_they_run():
    async with trio.open_nursery() as nursery:
        (node,) = await open_swarm(nursery, 1)
        weight = torch.nn.Parameter(torch.zeros(4))
        collaborative = CollaborativeOptimizer(
            torch.optim.SGD([weight], lr=0.1), node, prefix="up", target_batch_size=8, uplink=5e6
        )
        local = LocalUpdatesOptimizer(torch.optim.SGD([weight], lr=0.1), node, prefix="up2", uplink=5e6)
        averagers = [
            collaborative.grad_averager,
            collaborative.replica.state,
            local.delta_averager,
            local.start_averager,
            local.replica.state,
        ]
        assert [averager.uplink for averager in averagers] == [5e6] * len(averagers)
        nursery.cancel_scope.cancel()


class RecordingLink:
    def __init__(self) -> None:
        self.rate: float | None = None

    def set_pacing_rate(self, rate: float | None) -> bool:
        self.rate = rate
        return True


def test_rounds_sharing_a_connection_keep_their_caps_until_the_last_one_ends():
    caps = ConnectionCaps()
    shared, own = RecordingLink(), RecordingLink()
    gradients, state = object(), object()
    caps.hold(gradients, shared, 3e6)
    caps.hold(state, shared, 5e6)
    caps.hold(state, own, 2e6)
    assert shared.rate == 5e6 and own.rate == 2e6  # the highest cap of the rounds on it
    caps.release(state)  # the state round ends first: the gradient round's cap stays
    assert shared.rate == 3e6 and own.rate is None
    caps.release(gradients)
    assert shared.rate is None and len(caps) == 0  # nothing kept once no round holds a cap


def test_a_rate_beyond_what_the_kernel_takes_lifts_the_cap_instead_of_failing():
    # A declared uplink is the operator's figure: one absurdly high (or a share of it past 2^64
    # bytes/s) must leave the connection uncapped, not fail every round it paces.
    with socket.socket() as sock:
        for rate in (1e25, float("inf")):
            assert set_pacing_rate(sock, rate)
            assert sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8) == struct.pack("Q", 2**64 - 1)
        assert set_pacing_rate(sock, 1000.0)
        assert struct.unpack("Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8))[0] == 1000


@pytest.mark.parametrize("uplink", [0.0, -1.0, float("nan"), float("inf")])
def test_an_averager_refuses_an_uplink_that_is_no_speed(uplink):
    with pytest.raises(ValueError):
        GroupAverager([torch.zeros(2)], dht=None, prefix="x", uplink=uplink)  # type: ignore[arg-type]


def test_a_sliver_of_claimed_bandwidth_cannot_pace_our_connection_to_a_crawl():
    # A reducer's shard follows its claim: claiming next to nothing, it gets one value, and a peer
    # that only sends (a client) would cap its connection to it at ~1 byte/s, where the part's
    # framing, and any DHT or expert call to that peer during the round, would take minutes.
    group = group_of([AveragingMode.NODE, AveragingMode.NODE, AveragingMode.NODE, AveragingMode.CLIENT], [1, 1, 1, 0])
    plan = AllReducePlan.build(1_000_000, [1.0, 1.0, 1.8e-6])
    assert plan.shard_sizes[2] == 1
    first, second, sliver, client = (m.peer_id for m in group.members)
    shares = uplink_shares(plan, group, client, UPLINK)
    even = UPLINK * PACING_SHARE / 3
    assert shares[(sliver, PARTS)] >= even * MIN_EVEN_SHARE
    # the honest reducers keep their shares: the floor adds at most MIN_EVEN_SHARE
    assert shares[(first, PARTS)] == pytest.approx(shares[(second, PARTS)], rel=1e-5)
    assert sum(shares.values()) <= UPLINK * PACING_SHARE * (1 + MIN_EVEN_SHARE)


def test_members_on_our_own_host_are_left_out_of_the_uplink():
    # One peer per GPU: bytes to a peer on the same machine never cross the uplink, so they get no
    # share of it (a cap there would slow a free flow and leave the uplink part idle), and the
    # uplink is split among the flows that do cross it. A relay's host is no member's own machine.
    group = group_of([AveragingMode.NODE] * 4, [1.0] * 4)
    me, local, remote, relayed = group.members
    local = dataclasses.replace(local, address=PeerAddress(me.address.host, 2000, local.peer_id))
    via = Identity.generate().peer_id
    relayed = dataclasses.replace(relayed, address=PeerAddress(me.address.host, 1000, relayed.peer_id, via))
    group = GroupInfo(group.group_id, (me, local, remote, relayed))
    shares = uplink_shares(AllReducePlan.build(4_000_000, [1.0] * 4), group, me.peer_id, UPLINK)
    assert {peer for peer, _ in shares} == {remote.peer_id, relayed.peer_id}
    assert sum(shares.values()) == pytest.approx(UPLINK * PACING_SHARE)


def test_an_undeclared_uplink_is_measured_in_an_unpaced_round_and_paced_at_after():
    estimate = UplinkEstimate()
    assert estimate.for_next_round() is None  # nothing known: TCP shares the link
    estimate.observe(UploadFigures(None, None))  # too few bytes to tell
    assert estimate.for_next_round() is None
    estimate.observe(UploadFigures(12e6, None))
    assert estimate.for_next_round() == estimate.value == 12e6


def test_a_paced_round_held_back_by_its_caps_keeps_the_estimate_and_every_eighth_probes_again():
    estimate = UplinkEstimate(probe_every=8)
    estimate.observe(UploadFigures(12e6, None))
    paced = []
    for _ in range(7):
        paced.append(estimate.for_next_round())
        estimate.observe(UploadFigures(PACING_SHARE * 12e6 * 0.98, 12e6))  # what its caps allowed
    assert paced == [12e6] * 7  # the caps bound what a paced round shows: no creeping down
    assert estimate.for_next_round() is None  # the eighth measures the link afresh
    estimate.observe(UploadFigures(20e6, None))  # a faster link than we knew
    assert estimate.for_next_round() == 20e6


def test_rounds_that_failed_count_toward_the_next_probe():
    estimate = UplinkEstimate(probe_every=4)
    estimate.observe(UploadFigures(12e6, None))
    assert [estimate.for_next_round() for _ in range(3)] == [12e6] * 3  # none of them observed
    assert estimate.for_next_round() is None
    estimate.observe(UploadFigures(None, None))  # the probe moved too little to tell
    assert estimate.for_next_round() is None  # so the next one probes again


def test_a_paced_round_well_below_its_caps_shows_a_slower_link_down_to_half_the_last_reading():
    estimate = UplinkEstimate()
    estimate.observe(UploadFigures(12e6, None))
    estimate.observe(UploadFigures(8e6, 12e6))  # other traffic on the link, a worse route
    assert estimate.for_next_round() == 8e6 / PACING_SHARE  # the caps add up to what it delivered
    estimate.observe(UploadFigures(0.96 * 8e6, 8e6 / PACING_SHARE))  # held back by its caps now
    assert estimate.for_next_round() == 8e6 / PACING_SHARE
    for _ in range(3):  # a member that reads at a crawl holds our flows back round after round
        estimate.observe(UploadFigures(0.1 * estimate.value, estimate.value))
    assert estimate.value == MAX_LOWERING * 12e6


def test_a_declared_uplink_is_an_override_that_no_round_moves():
    estimate = UplinkEstimate(declared=3e6)
    for figures in (UploadFigures(12e6, None), UploadFigures(1e6, 3e6)):
        estimate.observe(figures)
        assert estimate.for_next_round() == estimate.value == 3e6


async def test_averagers_that_declare_no_uplink_pace_their_rounds_at_what_they_measured():
    values = 1 << 20  # 4 MiB of float32: enough bytes to measure
    async with trio.open_nursery() as nursery:

        async def run_node(address: str, initial, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with DHTNode.open(listen=(address, 0), initial_peers=initial) as node:
                task_status.started(node)
                await trio.sleep_forever()

        # each on a loopback address of its own: peers on one host are left unpaced
        first = await nursery.start(run_node, "127.0.0.2", [])
        nodes = [first] + [await nursery.start(run_node, f"127.0.0.{i + 3}", [first.address]) for i in range(2)]
        averagers = [
            GroupAverager(
                [torch.full((values,), float(i))], node, prefix="measured", target_group_size=3, aggregation="mean"
            )
            for i, node in enumerate(nodes)
        ]
        assert {averager.uplink for averager in averagers} == {None}
        rounds: list[list] = [[], []]
        measured: list[float] = []
        for number in range(2):

            async def step(averager: GroupAverager, done: list = rounds[number]) -> None:
                done.append(await averager.step(timeout=30))

            async with trio.open_nursery() as steps:
                for averager in averagers:
                    steps.start_soon(step, averager)
            if number == 0:
                figures = [r.result.upload for r in rounds[0]]
                assert all(f is not None and f.paced_at is None and f.rate > 0 for f in figures), figures
                measured = sorted(f.rate for f in figures)
                assert sorted(a.uplink for a in averagers) == measured
        # the second round paces each peer's connections to share what its first measured
        assert sorted(r.result.upload.paced_at for r in rounds[1]) == measured
        for averager in averagers:
            assert torch.allclose(averager.tensors[0], torch.full((values,), 1.0))
        nursery.cancel_scope.cancel()


async def test_bytes_to_members_on_our_own_host_say_nothing_of_the_uplink():
    """A peer per GPU on one machine: what goes between them never crosses the uplink, so a round
    among them measures no uplink (it would read loopback's speed) and paces nothing."""
    values = 1 << 20
    async with trio.open_nursery() as nursery:
        hosts, services = [], []

        async def run_host(task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with open_peer_host(Identity.generate(), router=sink_router(), listen=("127.0.0.1", 0)) as host:
                task_status.started((host, AllReduceService(host)))
                await trio.sleep_forever()

        for _ in range(2):
            host, service = await nursery.start(run_host)
            hosts.append(host)
            services.append(service)
        members = tuple(GroupMember(h.peer_id, h.listen_address, 1.0, AveragingMode.NODE) for h in hosts)
        group = GroupInfo(os.urandom(16), members)
        results = []

        async def one(i: int) -> None:
            tensors = [torch.full((values,), float(i))]
            results.append(await services[i].run(group, tensors, settings=RoundSettings(uplink=UPLINK)))

        async with trio.open_nursery() as round_:
            for i in range(2):
                round_.start_soon(one, i)
        assert all(r.succeeded and r.link_rate is not None for r in results)  # the link was metered
        assert [r.upload for r in results] == [UploadFigures(None, None)] * 2  # but not as uplink
        nursery.cancel_scope.cancel()
