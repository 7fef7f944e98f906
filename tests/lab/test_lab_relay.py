"""Peers behind NAT as full peers, in the network lab: three public peers and three behind NAT
routers (two port-preserving, one port-randomizing) that run without ``--client-mode``. Each peer
learns whether it is reachable by dial-back; the NAT'd ones reserve slots on two relays, announce
relayed addresses, are called through a relay from a public host (and one of them hosts an expert
that a public host finds in the DHT and calls through a relay), train with the swarm, and keep
their place when a relay dies. The two behind port-preserving NATs end up directly connected by
hole punching; the one behind the port-randomizing NAT reaches them only through a relay."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.netlab import PEER_PORT

TARGET_ACCURACY = 0.9
TRAIN_TIMEOUT = 150.0


def reachability(peer) -> dict:
    return (peer.status() or {}).get("reachability") or {}


def ping_through(lab, host, address: str) -> dict:
    result = lab.run_in(host, ["tests/support/lab_nat_client.py", address, "--run-id", "lab-relay"], timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(420)
def test_peers_behind_nat_are_reached_through_relays_and_train(nat_netlab):
    lab = nat_netlab
    public = [lab.add_host(f"h{index}", rate_mbit=100) for index in range(3)]
    behind = [lab.add_nat_host(f"n{index}", rate_mbit=100) for index in range(2)]
    behind.append(lab.add_nat_host("n2", rate_mbit=100, random_ports=True))
    hosts = public + behind
    peers = []
    for index, host in enumerate(hosts):  # as lab.start_swarm, with experts on n0
        flags = ["--task", "digits", "--data-shard", f"{index}/{len(hosts)}"]
        if host is behind[0]:
            flags += ["--serve-experts", "ffn.[0:2]", "--hidden-dim", "16", "--heartbeat-period", "2"]
        initial = f"{hosts[0].address}:{PEER_PORT}" if index else None
        peers.append(lab.start_peer(host, run_id="lab-relay", initial_peer=initial, extra=flags))
        if index == 0:
            lab.wait_started(peers)
    lab.wait_started(peers)
    started = time.monotonic()

    def settled(peer, status: str) -> bool:
        return reachability(peer).get("status") == status

    for peer in peers[:3]:
        lab.wait_for(lambda peer=peer: settled(peer, "public"), 60, f"{peer.host.name} found public")
    for peer in peers[3:]:
        lab.wait_for(lambda peer=peer: settled(peer, "nat"), 60, f"{peer.host.name} found behind NAT")
        # its public address as the others see it: its router's
        assert reachability(peer)["observed_address"].startswith(peer.host.router.address + ":")
        lab.wait_for(
            lambda peer=peer: len(reachability(peer).get("relayed_addresses", [])) == 2,
            60,
            f"{peer.host.name} holding two relay reservations",
        )
        assert not reachability(peer)["client_mode_fallback"]
    print(f"reachability settled and relays reserved after {time.monotonic() - started:.1f} s")

    # a public host that never met n0 reaches it through either of its relays
    target = peers[3]
    for address in reachability(target)["relayed_addresses"]:
        full = f"{address}/{target.status()['peer_id']}"
        result = ping_through(lab, public[1], full)
        assert result["ok"] == result["count"] and result["relayed_via"], result

    # n0 hosts experts: a public host finds one in the DHT at n0's relayed address and calls it
    args = ["tests/support/lab_expert_client.py", "ffn.1", "--initial-peer", peers[0].address, "--run-id", "lab-relay"]
    called = lab.run_in(public[2], args, timeout=90)
    assert called.returncode == 0, called.stderr[-2000:]
    called = json.loads(called.stdout.strip().splitlines()[-1])
    assert called["shape"] == [3, 16] and called["relayed_via"], called

    lab.wait_for(lambda: min(accuracy(p) for p in peers) >= TARGET_ACCURACY, TRAIN_TIMEOUT, "every peer at the target")
    print(f"all six at {TARGET_ACCURACY} after {time.monotonic() - started:.1f} s")
    for peer in peers[3:]:
        lab.wait_for(lambda peer=peer: averaged_group(peer) >= 2, 60, f"an averaged round on {peer.host.name}")
    # n0 and n1 punched through to each other: the connection's far end is the other's NAT router
    ids = [peer.status()["peer_id"] for peer in peers]
    lab.wait_for(lambda: via(peers[3], ids[4]) == f"{behind[1].router.address}:{PEER_PORT}", 60, "n0 -> n1 direct")
    assert via(peers[4], ids[3]) == f"{behind[0].router.address}:{PEER_PORT}", reachability(peers[4])
    # n2, behind the port-randomizing NAT, can only be reached through a relay
    for other in (3, 4):
        assert via(peers[other], ids[5]) in (None, *(f"relay {i}" for i in ids[:3])), reachability(peers[other])

    # a relay dies: the NAT'd peer reserves with the remaining public peer and stays reachable
    relays = reachability(target)["relayed_addresses"]
    victim = next(p for p in peers[1:3] if any(a.startswith(p.host.address + ":") for a in relays))
    victim.kill()
    lab.wait_for(
        lambda: (
            len(addresses := reachability(target).get("relayed_addresses", [])) == 2
            and not any(a.startswith(victim.host.address + ":") for a in addresses)
        ),
        60,
        "n0 replacing its dead relay",
    )
    survivors = [p for p in peers if p is not victim]
    for address in reachability(target)["relayed_addresses"]:
        result = ping_through(lab, public[0], f"{address}/{target.status()['peer_id']}")
        assert result["ok"] == result["count"], result
    assert all(p.alive() for p in survivors), lab.logs()


def via(peer, other_id: str) -> str | None:
    """How ``peer`` is connected to ``other_id`` now: ``relay ID``, a remote endpoint, or None."""
    for entry in reachability(peer).get("connections", {}).get("peers", []):
        if entry["peer"] == other_id:
            return entry["via"]
    return None


def accuracy(peer) -> float:
    return (peer.status() or {}).get("accuracy") or 0.0


def averaged_group(peer) -> int:
    record = (peer.status() or {}).get("last_averaging") or {}
    return (record.get("group") or 0) if record.get("averaged") else 0
