"""Fault benchmark: how fast healthy peers notice a dead peer, and how many rounds they lose.

    python benchmarks/faults.py --quick    # within 120 s on 2 busy cores (shorter partition)
    python benchmarks/faults.py            # the issue's 30 s partition, more rounds

Runs in the network lab (``tests/support/netlab.py``: one network namespace per host on a private bridge,
real processes started with ``ip netns exec``), so it needs root, ``ip`` and ``tc``; without them it
prints one line saying what is missing and exits 2. Every namespace it makes is removed again,
also on an error, Ctrl-C or SIGTERM.

Scenarios (the rows of the table):
  dead_reducer   five members of one all-reduce group (``faults_cases/reducer_member.py``, one per
                 host) run a no-fault round, then a round in which member 1 stops itself after its
                 first part while the others stream their shards to it, and is SIGKILLed
                 ``FREEZE_S`` later (the issue's first fault: a send queued to a connection that
                 dies). Figure: seconds from the kill until the slowest healthy member's step
                 returned, and that over the no-fault round time.
  leader_death   five DHT peers with a ``GroupAverager`` each (``faults_cases/matchmaking_member.py``)
                 step in lock-step rounds: a warm-up, a no-fault baseline, then a round whose leader
                 (the lowest peer ID) is SIGKILLed right after the group formed, then a few more.
                 Figures: rounds that failed for a healthy peer (the most any one of them lost), and
                 seconds from the kill until the healthy peers' step returned.
  partition      five ``peerd join --task digits`` peers; hosts 3 and 4 are cut off from the hub for
                 ``PARTITION_S`` (``--quick``: shorter, and the table says so), then healed. Figure:
                 seconds from healing until one swarm again: every ``/status`` answers, epochs at most
                 one apart, every ``peers_known`` back to its value before the cut, and a peer
                 averaged in a group of 4 or more (one that spans the cut) after healing.

A scenario that fails (a process that never starts, a victim that did not lead, ...) is reported as
failed in the table and JSON; the benchmark itself does not crash. The last line is one JSON object
with ``dead_reducer_detect_s`` (target <= 0.5), ``leader_death_failed_rounds`` (target 0) and
``partition_heal_s`` (target <= 30), null where the scenario failed, and per-scenario details.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer import LOCAL_DIFFICULTY  # noqa: E402

# As the test suite does (tests/conftest.py): a public run's node-ID puzzle would cost ~10 s per
# fresh key, and every process of the lab must use the same difficulty.
os.environ.setdefault("PEERD_NODE_ID_DIFFICULTY", str(LOCAL_DIFFICULTY))

from tests.lab.test_lab_group_faults import SIZE, member_keys, process_state, read_line  # noqa: E402
from tests.lab.test_lab_partition import epochs, group_of  # noqa: E402
from tests.support.netlab import Lab, lab_unavailable, remove_leftovers  # noqa: E402

START_TIMEOUT = 90.0  # five interpreters importing torch on 2 busy cores (the lab's own figure)
# dead_reducer: each reducer's shard (~19 MB) outgrows a namespace's socket buffers, so senders are
# blocked writing into the frozen reducer (the lab test's figure); a round takes ~1-2 s here.
REDUCER_VALUES = 24_000_000
REDUCER_TIMEOUT = 20.0  # the library default: what a healthy peer waits if it misses the death
SENDER_TIMEOUT = 3.0
FREEZE_S = 0.3  # long enough for the others' sends to the victim to queue up
MEMBER_PORT = 31500
# leader_death: the lab group-fault test's deadlines; a round never takes longer than their sum
MATCHMAKING_TIMEOUT = 4.0
GROUP_SENDER_TIMEOUT = 2.0
GROUP_REDUCER_TIMEOUT = 4.0
ROUND_LIMIT = MATCHMAKING_TIMEOUT + GROUP_SENDER_TIMEOUT + GROUP_REDUCER_TIMEOUT + 5.0
ROUNDS_AFTER = 4  # rounds after the fault round (--quick: 2); a lingering declaration expires in ~5 s
# partition: the figures
PARTITION_S = 30.0
PARTITION_S_QUICK = 8.0
HEAL_TARGET_S = 30.0
WARMUP_EPOCHS = 3
WARMUP_EPOCHS_QUICK = 1
WARMUP_TIMEOUT = 90.0
BASELINE_EPOCHS = 2  # epochs timed with no fault, for the heal time's ratio


@dataclass
class Outcome:
    """One row of the table."""

    name: str
    ok: bool = False
    detect_s: float | None = None  # kill (or heal) until the healthy peers noticed
    baseline_s: float | None = None  # the same step with no fault
    rounds_lost: int | None = None
    note: str = ""
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.detect_s is None or not self.baseline_s:
            return None
        return self.detect_s / self.baseline_s


def spawn_members(lab: Lab, hosts: dict[int, Any], workdir: Path, script: str, argv_of: Callable[[int], list[str]]):
    """One member process per host (keyed by member index); waits for every ``ready``. Returns
    the processes by member index."""
    processes = {}
    for index, host in hosts.items():
        log = workdir / f"{script.removesuffix('.py')}{index}.log"
        processes[index] = lab.spawn(host, [f"benchmarks/faults_cases/{script}", *argv_of(index)], log)
    for index, process in processes.items():
        line = read_line(process, START_TIMEOUT)
        if line != "ready":
            tail = (workdir / f"{script.removesuffix('.py')}{index}.log").read_text(errors="replace")[-800:]
            raise RuntimeError(f"member {index} did not start ({line!r}):\n{tail}")
    return processes


def command(process, line: str) -> None:
    process.stdin.write(line.encode() + b"\n")
    process.stdin.flush()


def results(processes: dict[int, Any], timeout: float) -> dict[int, dict]:
    """One JSON line from each process, within ``timeout`` overall."""
    deadline = time.monotonic() + timeout
    out = {}
    for index, process in processes.items():
        out[index] = json.loads(read_line(process, max(0.1, deadline - time.monotonic())))
    return out


def dead_reducer(lab: Lab, workdir: Path, quick: bool) -> Outcome:
    outcome = Outcome("dead_reducer")
    values = REDUCER_VALUES
    hosts = [lab.add_host(f"r{index}", rate_mbit=None) for index in range(SIZE)]
    keys, peer_ids = member_keys(workdir)
    addresses = [f"{host.address}:{MEMBER_PORT}" for host in hosts]
    common = ["--keys", *keys, "--addresses", *addresses, "--values", str(values)]
    common += ["--sender-timeout", str(SENDER_TIMEOUT), "--reducer-timeout", str(REDUCER_TIMEOUT)]
    processes = spawn_members(
        lab, dict(enumerate(hosts)), workdir, "reducer_member.py", lambda i: ["--index", str(i), *common]
    )
    healthy = {i: p for i, p in processes.items() if i != 1}
    round_limit = SENDER_TIMEOUT + REDUCER_TIMEOUT + 30.0

    baseline_id = os.urandom(16).hex()
    for process in processes.values():
        command(process, f"{baseline_id} none")
    baseline = results(processes, round_limit)
    if not all(r["ok"] and not r["failed"] for r in baseline.values()):
        raise RuntimeError(f"the no-fault round failed: {baseline}")
    outcome.baseline_s = max(r["seconds"] for r in baseline.values())  # a round ends with its slowest peer

    fault_id = os.urandom(16).hex()
    for index, process in processes.items():
        command(process, f"{fault_id} {'freezes_sending' if index == 1 else 'none'}")
    victim = processes[1]
    started = time.monotonic()
    while process_state(victim.pid) != "T":  # it stops itself after its first part
        if time.monotonic() - started > round_limit:
            raise RuntimeError("member 1 never froze")
        time.sleep(0.005)
    time.sleep(FREEZE_S)
    victim.kill()
    killed = time.monotonic()
    after = results(healthy, round_limit)
    noticed = {i: r["finished_at"] - killed for i, r in after.items()}
    outcome.detect_s = max(noticed.values())
    lost = [i for i, r in after.items() if not r["ok"] or peer_ids[1] not in r["failed"]]
    outcome.rounds_lost = sum(not r["ok"] for r in after.values())
    outcome.ok = not lost
    if lost:
        outcome.error = f"members {lost} did not return a round that marks the victim failed: {after}"
    outcome.note = f"{values / 1e6:g}M floats/peer, frozen {FREEZE_S:g} s then SIGKILLed"
    outcome.details = {
        "values_per_peer": values,
        "noticed_s_per_peer": {str(i): round(s, 3) for i, s in noticed.items()},
        "step_s": {str(i): round(r["seconds"], 3) for i, r in after.items()},
        "reducer_timeout_s": REDUCER_TIMEOUT,
    }
    return outcome


def leader_death(lab: Lab, workdir: Path, quick: bool) -> Outcome:
    outcome = Outcome("leader_death")
    hosts = [lab.add_host(f"m{index}", rate_mbit=100) for index in range(SIZE)]
    keys, peer_ids = member_keys(workdir)
    # the grid rule makes the lowest peer ID the leader of a full group; the DHT bootstrap peer is
    # another member, so the others' routing tables do not hinge on the victim
    victim = _lowest(peer_ids)
    bootstrap = (victim + 1) % SIZE

    def argv(index: int) -> list[str]:
        flags = [
            "--index", str(index), "--key", keys[index], "--listen", f"{hosts[index].address}:{MEMBER_PORT}",
            "--run-id", "faultbench", "--matchmaking-timeout", str(MATCHMAKING_TIMEOUT),
            "--sender-timeout", str(GROUP_SENDER_TIMEOUT), "--reducer-timeout", str(GROUP_REDUCER_TIMEOUT),
        ]  # fmt: skip
        return flags if index == bootstrap else [*flags, "--initial-peer", f"{hosts[bootstrap].address}:{MEMBER_PORT}"]

    # the bootstrap peer must listen before the others dial it
    processes = spawn_members(lab, {bootstrap: hosts[bootstrap]}, workdir, "matchmaking_member.py", argv)
    others = {i: hosts[i] for i in range(SIZE) if i != bootstrap}
    processes.update(spawn_members(lab, others, workdir, "matchmaking_member.py", argv))

    def step_all(members: dict[int, Any]) -> dict[int, dict]:
        for process in members.values():
            command(process, "step")
        return results(members, ROUND_LIMIT)

    warmup = step_all(processes)
    baseline = step_all(processes)
    if not all(r["ok"] for r in baseline.values()):
        raise RuntimeError(f"the no-fault round failed: {baseline} (warm-up: {warmup})")
    outcome.baseline_s = max(r["seconds"] for r in baseline.values())

    healthy = {i: p for i, p in processes.items() if i != victim}
    for index, process in processes.items():
        command(process, "step lead-and-die" if index == victim else "step")
    formed = json.loads(read_line(processes[victim], ROUND_LIMIT))
    processes[victim].kill()
    killed = time.monotonic()
    if not formed.get("led"):
        raise RuntimeError(f"the victim (member {victim}) did not lead its group: {formed}")
    rounds = [results(healthy, ROUND_LIMIT)]
    noticed = {i: r["finished_at"] - killed for i, r in rounds[0].items()}
    for _ in range(ROUNDS_AFTER // 2 if quick else ROUNDS_AFTER):
        rounds.append(step_all(healthy))
    failed = {i: sum(not r[i]["ok"] for r in rounds) for i in healthy}
    outcome.rounds_lost = max(failed.values())
    outcome.detect_s = max(noticed.values())
    outcome.ok = True
    outcome.note = f"{len(rounds)} rounds from the kill; group of {formed.get('size')} formed"
    outcome.details = {
        "victim": victim,
        "failed_rounds_per_peer": {str(i): n for i, n in failed.items()},
        "noticed_s_per_peer": {str(i): round(s, 3) for i, s in noticed.items()},
        "rounds": [
            {str(i): (f"ok, group of {r['size']}" if r["ok"] else r["error"][:120]) for i, r in one.items()}
            for one in rounds
        ],
    }
    return outcome


def _lowest(peer_ids: list[str]) -> int:
    """The member the grid rule makes leader: the lowest raw peer ID."""
    from peer import PeerID

    return min(range(len(peer_ids)), key=lambda i: PeerID.from_string(peer_ids[i]).to_bytes())


def partition(lab: Lab, workdir: Path, quick: bool) -> Outcome:
    split_s = PARTITION_S_QUICK if quick else PARTITION_S
    warmup_epochs = WARMUP_EPOCHS_QUICK if quick else WARMUP_EPOCHS
    outcome = Outcome("partition")
    outcome.note = f"2 of 5 cut for {split_s:g} s" + (" (--quick; the issue's figure is 30 s)" if quick else "")
    hosts = [lab.add_host(f"p{index}", rate_mbit=100) for index in range(SIZE)]
    peers = lab.start_swarm(hosts, run_id="faultbench-partition", extra=["--task", "digits"])
    lab.wait_for(lambda: min(e or 0 for e in epochs(peers)) >= warmup_epochs, WARMUP_TIMEOUT, "warm-up epochs")
    # the no-fault pace: seconds per epoch of the whole swarm, just before the cut
    start_epoch = max(e or 0 for e in epochs(peers))
    seconds = lab.wait_for(
        lambda: max(e or 0 for e in epochs(peers)) >= start_epoch + BASELINE_EPOCHS, WARMUP_TIMEOUT, "baseline epochs"
    )
    outcome.baseline_s = seconds / BASELINE_EPOCHS
    known_before = min((peer.status() or {}).get("peers_known") or 0 for peer in peers)

    for host in hosts[3:]:
        host.cut()
    cut_at = time.monotonic()
    time.sleep(split_s / 2)
    middle = epochs(peers)
    time.sleep(max(0.0, split_s - (time.monotonic() - cut_at)))
    during = epochs(peers)
    for host in hosts[3:]:
        host.heal()
    healed = time.monotonic()
    at_heal = [e or 0 for e in during]

    def one_swarm() -> bool:
        statuses = [peer.status() for peer in peers]
        if None in statuses:
            return False
        current = [s.get("epoch") or 0 for s in statuses]
        if max(current) - min(current) > 1:  # polled one after another: 1 apart is one epoch
            return False
        if any((s.get("peers_known") or 0) < known_before for s in statuses):
            return False
        # a group of 4 or more cannot form on either side of the cut: one after healing spans it
        return any(
            group_of(peer) >= 4 and ((s.get("last_averaging") or {}).get("epoch") or 0) > at_heal[i]
            for i, (peer, s) in enumerate(zip(peers, statuses, strict=True))
        )

    try:
        lab.wait_for(one_swarm, HEAL_TARGET_S * (1 if quick else 2), "one swarm after healing", interval=0.25)
        outcome.detect_s = time.monotonic() - healed
        outcome.ok = True
    except AssertionError:
        outcome.error = f"not one swarm within {HEAL_TARGET_S * (1 if quick else 2):g} s of healing"
    stalled = [i for i, (a, b) in enumerate(zip(middle, during, strict=True)) if a is None or b is None or b <= a]
    outcome.details = {
        "split_s": split_s,
        "epochs_half_way": middle,
        "epochs_at_heal": during,
        "epochs_after": epochs(peers),
        "peers_known_before": known_before,
        "no_epoch_in_second_half_of_split": stalled,
    }
    if stalled:
        outcome.note += f"; peers {stalled} made no epoch in the split's second half"
    return outcome


SCENARIOS: dict[str, Callable[[Lab, Path, bool], Outcome]] = {
    "dead_reducer": dead_reducer,
    "leader_death": leader_death,
    "partition": partition,
}


def run_scenario(name: str, workdir: Path, quick: bool) -> Outcome:
    """One scenario in its own lab, whose namespaces are gone when this returns or raises."""
    scenario_dir = workdir / name
    scenario_dir.mkdir()
    started = time.monotonic()
    try:
        with Lab(scenario_dir, tag=name.replace("_", "")[:10]) as lab:
            outcome = SCENARIOS[name](lab, scenario_dir, quick)
    except Exception as error:  # a failed scenario is a row of the table, never a crash
        outcome = Outcome(name, error=f"{type(error).__name__}: {error}".strip()[:600])
        outcome.details["traceback"] = traceback.format_exc(limit=4)[-1500:]
    outcome.details["wall_s"] = round(time.monotonic() - started, 1)
    return outcome


def fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def print_table(outcomes: list[Outcome]) -> None:
    print(f"{'scenario':<13} {'ok':<4} {'noticed_s':>9} {'no_fault_s':>10} {'ratio':>6} {'rounds_lost':>11}  note")
    for o in outcomes:
        print(
            f"{o.name:<13} {'yes' if o.ok else 'FAIL':<4} {fmt(o.detect_s):>9} {fmt(o.baseline_s):>10} "
            f"{fmt(o.ratio):>6} {fmt(o.rounds_lost):>11}  {o.note}"
        )
        if o.error:
            print(f"  error: {o.error.splitlines()[0]}")
    print(
        "noticed_s: kill until the slowest healthy peer's step returned (partition: heal until one "
        "swarm); no_fault_s: the same round without a fault (partition: one epoch before the cut); "
        "ratio = noticed_s / no_fault_s"
    )


def summary(outcomes: list[Outcome], quick: bool, interrupted: bool) -> dict[str, Any]:
    by_name = {o.name: o for o in outcomes}

    def figure(name: str, attribute: str) -> Any:
        o = by_name.get(name)
        return getattr(o, attribute) if o is not None and o.ok else None

    heal = figure("partition", "detect_s")
    return {
        "dead_reducer_detect_s": _round(figure("dead_reducer", "detect_s")),
        "leader_death_failed_rounds": figure("leader_death", "rounds_lost"),
        "partition_heal_s": _round(heal),
        "partition_s": (by_name["partition"].details.get("split_s") if "partition" in by_name else None),
        "targets": {"dead_reducer_detect_s": 0.5, "leader_death_failed_rounds": 0, "partition_heal_s": HEAL_TARGET_S},
        "quick": quick,
        "interrupted": interrupted,
        "scenarios": {
            o.name: {
                "ok": o.ok,
                "noticed_s": _round(o.detect_s),
                "no_fault_s": _round(o.baseline_s),
                "ratio": _round(o.ratio),
                "rounds_lost": o.rounds_lost,
                "note": o.note,
                "error": o.error,
                **{k: v for k, v in o.details.items() if k != "traceback"},
            }
            for o in outcomes
        },
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="within 120 s: shorter partition, fewer rounds")
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) even when all passed")
    args = parser.parse_args(argv)
    reason = lab_unavailable()
    if reason is not None:
        print(f"faults benchmark cannot run: {reason}")
        return 2

    def terminate(signum, frame):  # SIGTERM takes the same clean-up path as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    remove_leftovers()  # namespaces of an interrupted earlier run
    workdir = Path(tempfile.mkdtemp(prefix="peerd-faults-"))
    outcomes: list[Outcome] = []
    interrupted = False
    try:
        for name in args.only:
            outcome = run_scenario(name, workdir, args.quick)
            outcomes.append(outcome)
            print(f"# {name}: {'ok' if outcome.ok else 'FAILED'} in {outcome.details['wall_s']} s", flush=True)
    except KeyboardInterrupt:  # the lab's ``with`` already removed its namespaces
        interrupted = True
    print_table(outcomes)
    failed = interrupted or not all(o.ok for o in outcomes)
    if failed or args.keep:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary(outcomes, args.quick, interrupted)), flush=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
