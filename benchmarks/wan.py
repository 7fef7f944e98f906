"""Training over slow links: the all-reduce against the line-rate bound, and the ``textlm`` task's
compute utilisation, with every host on its own shaped link.

    python benchmarks/wan.py --quick              # within 180 s on 2 busy cores, 100 Mbit/s
    python benchmarks/wan.py --rate 20mbit        # 20 Mbit/s links, longer windows
    python benchmarks/wan.py --only allreduce     # one part
    python benchmarks/wan.py --only allreduce --hivemind /work/hmvenv/bin/python   # with Hivemind's defaults

Runs in the network lab (``tests/support/netlab.py``: one network namespace per host on a private bridge,
each host's link shaped by tbf on both ends; real processes started with ``ip netns exec``), so it
needs root, ``ip`` and ``tc``; without them it prints one line saying what is missing and exits 2.

Parts (rows of the table):
  raw_tcp        one plain TCP stream host 0 -> host 1: the wire's own speed, for reference.
  raw_alltoall   4 hosts, each sending the all-reduce's bytes to each other host at once with plain
                 TCP and no dependencies (``wan_cases/raw_alltoall.py``): what the kernel alone does
                 with the all-reduce's traffic matrix, against the same line-rate bound. Two
                 schedules, rounds alternating: ``parallel`` (a stream per peer, sharing the link as
                 TCP shares it) and ``rotating`` (one destination at a time in part-sized turns,
                 every host sending to a different host at each turn). Figures:
                 ``raw_alltoall_parallel_fraction`` and ``raw_alltoall_rotating_fraction`` = bound ÷
                 median round time (first byte sent to last byte received, all hosts).
  allreduce      4 peers, each a DHT node with a ``GroupAverager`` of 4,194,304 float32 values
                 (16 MiB; ``faults_cases/matchmaking_member.py``), stepping together, in two
                 configurations whose steps take turns on the same hosts. First, ``defaults``: the
                 public API as a user embeds it, nothing declared: the aggregation a public swarm
                 uses (centered-clip with reducer checks), the uplink measured by the rounds
                 themselves (``averaging/uplink.py``), matchmaking's own settle time; its figures are
                 ``defaults_*``. Beside it, ``tuned``: the aggregation ``--aggregation`` names (the
                 exact mean by default), the uplink declared as the link's rate (as ``peerd join
                 --uplink-mbit``; ``--no-uplink``: measured, as in the defaults) and a LAN's settle
                 time (0.3 s); its figures keep the plain names (before the defaults ran beside
                 it, the part's one configuration took ``--aggregation auto`` by default). The
                 baseline is the line-rate bound of a butterfly all-reduce, 2·(n−1)/n·bytes at the
                 nominal rate (2.01 s at 100 Mbit/s).
                 Figures: ``allreduce_line_rate_fraction`` = bound ÷ median all-reduce time
                 (group formed until the round is done, slowest peer), and
                 ``step_line_rate_fraction`` = bound ÷ median whole step. Both configurations
                 step as the public ``Averager`` does (``averaging/step_ahead.py``): once steps
                 come in a rhythm, a step's group forms before the step is called (in this part's
                 turns a configuration's steps come 0, 1 or 2 other steps apart; a step sooner
                 than any recent interval matches itself). ``--match-at-step``: every step matches
                 when it is called, as Hivemind's ``step()`` does by default.
                 With ``--hivemind PYTHON`` (or ``$PEERD_WAN_HIVEMIND``), 4 Hivemind 1.1.12
                 ``DecentralizedAverager``s of the same tensor run on the same hosts
                 (``wan_cases/hivemind_averager.py``: ``target_group_size=4``,
                 ``min_matchmaking_time=0.5``, no compression), stepped in turn with peerd's, the
                 order alternating. ``hivemind_step_s``: its whole ``step()``, which matches at the
                 step (its default; compare with ``--match-at-step`` for like with like);
                 ``hivemind_allreduce_s``: from the step entering its ``RUNNING_ALLREDUCE`` stage
                 (group formed) to the step's end (as ``allreduce_s``).
                 ``step_vs_hivemind`` and ``allreduce_vs_hivemind`` = peerd's time ÷ Hivemind's
                 (< 1: peerd is faster; ``defaults_step_vs_hivemind`` for the defaults). Without the
                 flag they are null. PYTHON is an interpreter
                 with Hivemind installed apart from the project's environment, e.g.
                     python -m venv --system-site-packages /work/hmvenv   # reuses the installed torch
                     /work/hmvenv/bin/pip install hivemind==1.1.12        # its wheel bundles p2pd
  solo           4 trainers with no swarm (``wan_cases/solo_trainer.py``), one per host, side by
                 side on the same CPU: the fair baseline on a shared machine. Figure: samples/s
                 per trainer.
  local_updates  4 ``peerd join --task textlm --mode local-updates --uplink-mbit RATE`` peers, and
  collaborative  the same in collaborative mode with ``--delay-updates`` and a swarm batch of
                 ``COLLABORATIVE_BATCH``. Figures: samples/s per peer ÷ the solo figure
                 (``utilization_*``), bytes sent per sample, held-out bits per byte at the end.
  single         (not with ``--quick``) one trainer alone, for as many samples as the
                 local-updates swarm had taken when its best peer last evaluated (that peer's
                 samples then × the number of peers): ``loss_ratio`` = the swarm's held-out bits
                 per byte ÷ this trainer's.

The utilisations compare wall-clock rates of parts run one after the other, which other load on a
shared machine moves; ``cpu_utilization_*`` compare samples per CPU second instead (each process's
user and system time from ``/proc``, all its threads): the share of a peer's CPU that trains, the
rest being averaging, compression, encryption and the DHT. On an otherwise idle machine where the
four processes keep both cores busy, the two agree.

The last line is one JSON object: ``allreduce_line_rate_fraction``, ``step_line_rate_fraction``,
``utilization_local_updates``, ``utilization_collaborative``, ``cpu_utilization_local_updates``,
``cpu_utilization_collaborative``, ``bytes_per_sample`` (local updates), ``loss_ratio``,
``rate_mbit``, the Hivemind figures, and per-part details; null where a part failed or did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer import LOCAL_DIFFICULTY, Identity  # noqa: E402

os.environ.setdefault("PEERD_NODE_ID_DIFFICULTY", str(LOCAL_DIFFICULTY))  # as tests/conftest.py

from benchmarks.wan_cases import hivemind_baseline  # noqa: E402
from peerd.textlm import MODEL_SIZES, ByteTransformer  # noqa: E402
from tests.lab.test_lab_group_faults import read_line  # noqa: E402
from tests.support.netlab import Lab, lab_unavailable, remove_leftovers  # noqa: E402

PEERS = 4
VALUES = 4_194_304  # 16 MiB of float32, the figure
MEMBER_PORT = 31500
RAW_PORT = 31600
RAW_BYTES = 64 << 20
ALLTOALL_PORT = 31700
# the all-reduce's parts at this size: a shard of 4 MiB in 8 parts (averaging/partition.py)
ALLTOALL_CHUNK = 512 * 1024
START_TIMEOUT = 90.0  # four interpreters importing torch on 2 busy cores
MODEL_SIZE = "small"
# Collaborative mode's swarm batch here: 4 batches of 16 per peer per epoch, so that an epoch's
# compute (~3 s on this machine) can hide one round of averaging (~1.5 s at 100 Mbit/s).
COLLABORATIVE_BATCH = 256


def raw_alltoall(lab: Lab, workdir: Path, rate: float, quick: bool) -> dict[str, Any]:
    hosts = [lab.add_host(f"t{index}", rate_mbit=rate) for index in range(PEERS)]
    per_peer = 2 * VALUES * 4 // PEERS  # reduce-scatter and all-gather bytes from one host to one other
    script = "benchmarks/wan_cases/raw_alltoall.py"
    processes = spawn_all(
        lab, hosts, workdir, script, lambda i: [str(i), str(ALLTOALL_PORT), str(per_peer), str(ALLTOALL_CHUNK)]
    )
    for index, process in enumerate(processes):
        others = [host.address for other, host in enumerate(hosts) if other != index]
        tell([process], "connect " + " ".join(others))
    for process in processes:
        if read_line(process, 60) != "connected":
            raise RuntimeError("the all-to-all hosts did not connect")
    bound = line_rate_bound_s(VALUES, PEERS, rate)
    times: dict[str, list[float]] = {"parallel": [], "rotating": []}
    for number in range(4 if quick else 10):
        schedule = "parallel" if number % 2 == 0 else "rotating"
        tell(processes, f"round {schedule}")
        outcome = [json.loads(read_line(process, 20 * bound + 30)) for process in processes]
        times[schedule].append(max(r["finished"] for r in outcome) - min(r["started"] for r in outcome))
    return {
        "bound_s": bound,
        **{f"{name}_s": statistics.median(seconds) for name, seconds in times.items()},
        **{f"{name}_fraction": bound / statistics.median(seconds) for name, seconds in times.items()},
        "rounds": times,
    }


def line_rate_bound_s(values: int, peers: int, rate_mbit: float) -> float:
    """Seconds a butterfly all-reduce needs at least: each peer sends and receives 2·(n−1)/n of
    the tensor (reduce-scatter, then all-gather) through its own link."""
    return 2 * (peers - 1) / peers * values * 4 * 8 / (rate_mbit * 1e6)


def spawn_all(lab: Lab, hosts, workdir: Path, script: str, argv_of, name: str = "", first: int = 0) -> list:
    """Start ``script`` on each host, with ``argv_of(index)``; logs named by ``name`` (default: the
    script's) and the index counted from ``first``."""
    processes = []
    log_of = {index: workdir / f"{name or Path(script).stem}{first + index}.log" for index in range(len(hosts))}
    for index, host in enumerate(hosts):
        processes.append(lab.spawn(host, [script, *argv_of(index)], log_of[index]))
    for index, process in enumerate(processes):
        line = read_line(process, START_TIMEOUT)
        if line != "ready":
            tail = log_of[index].read_text(errors="replace")[-800:]
            raise RuntimeError(f"{script} {index} did not start ({line!r}):\n{tail}")
    return processes


def tell(processes, line: str) -> None:
    for process in processes:
        process.stdin.write(line.encode() + b"\n")
        process.stdin.flush()


def raw_tcp(lab: Lab, workdir: Path, rate: float, quick: bool) -> dict[str, Any]:
    sender, receiver = lab.add_host("raw0", rate_mbit=rate), lab.add_host("raw1", rate_mbit=rate)
    script = "benchmarks/wan_cases/raw_tcp.py"
    server = lab.spawn(receiver, [script, "recv", str(RAW_PORT)], workdir / "raw_recv.log")
    if read_line(server, START_TIMEOUT) != "ready":
        raise RuntimeError("the raw TCP receiver did not start")
    total = RAW_BYTES // 4 if quick else RAW_BYTES
    lab.run_in(sender, [script, "send", receiver.address, str(RAW_PORT), str(total)], timeout=120)
    measured = json.loads(read_line(server, 60))
    return {"mbit_s": measured["bytes"] * 8 / measured["seconds"] / 1e6, "bytes": measured["bytes"]}


# The all-reduce part's configurations, stepped in turn on the same hosts. ``defaults``: the public
# API as a user embeds it, nothing declared (the uplink measured by the rounds, the aggregation a
# public swarm uses, matchmaking's own settle time); ``tuned``: the uplink declared as the link's
# rate and the part's ``--aggregation``, matchmaking settling 0.3 s as on a LAN.
CONFIGURATIONS = ("defaults", "tuned")


def allreduce(
    lab: Lab,
    workdir: Path,
    rate: float,
    quick: bool,
    hivemind: str | None,
    aggregation: str = "mean",
    declare_uplink: bool = True,
    step_ahead: bool = True,
) -> dict[str, Any]:
    """Both configurations (and Hivemind's, with ``hivemind``), their steps taking turns: the
    tuned one's figures at the top level, the defaults' under ``defaults``."""
    hosts = [lab.add_host(f"a{index}", rate_mbit=rate) for index in range(PEERS)]
    keys = []
    for index in range(PEERS * len(CONFIGURATIONS)):
        key = workdir / f"allreduce{index}.key"
        Identity.generate().save(key)
        keys.append(str(key))
    bound = line_rate_bound_s(VALUES, PEERS, rate)
    round_limit = 20 * bound + 30  # a step that takes this long has failed, whatever the cause

    def argv(configuration: int, index: int) -> list[str]:
        port = MEMBER_PORT + configuration
        flags = [
            "--index", str(index), "--key", keys[configuration * PEERS + index],
            "--listen", f"{hosts[index].address}:{port}", "--run-id", f"wan-{CONFIGURATIONS[configuration]}",
            "--group-size", str(PEERS), "--values", str(VALUES), "--matchmaking-timeout", "15",
            "--sender-timeout", str(10 * bound + 10), "--reducer-timeout", str(20 * bound + 20),
        ]  # fmt: skip
        if step_ahead:  # as the public ``Averager`` steps
            flags += ["--step-ahead"]
        if CONFIGURATIONS[configuration] == "defaults":
            flags += ["--settle", "default"]
        else:
            flags += ["--settle", "0.3", "--aggregation", aggregation]
            if declare_uplink:  # as `peerd join --uplink-mbit RATE` on a link of that rate
                flags += ["--uplink-mbit", str(rate)]
        return [*flags, "--initial-peer", f"{hosts[0].address}:{port}"] if index else flags

    script = "benchmarks/faults_cases/matchmaking_member.py"
    members = []
    for configuration, name in enumerate(CONFIGURATIONS):
        started = spawn_all(lab, hosts[:1], workdir, script, lambda i, c=configuration: argv(c, i), name)
        started += spawn_all(lab, hosts[1:], workdir, script, lambda i, c=configuration: argv(c, i + 1), name, 1)
        members.append(started)
    baseline = hivemind and hivemind_baseline.Baseline(lab, hosts, workdir, hivemind, VALUES, START_TIMEOUT)
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGURATIONS}
    failures: dict[str, list] = {name: [] for name in CONFIGURATIONS}
    try:
        for number in range(1 + (3 if quick else 8)):  # the first step warms up connections and the DHT
            if baseline and number % 2:  # alternate which goes first: neither always follows the other
                baseline.step(number, round_limit)
            order = list(enumerate(CONFIGURATIONS))
            for configuration, name in order if number % 2 else order[::-1]:
                step = one_step(members[configuration], round_limit)
                if isinstance(step, list):
                    failures[name].append(step)
                elif number > 0:
                    steps[name].append(step)
            if baseline and not number % 2:
                baseline.step(number, round_limit)
    finally:
        if baseline:
            baseline.stop()
    figures = {name: step_figures(steps[name], failures[name], bound) for name in CONFIGURATIONS}
    return {
        **figures["tuned"],
        "defaults": figures["defaults"],
        "hivemind": baseline.figures(bound) if baseline else None,
    }


def one_step(processes: list, limit: float) -> dict[str, float] | list:
    """One step of every member: its times (slowest peer's), or what went wrong."""
    tell(processes, "step")
    deadline = time.monotonic() + limit
    outcome = [json.loads(read_line(p, max(0.1, deadline - time.monotonic()))) for p in processes]
    if not all(r["ok"] and r["size"] == PEERS and not r["failed"] for r in outcome):
        return [r.get("error") or r.get("failed") or r.get("size") for r in outcome]
    return {"step_s": max(r["seconds"] for r in outcome), "allreduce_s": max(r["allreduce_s"] for r in outcome)}


def step_figures(steps: list[dict[str, float]], failures: list, bound: float) -> dict[str, Any]:
    if not steps:
        return {"failed_steps": len(failures), "failures": failures[:3], "error": f"no step averaged all {PEERS} peers"}
    allreduce_s = statistics.median(s["allreduce_s"] for s in steps)
    step_s = statistics.median(s["step_s"] for s in steps)
    return {
        "bound_s": bound,
        "allreduce_s": allreduce_s,
        "step_s": step_s,
        "allreduce_line_rate_fraction": bound / allreduce_s,
        "step_line_rate_fraction": bound / step_s,
        "steps": steps,
        "failed_steps": len(failures),
        "failures": failures[:3],
    }


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far, from ``/proc`` (``ip netns
    exec`` becomes the command it runs, so the pid is the trainer's own)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rate(samples: list[tuple[float, int]]) -> float:
    """Samples per second between the first and the last (time, samples) reading."""
    (t0, s0), (t1, s1) = samples[0], samples[-1]
    return (s1 - s0) / (t1 - t0)


def solo(lab: Lab, workdir: Path, rate: float, window: float, model_size: str = MODEL_SIZE) -> dict[str, Any]:
    hosts = [lab.add_host(f"s{index}", rate_mbit=rate) for index in range(PEERS)]
    script = "benchmarks/wan_cases/solo_trainer.py"
    argv = ["--shards", str(PEERS), "--model-size", model_size, "--report-every", "1"]
    processes = spawn_all(lab, hosts, workdir, script, lambda i: ["--shard", str(i), *argv])
    tell(processes, "go")
    readings: list[list[tuple[float, int]]] = [[] for _ in processes]
    cpu: list[list[float]] = [[] for _ in processes]  # CPU seconds as each reading came in
    warm = 3.0  # the first seconds include the first steps' allocations
    while not all(r and r[-1][0] >= warm + window for r in readings):
        for index, process in enumerate(processes):
            report = json.loads(read_line(process, 60))
            if report["seconds"] >= warm:
                readings[index].append((report["seconds"], report["samples"]))
                cpu[index].append(cpu_seconds(process.pid))
    for process in processes:
        process.kill()
    rates = [_rate(r) for r in readings]
    samples = sum(r[-1][1] - r[0][1] for r in readings)
    return {
        "samples_per_s_per_trainer": statistics.mean(rates),
        "per_trainer": rates,
        "samples_per_cpu_s": samples / sum(c[-1] - c[0] for c in cpu),
    }


def _status_all(peers, patience: float = 30.0) -> list[dict]:
    """Every peer's ``/status``; a peer busy loading its task may miss a few seconds of it."""
    deadline = time.monotonic() + patience
    statuses = []
    for peer in peers:
        while (status := peer.status(timeout=5)) is None:
            if not peer.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the peer on {peer.host.name} stopped answering /status:\n{peer.tail(5)}")
            time.sleep(0.25)  # a refused connection returns at once: do not spin on it
        statuses.append(status)
    return statuses


def swarm(
    lab: Lab,
    workdir: Path,
    rate: float,
    window: float,
    mode: str,
    quick: bool,
    declare_uplink: bool = True,
    model_size: str = MODEL_SIZE,
    compression: str | None = None,
    aggregation: str = "auto",
) -> dict[str, Any]:
    hosts = [lab.add_host(f"{mode[:5]}{index}", rate_mbit=rate) for index in range(PEERS)]
    extra = ["--task", "textlm", "--model-size", model_size, "--mode", mode]
    if compression is not None:  # with the tuned all-reduce's aggregation (a sparse codec needs the mean)
        extra += ["--compression", compression, "--aggregation", aggregation]
    if declare_uplink:
        extra += ["--uplink-mbit", str(rate)]
    if mode == "local-updates" and quick:
        extra += ["--local-steps", "10"]
    if mode == "collaborative":  # as over slow links: each epoch's averaging overlaps the next epoch
        extra += ["--delay-updates", "--target-batch-size", str(COLLABORATIVE_BATCH)]
    peers = lab.start_swarm(hosts, run_id=f"wan-{mode}", extra=extra)
    # warm-up: every peer has taken a step (a round, in local-updates mode) with the others
    deadline = first_round_deadline(model_size)
    lab.wait_for(lambda: all((s.get("epoch") or 0) >= 1 for s in _status_all(peers)), deadline, "a first epoch")
    cpu_before, before, t0 = [cpu_seconds(p.process.pid) for p in peers], _status_all(peers), time.monotonic()
    time.sleep(window)
    after, t1, cpu_after = _status_all(peers), time.monotonic(), [cpu_seconds(p.process.pid) for p in peers]
    samples = [a["samples"] - b["samples"] for a, b in zip(after, before, strict=True)]
    evaluated = [a for a in after if a.get("bits_per_byte") and a.get("evaluated_samples")]
    best = min(evaluated, key=lambda a: a["bits_per_byte"], default=None)
    sent = sum(a["bytes_sent"] - b["bytes_sent"] for a, b in zip(after, before, strict=True))
    result = {
        "samples_per_s_per_peer": statistics.mean(samples) / (t1 - t0),
        "samples_per_cpu_s": sum(samples) / sum(a - b for a, b in zip(cpu_after, cpu_before, strict=True)),
        "bytes_per_sample": sent / max(1, sum(samples)),
        "epochs": [a["epoch"] for a in after],
        "bits_per_byte": best["bits_per_byte"] if best else None,
        # the swarm's samples when that figure was taken: the peers train at about one speed
        "total_samples": best["evaluated_samples"] * len(after) if best else sum(a["samples"] for a in after),
    }
    for peer in peers:
        peer.stop()
    return result


def first_round_deadline(model_size: str) -> float:
    """Seconds the swarm parts wait for every peer's first round: 120 for the small model (four
    peers loading it and taking a round's steps on 2 cores), in proportion for a larger model,
    whose steps take about that much longer."""
    small, chosen = (
        sum(p.numel() for p in ByteTransformer(MODEL_SIZES[size]).parameters()) for size in ("small", model_size)
    )
    return 120.0 * max(1.0, chosen / small)


def single(lab: Lab, workdir: Path, rate: float, samples: int, model_size: str = MODEL_SIZE) -> dict[str, Any]:
    host = lab.add_host("single", rate_mbit=rate)
    script = "benchmarks/wan_cases/solo_trainer.py"
    argv = ["--model-size", model_size, "--samples", str(samples), "--report-every", "1e9"]
    (process,) = spawn_all(lab, [host], workdir, script, lambda i: argv)
    tell([process], "go")
    done = json.loads(read_line(process, 1800))
    return {"samples": done["samples"], "bits_per_byte": done["eval"]["bits_per_byte"]}


def run_part(name: str, workdir: Path, body) -> tuple[dict[str, Any] | None, str | None]:
    """One part in its own lab; a failure is a row of the table, never a crash."""
    part_dir = workdir / name
    part_dir.mkdir()
    started = time.monotonic()
    try:
        with Lab(part_dir, tag=name.replace("_", "")[:10]) as lab:
            result = body(lab, part_dir)
        print(f"# {name}: done in {time.monotonic() - started:.0f} s", flush=True)
        return result, None
    except Exception as error:
        print(f"# {name}: FAILED in {time.monotonic() - started:.0f} s: {error}", flush=True)
        (part_dir / "traceback.txt").write_text(traceback.format_exc())
        return None, f"{type(error).__name__}: {error}"[:400]


def _figure(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def mbit_per_s(text: str) -> float:
    """``20``, ``20mbit`` or ``1gbit`` as Mbit/s (tc's spelling, as the issue writes rates)."""
    lowered = text.strip().lower()
    for suffix, scale in (("gbit", 1000.0), ("mbit", 1.0)):
        if lowered.endswith(suffix):
            return float(lowered[: -len(suffix)]) * scale
    return float(lowered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="within 180 s: short windows, fewer steps")
    parser.add_argument(
        "--rate", type=mbit_per_s, default=100.0, help="Mbit/s of every host's link: 20 or 20mbit (default 100)"
    )
    parts = ["raw_tcp", "raw_alltoall", "allreduce", "solo", "local_updates", "collaborative", "single"]
    parser.add_argument("--only", nargs="+", choices=parts, default=None)
    parser.add_argument("--model-size", default=MODEL_SIZE, help=f"textlm's size (default {MODEL_SIZE})")
    parser.add_argument(
        "--compression",
        metavar="CODEC",
        help="the local-updates part's codec (default: peerd's, blockwise_8bit); given, that part also takes "
        "--aggregation",
    )
    parser.add_argument("--window", type=float, default=None, help="seconds each training part is measured")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument(
        "--hivemind",
        metavar="PYTHON",
        default=os.environ.get("PEERD_WAN_HIVEMIND"),
        help="an interpreter with hivemind installed: the all-reduce part also steps Hivemind's averager "
        "(default: $PEERD_WAN_HIVEMIND; none: no baseline)",
    )
    parser.add_argument(
        "--aggregation",
        choices=["auto", "mean", "centered-clip", "centered-clip-mixed"],
        default="mean",
        help="the tuned all-reduce's aggregation (mean, the default: the exact mean, as Hivemind averages; "
        "auto: what a public swarm uses, centered-clip with reducer checks). The defaults' is always auto",
    )
    parser.add_argument(
        "--no-uplink",
        action="store_true",
        help="the tuned all-reduce and the training parts do not declare the uplink (by default they "
        "declare the link's rate, as `peerd join --uplink-mbit`; undeclared, the rounds measure it: "
        "averaging/uplink.py)",
    )
    parser.add_argument(
        "--match-at-step",
        action="store_true",
        help="the all-reduce's peers find each step's group at the step (by default they step as the public "
        "Averager does: once steps come in a rhythm, each finds its group formed ahead, averaging/step_ahead.py)",
    )
    args = parser.parse_args(argv)
    reason = lab_unavailable()
    if reason is not None:
        print(f"wan benchmark cannot run: {reason}")
        return 2
    chosen = args.only or [p for p in parts if not (args.quick and p == "single")]
    window = args.window or (20.0 if args.quick else 90.0)

    def terminate(signum, frame):  # SIGTERM takes the same clean-up path as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    remove_leftovers()
    workdir = Path(tempfile.mkdtemp(prefix="peerd-wan-"))
    results: dict[str, dict[str, Any] | None] = {}
    errors: dict[str, str] = {}
    bodies = {
        "raw_tcp": lambda lab, d: raw_tcp(lab, d, args.rate, args.quick),
        "raw_alltoall": lambda lab, d: raw_alltoall(lab, d, args.rate, args.quick),
        "allreduce": lambda lab, d: allreduce(
            lab, d, args.rate, args.quick, args.hivemind, args.aggregation, not args.no_uplink, not args.match_at_step
        ),
        "solo": lambda lab, d: solo(lab, d, args.rate, window, args.model_size),
        "local_updates": lambda lab, d: swarm(
            lab,
            d,
            args.rate,
            window,
            "local-updates",
            args.quick,
            not args.no_uplink,
            args.model_size,
            args.compression,
            args.aggregation,
        ),
        "collaborative": lambda lab, d: swarm(
            lab, d, args.rate, window, "collaborative", args.quick, not args.no_uplink
        ),
        "single": lambda lab, d: single(
            lab, d, args.rate, (results.get("local_updates") or {})["total_samples"], args.model_size
        ),
    }
    interrupted = False
    try:
        for name in chosen:
            results[name], error = run_part(name, workdir, bodies[name])
            if error:
                errors[name] = error
    except KeyboardInterrupt:
        interrupted = True
    summary = summarize(results, args.rate, window)
    reduced = results.get("allreduce") or {}
    for name, figures in (("defaults", reduced.get("defaults") or {}), ("tuned", reduced)):
        if figures.get("error"):  # a configuration that never averaged is the part's error too
            errors[f"allreduce_{name}"] = figures["error"]
    summary.update(
        quick=args.quick,
        interrupted=interrupted,
        errors=errors,
        aggregation=args.aggregation,
        uplink_declared=not args.no_uplink,
        step_ahead=not args.match_at_step,
        model_size=args.model_size,
        compression=args.compression,
    )
    print_table(summary, results)
    if errors or interrupted or args.keep:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 130 if interrupted else 0


def summarize(results: dict[str, dict[str, Any] | None], rate: float, window: float) -> dict[str, Any]:
    reduce_ = results.get("allreduce") or {}
    solo_rate = (results.get("solo") or {}).get("samples_per_s_per_trainer")
    local = results.get("local_updates") or {}
    collaborative = results.get("collaborative") or {}
    single_ = results.get("single") or {}

    def utilization(part: dict[str, Any]) -> float | None:
        if not solo_rate or "samples_per_s_per_peer" not in part:
            return None
        return part["samples_per_s_per_peer"] / solo_rate

    hivemind = reduce_.get("hivemind") or {}

    def versus(figure: str) -> float | None:  # peerd's time ÷ Hivemind's: < 1 where peerd is faster
        return reduce_[figure] / hivemind[figure] if reduce_.get(figure) and hivemind.get(figure) else None

    solo_per_cpu_s = (results.get("solo") or {}).get("samples_per_cpu_s")

    def cpu_utilization(part: dict[str, Any]) -> float | None:
        if not solo_per_cpu_s or "samples_per_cpu_s" not in part:
            return None
        return part["samples_per_cpu_s"] / solo_per_cpu_s

    loss_ratio = None
    if local.get("bits_per_byte") and single_.get("bits_per_byte"):
        loss_ratio = local["bits_per_byte"] / single_["bits_per_byte"]
    defaults = reduce_.get("defaults") or {}

    def defaults_versus(figure: str) -> float | None:
        return defaults[figure] / hivemind[figure] if defaults.get(figure) and hivemind.get(figure) else None

    return {
        "defaults_step_line_rate_fraction": _figure(defaults.get("step_line_rate_fraction")),
        "defaults_allreduce_line_rate_fraction": _figure(defaults.get("allreduce_line_rate_fraction")),
        "defaults_step_s": _figure(defaults.get("step_s")),
        "defaults_allreduce_s": _figure(defaults.get("allreduce_s")),
        "defaults_step_vs_hivemind": _figure(defaults_versus("step_s")),
        "allreduce_line_rate_fraction": _figure(reduce_.get("allreduce_line_rate_fraction")),
        "step_line_rate_fraction": _figure(reduce_.get("step_line_rate_fraction")),
        "utilization_local_updates": _figure(utilization(local)),
        "utilization_collaborative": _figure(utilization(collaborative)),
        "cpu_utilization_local_updates": _figure(cpu_utilization(local)),
        "cpu_utilization_collaborative": _figure(cpu_utilization(collaborative)),
        "bytes_per_sample": _figure(local.get("bytes_per_sample"), 0),
        "bytes_per_sample_collaborative": _figure(collaborative.get("bytes_per_sample"), 0),
        "loss_ratio": _figure(loss_ratio),
        "rate_mbit": rate,
        "raw_tcp_mbit_s": _figure((results.get("raw_tcp") or {}).get("mbit_s"), 1),
        "raw_alltoall_parallel_fraction": _figure((results.get("raw_alltoall") or {}).get("parallel_fraction")),
        "raw_alltoall_rotating_fraction": _figure((results.get("raw_alltoall") or {}).get("rotating_fraction")),
        "allreduce_s": _figure(reduce_.get("allreduce_s")),
        "step_s": _figure(reduce_.get("step_s")),
        "line_rate_bound_s": _figure(line_rate_bound_s(VALUES, PEERS, rate)),
        "hivemind_step_s": _figure(hivemind.get("step_s")),
        "hivemind_allreduce_s": _figure(hivemind.get("allreduce_s")),
        "hivemind_step_line_rate_fraction": _figure(hivemind.get("step_line_rate_fraction")),
        "hivemind_allreduce_line_rate_fraction": _figure(hivemind.get("allreduce_line_rate_fraction")),
        "step_vs_hivemind": _figure(versus("step_s")),
        "allreduce_vs_hivemind": _figure(versus("allreduce_s")),
        "hivemind_error": hivemind.get("error"),
        "solo_samples_per_s": _figure(solo_rate, 2),
        "window_s": window,
        "targets": {
            "defaults_step_line_rate_fraction": 0.9,
            "defaults_step_vs_hivemind": round(1 / 1.15, 3),
            "allreduce_line_rate_fraction": 0.95,
            "step_line_rate_fraction": 0.85,
            "utilization_local_updates": 0.9 if rate >= 100 else 0.8,
            "utilization_collaborative": 0.7,
            "loss_ratio": 1.05,
        },
    }


def print_table(summary: dict[str, Any], results: dict[str, dict[str, Any] | None]) -> None:
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value}"

    print(f"{'figure':<38} {'value':>10} {'target':>8}")
    for name in (
        "defaults_step_line_rate_fraction",
        "defaults_allreduce_line_rate_fraction",
        "defaults_step_s",
        "defaults_step_vs_hivemind",
        "raw_tcp_mbit_s",
        "line_rate_bound_s",
        "raw_alltoall_parallel_fraction",
        "raw_alltoall_rotating_fraction",
        "allreduce_s",
        "step_s",
        "allreduce_line_rate_fraction",
        "step_line_rate_fraction",
        "hivemind_step_s",
        "hivemind_allreduce_s",
        "hivemind_step_line_rate_fraction",
        "hivemind_allreduce_line_rate_fraction",
        "step_vs_hivemind",
        "allreduce_vs_hivemind",
        "solo_samples_per_s",
        "utilization_local_updates",
        "utilization_collaborative",
        "cpu_utilization_local_updates",
        "cpu_utilization_collaborative",
        "bytes_per_sample",
        "bytes_per_sample_collaborative",
        "loss_ratio",
    ):
        print(f"{name:<38} {cell(summary.get(name)):>10} {cell(summary['targets'].get(name)):>8}")
    for name, error in summary.get("errors", {}).items():
        print(f"  {name} failed: {error.splitlines()[0]}")
    if summary.get("hivemind_error"):
        print(f"  hivemind baseline failed: {summary['hivemind_error'].splitlines()[0]}")


if __name__ == "__main__":
    sys.exit(main())
