"""Scenario 6 of the network lab: faults in a five-peer all-reduce group, one process per peer on
its own host, where a death is a real ``os._exit`` (the kernel closes the sockets, as when a
volunteer's process is killed). Peers 0 and 1 take Hivemind's seven fault pairs, plus a reducer that
dies midway through replying; peers 2-4 are healthy and each must return in time holding exactly
the weighted average of the contributions its result reports. Two more: a reducer frozen and
killed while the others stream to it, and a leader that dies right after its group formed.

The default suite runs one repetition of four pairs that between them take every victim's death
(before, while sending, reducing, replying) and a slow sender (five processes start per pair, ~10 s
on 2 cores); ``--run-slow`` runs the other four once and repeats every pair 20 times. Each pair also
runs in process, with every fault, in ``tests/averaging/test_allreduce.py``."""

from __future__ import annotations

import json
import os
import selectors
import time

import pytest
import torch

from averaging.partition import AllReducePlan
from peer import Identity
from tests.support.lab_allreduce_peer import PART_SIZE, WEIGHTS, tensors_of
from tests.support.processes import process_state

SENDER_TIMEOUT = 2.0
REDUCER_TIMEOUT = 4.0
# Both deadlines, plus a margin for five processes and the test on 2 busy cores.
IN_TIME = SENDER_TIMEOUT + REDUCER_TIMEOUT + 2.0
# A peer whose process died is noticed when its connection closes, well before any deadline.
AT_ONCE = 1.5
PORT = 31400
SIZE = 5
START_TIMEOUT = 60.0

PAIRS = [
    ("none", "dies_before"),
    ("dies_before", "dies_before"),
    ("slow_send", "dies_sending"),
    ("dies_sending", "dies_before"),
    ("slow_reduce", "dies_sending"),
    ("dies_reducing", "dies_reducing"),
    ("none", "cancel"),
    ("none", "dies_replying"),
]
# pairs in which every victim dies while a healthy peer is waiting on its connection, or before
# sending anything (dialing it is refused, and that drops it as a sender too)
DEATHS_NOTICED_AT_ONCE = {
    ("dies_reducing", "dies_reducing"),
    ("none", "dies_replying"),
    ("none", "dies_before"),
    ("dies_before", "dies_before"),
}


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def expected_for(outcome: dict, peer_ids: list[str]) -> torch.Tensor:
    """Per part, the weighted average of the contributors the result names for it, or the peer's
    own values where its result says the shard stayed local."""
    originals = [flat(tensors_of(index)) for index in range(SIZE)]
    expected = originals[outcome["index"]].clone()
    plan = AllReducePlan.build(expected.numel(), [1.0] * SIZE, PART_SIZE)
    for shard in range(plan.num_shards):
        if shard in outcome["local_shards"]:
            continue
        every_part = set(outcome["contributors"][str(shard)])
        by_part = outcome["part_contributors"][str(shard)]
        assert len(by_part) == plan.num_parts(shard)
        for (start, end), named in zip(plan.parts(shard), by_part, strict=True):
            assert every_part <= set(named)
            contributors = [peer_ids.index(p) for p in named]
            assert contributors, "an averaged part must name its contributors"
            total = sum(WEIGHTS[c] for c in contributors)
            expected[start:end] = sum(originals[c][start:end] * WEIGHTS[c] for c in contributors) / total
    return expected


def read_line(process, timeout: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError(f"no line within {timeout} s")
    return process.stdout.readline().decode().strip()


def member_keys(workdir) -> tuple[list[str], list[str]]:
    keys = []
    for index in range(SIZE):
        key = workdir / f"member{index}.key"
        if not key.exists():
            Identity.generate().save(key)
        keys.append(str(key))
    return keys, [str(Identity.load_or_create(key).peer_id) for key in keys]


def start_members(lab, hosts, workdir, roles, tag, port, extra=()) -> tuple[list, list, object]:
    """One ``lab_allreduce_peer.py`` per host; returns (processes, result paths, a log reader)."""
    keys, _ = member_keys(workdir)
    addresses = [f"{host.address}:{port}" for host in hosts]
    group_id = os.urandom(16).hex()
    outs = [workdir / f"out{tag}-{index}.json" for index in range(SIZE)]
    processes = []
    for index, host in enumerate(hosts):
        args = [
            "tests/support/lab_allreduce_peer.py",
            "--index", str(index), "--keys", *keys, "--addresses", *addresses, "--group-id", group_id,
            "--fault", roles[index], "--out", str(outs[index]), *extra,
        ]  # fmt: skip
        processes.append(lab.spawn(host, args, workdir / f"member{index}-{tag}.log"))

    def logs() -> str:
        return "\n".join(
            f"--- member {i} ({roles[i]}):\n{(workdir / f'member{i}-{tag}.log').read_text()[-1500:]}"
            for i in range(SIZE)
        )

    return processes, outs, logs


def go(processes, logs) -> float:
    for process in processes:
        assert read_line(process, START_TIMEOUT) == "ready", logs()
    started = time.monotonic()
    for process in processes:
        process.stdin.write(b"go\n")
        process.stdin.flush()
    return started


def run_pair(lab, hosts, workdir, faults: tuple[str, str], repetition: int = 0) -> None:
    _, peer_ids = member_keys(workdir)
    roles = [*faults] + ["none"] * (SIZE - 2)
    timeouts = ["--sender-timeout", str(SENDER_TIMEOUT), "--reducer-timeout", str(REDUCER_TIMEOUT)]
    # a fresh port per repetition: no TIME_WAIT of the last one in the way
    processes, outs, logs = start_members(lab, hosts, workdir, roles, repetition, PORT + repetition, timeouts)
    try:
        started = go(processes, logs)
        healthy = [i for i in range(SIZE) if roles[i] == "none"]
        while not all(outs[i].exists() for i in healthy):
            for i in healthy:
                assert processes[i].poll() is None, f"healthy member {i} failed\n{logs()}"
            assert time.monotonic() - started < IN_TIME, f"healthy members not done within {IN_TIME} s\n{logs()}"
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()

    victims = {peer_ids[i] for i in range(SIZE) if roles[i] != "none"}
    healthy_ids = {peer_ids[i] for i in healthy}
    for i in healthy:
        outcome = json.loads(outs[i].read_text())
        context = f"member {i} with faults {faults}: {dict(outcome, flat='...')}"
        assert torch.allclose(torch.tensor(outcome["flat"]), expected_for(outcome, peer_ids), atol=1e-6), context
        assert victims <= set(outcome["failed"]), context
        assert not healthy_ids & set(outcome["failed"]), context
        for contributors in outcome["contributors"].values():  # no healthy contribution was lost
            assert healthy_ids <= set(contributors), context
        if faults in DEATHS_NOTICED_AT_ONCE:
            assert outcome["seconds"] < AT_ONCE, (
                f"a dead peer was noticed only after {outcome['seconds']:.1f} s: {context}"
            )


@pytest.fixture
def five_hosts(netlab):
    return [netlab.add_host(f"h{index}", rate_mbit=100) for index in range(SIZE)]


DEFAULT_PAIRS = {
    ("dies_before", "dies_before"),
    ("slow_send", "dies_sending"),
    ("dies_reducing", "dies_reducing"),
    ("none", "dies_replying"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "faults",
    [pair if pair in DEFAULT_PAIRS else pytest.param(pair, marks=pytest.mark.slow) for pair in PAIRS],
    ids=["-".join(pair) for pair in PAIRS],
)
def test_group_faults_with_real_processes(netlab, five_hosts, tmp_path, faults):
    run_pair(netlab, five_hosts, tmp_path, faults)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("faults", PAIRS, ids=["-".join(pair) for pair in PAIRS])
def test_group_faults_with_real_processes_20_times(netlab, five_hosts, tmp_path, faults):
    for repetition in range(20):
        run_pair(netlab, five_hosts, tmp_path, faults, repetition)


# Big enough that each reducer's shard (~19 MB) outgrows a namespace's default socket buffers
# (6 MB receive + 4 MB send), so a sender is blocked writing into a reducer that stopped reading.
BIG_VALUES = 24_000_000
BIG_REDUCER_TIMEOUT = 20.0  # the library's default: what a healthy peer would wait if it missed the death
STOPPED_FOR = 1.5
SENDER_DEADLINE = 3.0  # a dropped sender's deadline, well below the reducer's


@pytest.mark.timeout(120)
def test_a_reducer_frozen_then_killed_mid_stream_is_noticed_at_once(netlab, tmp_path):
    """The issue's first fault: a send whose connection dies while the message is queued or being
    written must fail at once. Member 1 stops itself (SIGSTOP) after its first part, while the
    others stream their parts to it, and is killed 1.5 s later; the healthy members must finish
    soon after the kill, not at the reducer deadline (or never)."""
    hosts = [netlab.add_host(f"h{index}", rate_mbit=None) for index in range(SIZE)]
    roles = ["none", "freezes_sending"] + ["none"] * (SIZE - 2)
    extra = ["--values", str(BIG_VALUES), "--sender-timeout", str(SENDER_DEADLINE)]
    extra += ["--reducer-timeout", str(BIG_REDUCER_TIMEOUT)]
    processes, outs, logs = start_members(netlab, hosts, tmp_path, roles, "frozen", PORT, extra)
    victim = processes[1]
    try:
        started = go(processes, logs)
        while process_state(victim.pid) != "T":  # it stops itself after its first part
            assert time.monotonic() - started < 30, f"member 1 never froze\n{logs()}"
            time.sleep(0.01)
        time.sleep(STOPPED_FOR)
        victim.kill()
        killed = time.monotonic()
        healthy = [0, 2, 3, 4]
        while not all(outs[i].exists() for i in healthy):
            assert time.monotonic() - started < BIG_REDUCER_TIMEOUT + 10, f"healthy members never finished\n{logs()}"
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    _, peer_ids = member_keys(tmp_path)
    for i in healthy:
        outcome = json.loads(outs[i].read_text())
        noticed = outcome["finished_at"] - killed
        context = f"member {i}: finished {noticed:.1f} s after the kill; {dict(outcome, flat='...')}"
        assert peer_ids[1] in outcome["failed"], context
        # the sender deadline at most (no contribution comes from a frozen peer), not the reducer's
        assert outcome["seconds"] < SENDER_DEADLINE + 2.0 and noticed < SENDER_DEADLINE, context


MATCHMAKING_TIMEOUT = 10.0  # the round's whole matchmaking budget


@pytest.mark.timeout(120)
def test_the_leader_dying_right_after_the_group_forms_costs_no_round(netlab, five_hosts, tmp_path):
    """The issue's second fault: the leader of a freshly formed group dies before announcing it.
    The four others must still form a group (without it) within the round's matchmaking time."""
    _, peer_ids = member_keys(tmp_path)
    keys = [str(tmp_path / f"member{index}.key") for index in range(SIZE)]
    # the grid rule makes the lowest peer ID of a group its leader
    leader = min(range(SIZE), key=lambda i: Identity.load_or_create(keys[i]).peer_id.to_bytes())
    addresses = [f"{host.address}:{PORT}" for host in five_hosts]
    outs = [tmp_path / f"match-{index}.json" for index in range(SIZE)]
    processes = []
    for index, host in enumerate(five_hosts):
        args = ["tests/support/lab_matchmaking_peer.py", "--key", keys[index], "--listen", addresses[index]]
        args += ["--out", str(outs[index]), "--timeout", str(MATCHMAKING_TIMEOUT)]
        args += ["--initial-peer", addresses[0]] if index else []
        args += ["--dies-when-leading"] if index == leader else []
        processes.append(netlab.spawn(host, args, tmp_path / f"match-{index}.log"))
        if index == 0:  # the others bootstrap from it
            assert read_line(processes[0], START_TIMEOUT) == "ready"

    def logs() -> str:
        return "\n".join(f"--- member {i}:\n{(tmp_path / f'match-{i}.log').read_text()[-1500:]}" for i in range(SIZE))

    for process in processes[1:]:
        assert read_line(process, START_TIMEOUT) == "ready", logs()
    started = time.monotonic()
    for process in processes:
        process.stdin.write(b"go\n")
        process.stdin.flush()
    healthy = [i for i in range(SIZE) if i != leader]
    while not all(outs[i].exists() for i in healthy):
        assert time.monotonic() - started < MATCHMAKING_TIMEOUT + 10, f"matchmaking never ended\n{logs()}"
        time.sleep(0.05)
    assert processes[leader].poll() is not None, "the leader should have died after forming its group"
    outcomes = {i: json.loads(outs[i].read_text()) for i in healthy}
    failed = {i: o["error"] for i, o in outcomes.items() if "group" not in o}
    assert not failed, f"the leader {peer_ids[leader]} died and these peers lost the round: {failed}"
    for outcome in outcomes.values():
        assert peer_ids[leader] not in outcome["group"] and len(outcome["group"]) >= 2, outcomes
