"""Hole punching in the network lab: two peers behind two different port-preserving NATs meet
through a relay (a public ``peerd join``) and end up directly connected, the connection's remote
address being the other NAT's public address; behind port-randomizing NATs punching fails and the
peers keep streaming through the relay."""

from __future__ import annotations

import json
import select

import pytest

from tests.support.netlab import PEER_PORT

RUN_ID = "lab-punch"


def read_json(process, timeout: float) -> dict:
    """The next JSON line a helper prints, within ``timeout`` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    line = process.stdout.readline()
    assert line, "the helper exited"
    return json.loads(line)


def tell(process, line: str) -> None:
    process.stdin.write(line.encode() + b"\n")
    process.stdin.flush()


def punch_pair(lab, relay: str, target_host, dialer_host, *, megabytes: int = 0, observed: bool = True) -> dict:
    """One punch from ``dialer_host`` to ``target_host``; ``observed``: let each learn its public
    host by a dial-back (else it is given, which saves the dial-back's timeout)."""
    common = ["--relay", relay, "--run-id", RUN_ID]
    target = lab.spawn(
        target_host,
        [
            "tests/support/lab_punch_peer.py",
            "target",
            "--host",
            target_host.address,
            *common,
            *([] if observed else ["--observed", target_host.router.address]),
        ],
        lab.workdir / f"target-{target_host.name}.log",
    )
    dialer = lab.spawn(
        dialer_host,
        [
            "tests/support/lab_punch_peer.py",
            "dialer",
            "--host",
            dialer_host.address,
            "--megabytes",
            str(megabytes),
            *common,
            *([] if observed else ["--observed", dialer_host.router.address]),
        ],
        lab.workdir / f"dialer-{dialer_host.name}.log",
    )
    offered = read_json(target, 60)
    assert offered["observed"] == target_host.router.address, offered
    tell(dialer, offered["address"])
    return read_json(dialer, 90)


@pytest.mark.timeout(240)
def test_port_preserving_nats_are_punched_and_port_randomizing_ones_stay_relayed(nat_netlab):
    lab = nat_netlab
    hub = lab.add_host("relay", rate_mbit=100)
    preserving = [lab.add_nat_host(f"p{index}", rate_mbit=100) for index in range(2)]
    randomizing = [lab.add_nat_host(f"r{index}", rate_mbit=100, random_ports=True) for index in range(2)]
    [relay_peer] = lab.start_swarm([hub], run_id=RUN_ID)
    relay = f"{hub.address}:{PEER_PORT}/{relay_peer.status()['peer_id']}"

    result = punch_pair(lab, relay, preserving[0], preserving[1])
    assert result["punched"], result
    # a direct connection: from the dialer's NAT straight to the target's NAT, not via the relay
    assert result["remote"].split(":")[0] == preserving[0].router.address, result
    assert result["punch_s"] < 5, result
    print(f"punched in {result['punch_s']} s")

    result = punch_pair(lab, relay, randomizing[0], randomizing[1], megabytes=2, observed=False)
    assert not result["punched"] and result["remote"] is None, result
    assert result["relayed_mb_s"] > 0, result  # the relayed stream still carried the data
