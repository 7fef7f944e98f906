"""Scenario 5 of the network lab: three public peers and two peers behind NAT routers (one
masquerading, one port-randomizing) train together to the target. The NAT'd peers run in client
mode: they dial out and accept nothing, which is all such a router lets them do."""

from __future__ import annotations

import time

import pytest

from tests.support.netlab import STATUS_PORT, connect_in

TARGET_ACCURACY = 0.9
TRAIN_TIMEOUT = 120.0  # the five public peers of scenario 1 need ~25 s; clients reduce nothing, so allow more


def accuracies(peers) -> list[float]:
    return [((peer.status() or {}).get("accuracy") or 0.0) for peer in peers]


def averaged_group(peer) -> int:
    record = (peer.status() or {}).get("last_averaging") or {}
    return (record.get("group") or 0) if record.get("averaged") else 0


# Slow (32 s of CI): peers behind both kinds of NAT train with public peers in the default suite as
# full peers (test_lab_relay.py); client peers average with full ones in process
# (tests/averaging/test_allreduce.py::test_mixed_node_client_and_auxiliary_peers).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_peers_behind_nat_train_with_three_public_peers(nat_netlab):
    lab = nat_netlab
    public = [lab.add_host(f"h{index}", rate_mbit=100) for index in range(3)]
    behind = [lab.add_nat_host("n0", rate_mbit=100), lab.add_nat_host("n1", rate_mbit=100, random_ports=True)]
    # a public host has no route to an address behind a router; so every connection a public peer
    # accepts from a NAT'd one reached it with the router's address: masqueraded
    for host in behind:
        with pytest.raises(OSError):
            connect_in(public[0].namespace, host.address, STATUS_PORT, timeout=2).close()

    peers = lab.start_swarm(public + behind, run_id="lab-nat", extra=["--task", "digits"], client={3, 4})
    started = time.monotonic()
    lab.wait_for(lambda: min(accuracies(peers)) >= TARGET_ACCURACY, TRAIN_TIMEOUT, "every peer at the target")
    print(f"all five at {TARGET_ACCURACY} after {time.monotonic() - started:.1f} s")
    # the clients trained with the swarm, not alone
    for peer in peers[3:]:
        lab.wait_for(lambda peer=peer: averaged_group(peer) >= 2, 60, f"an averaged round on {peer.host.name}")
    assert all(peer.alive() for peer in peers), lab.logs()
