"""A donor's state downloads are bounded: each one pins a full copy of the state until sent, so a
peer that opens download streams and never reads them must not pin more than a few copies."""

from __future__ import annotations

import math

import torch
import trio

from averaging.averager import GroupAverager
from averaging.group import MAX_COUNTER
from averaging.state_sharing import MAX_SERVES_PER_PEER, DonorOffer, StateSharing
from dht.node import DHTNode
from peer import BusyError, Identity, PeerAddress, open_peer_host

NUMEL = 1 << 20  # 4 MiB per tensor, 3 tensors: more than a stream's credit window holds in flight


async def _run_node(task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with DHTNode.open() as node:
        task_status.started(node)
        await trio.sleep(math.inf)


async def test_a_peer_holding_unread_state_downloads_gets_busy_beyond_its_share() -> None:
    async with trio.open_nursery() as nursery:
        node = await nursery.start(_run_node)
        GroupAverager([torch.ones(NUMEL) for _ in range(3)], node, prefix="run.state")
        refused: list[BaseException] = []
        opened = trio.Event()
        async with open_peer_host(Identity.generate(), listen=None) as attacker:
            connection = await attacker.connect(node.address)

            async def hold() -> None:
                try:
                    async with connection.stream("avg.state.run.state") as stream:
                        await stream.receive()  # the header: this download is being served
                        opened.set()
                        await trio.sleep_forever()  # and never read further
                except BusyError as error:
                    refused.append(error)

            with trio.fail_after(20):
                async with trio.open_nursery() as holders:
                    for _ in range(6):
                        holders.start_soon(hold)
                    await opened.wait()
                    while len(refused) < 6 - MAX_SERVES_PER_PEER:
                        await trio.sleep(0.05)
                    holders.cancel_scope.cancel()
        assert len(refused) == 6 - MAX_SERVES_PER_PEER
        assert "as many state downloads" in refused[0].remote_message
        nursery.cancel_scope.cancel()


def test_donors_are_tried_newest_first_and_the_rest_stay_as_fallbacks() -> None:
    versions = [3, MAX_COUNTER, 5, 3]
    offers = []
    for version in versions:
        peer_id = Identity.generate().peer_id
        offers.append(DonorOffer(PeerAddress("127.0.0.1", 1, peer_id), version))
    ordered = StateSharing.order_donors(offers)
    assert [offer.version for offer in ordered] == sorted(versions, reverse=True)
