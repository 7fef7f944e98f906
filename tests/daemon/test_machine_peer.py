"""A peer that is a whole machine (``peerd join --nproc-per-node N``, ``peerd/machine*.py``): real
``peerd`` processes whose ranks train with torch.distributed (gloo on CPU) next to a lone peer."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

import peerd
from peerd.machine_training import RELEASE_TIMEOUT_S
from tests.support.processes import PeerdProcess, status_of, wait_until, wait_until_accurate, wait_until_averaged_in

BOOTSTRAP_TIMEOUT = 15.0  # peerd join's default: a killed rank ends its peer within it


def start_peer(tmp_path: Path, name: str, shard: str, initial: str | None, *extra: str) -> tuple[PeerdProcess, int]:
    args = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / f"{name}.key"), "--run-id", "machine"]
    args += ["--task", "digits", "--data-shard", shard, "--status-port", "0", *extra]
    if initial:
        args += ["--initial-peer", initial]
    process = PeerdProcess(args, tmp_path / f"{name}.log")
    process.read_line(timeout=60)  # listening
    port = int(process.read_line(timeout=60).rsplit(":", 1)[1].split("/")[0])
    return process, port


def rank_pid(launcher: int, rank: int) -> int:
    """The PID of ``rank`` among the launcher's children (by the RANK its environment holds)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    raise AssertionError(f"no rank {rank} under {launcher}")


def round_bytes(port: int) -> float:
    """Mean bytes a peer moved per averaging round (``peerd_averaging_round_bytes``)."""
    from peerd.status_server import fetch_status

    metrics = fetch_status(port, path="/metrics")
    total = float(re.search(r"^peerd_averaging_round_bytes_sum (\S+)$", metrics, re.M).group(1))
    count = float(re.search(r"^peerd_averaging_round_bytes_count (\S+)$", metrics, re.M).group(1))
    return total / count


def test_a_two_rank_peer_trains_with_a_lone_peer_and_ends_when_a_rank_dies(tmp_path):
    lone, lone_port = start_peer(tmp_path, "lone", "0/2", None)
    machine = None
    try:
        address = status_of(lone_port)["address"]
        machine, port = start_peer(tmp_path, "machine", "1/2", address, "--nproc-per-node", "2")
        wait_until_accurate((port, lone_port), 90)
        status = status_of(port)
        assert status_of(lone_port)["peers_known"] == 2  # the swarm sees the machine as one peer
        ranks = status["ranks"]
        assert (ranks["world_size"], ranks["backend"]) == (2, "gloo")
        rank_samples = [row["samples"] for row in ranks["ranks"]]
        assert min(rank_samples) > 0 and rank_samples[0] == rank_samples[1]  # equal slices, lockstep
        # parameters cross the machine when rank 0's changed (a swarm step, a loaded state), not every slice
        assert 0 < ranks["parameters_shared"] <= status["epoch"] + 1
        assert ranks["parameters_shared"] < sum(rank_samples) / 2 / 32
        # the swarm counts the machine's samples: both ranks', as one peer's (at most a slice apart)
        assert abs(status["samples"] - sum(rank_samples)) <= 2 * 64 * 32
        wait_until_averaged_in(port, 2, 60, "a round of the machine and the lone peer")
        # one peer to the swarm: a round moves the bytes a lone peer's does (a group of 2, same model)
        ratio = round_bytes(port) / round_bytes(lone_port)
        assert 0.7 <= ratio <= 1.4, ratio

        leader = machine.process.pid
        killed_at = status_of(lone_port)["epoch"]
        signal_sent = time.monotonic()
        os.kill(rank_pid(leader, 1), signal.SIGKILL)
        code = machine.process.wait(BOOTSTRAP_TIMEOUT)
        assert code == 5 and time.monotonic() - signal_sent < BOOTSTRAP_TIMEOUT
        said = [line for line in machine.log().splitlines() if line.startswith("peerd:")]
        assert len(said) == 1 and "rank" in said[0] and "Traceback" not in machine.log(), machine.log()
        wait_until(  # and the swarm goes on without it
            lambda: ((status_of(lone_port) or {}).get("epoch") or 0) > killed_at + 3, 60, "the lone peer trains on"
        )
    finally:
        if machine is not None:
            machine.stop()
        lone.stop()


def test_a_sharded_two_rank_peer_trains_in_local_updates_with_a_lone_peer(tmp_path):
    """FSDP over the ranks, rank 0's whole model and optimizer on the host: inner steps change
    its parameters every slice, so every slice begins by sharding them out again."""
    mode = ("--mode", "local-updates", "--local-steps", "10")
    lone, lone_port = start_peer(tmp_path, "lone", "0/2", None, *mode)
    machine = None
    try:
        address = status_of(lone_port)["address"]
        machine, port = start_peer(tmp_path, "machine", "1/2", address, "--nproc-per-node", "2", "--shard-model", *mode)
        wait_until_accurate((port, lone_port), 90)
        status = status_of(port)
        ranks = status["ranks"]
        assert (ranks["world_size"], ranks["model"]) == (2, "fsdp")
        rank_samples = [row["samples"] for row in ranks["ranks"]]
        assert min(rank_samples) > 0 and abs(status["samples"] - sum(rank_samples)) <= 2 * 64 * 32
        assert ranks["parameters_shared"] >= status["epoch"]  # after every slice's inner step
        wait_until_averaged_in(port, 2, 60, "an outer round of the machine and the lone peer")
    finally:
        if machine is not None:
            machine.stop()
        lone.stop()


def test_a_machine_stops_as_one_peer_on_ctrl_c_and_sigterm_and_refuses_without_a_task(tmp_path):
    stops = {signal.SIGINT: 130, signal.SIGTERM: 0}
    machines = {
        sig: start_peer(tmp_path, f"stop{code}", "0/1", None, "--nproc-per-node", "2")[0] for sig, code in stops.items()
    }
    try:
        for sig, machine in machines.items():
            machine.wait_for_log("training as rank 0 of 2 ranks", 60)
            machine.process.send_signal(sig)
        for sig, machine in machines.items():
            # rank 0 tells the others to stop (within RELEASE_TIMEOUT_S), then stops as a peer does (2 s)
            assert machine.process.wait(RELEASE_TIMEOUT_S + 2) == stops[sig]
            # as a lone peer's: the log says it stopped, no rank reports a failure, no traceback
            assert "received " in machine.log() and "Traceback" not in machine.log(), machine.log()
            assert not [line for line in machine.log().splitlines() if line.startswith("peerd:")], machine.log()
    finally:
        for machine in machines.values():
            machine.stop()


def test_torchrun_runs_peerd_join_as_one_machine_peer(tmp_path):
    """``torchrun --nproc-per-node 2 -m peerd join``: the ranks find their places from torchrun's
    variables, rank 0 alone is a peer, and torchrun's SIGTERM stops every rank quietly (torchrun
    itself then prints its own SignalException: ``peerd join --nproc-per-node`` does not)."""
    import shutil
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = probe.getsockname()[1]
    torchrun = [shutil.which("torchrun"), "--nproc-per-node", "2", "--master-port", str(master_port), "-m", "peerd"]
    args = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "machine.key"), "--run-id", "torchrun"]
    args += ["--task", "digits", "--status-port", "0"]
    machine = PeerdProcess(args, tmp_path / "machine.log", launcher=torchrun)
    try:
        machine.read_line(timeout=60)  # listening
        port = int(machine.read_line(timeout=60).rsplit(":", 1)[1].split("/")[0])

        def ranks_training() -> bool:
            rows = ((status_of(port) or {}).get("ranks") or {}).get("ranks") or [{}]
            return min(row.get("samples") or 0 for row in rows) > 0

        wait_until(ranks_training, 60, "both ranks training")
        assert status_of(port)["ranks"]["world_size"] == 2
        machine.process.send_signal(signal.SIGTERM)
        machine.process.wait(RELEASE_TIMEOUT_S + 5)
        log = machine.log()
        ours = str(Path(peerd.__file__).parent) + os.sep  # (torchrun prints a traceback of its own)
        assert "received SIGTERM" in log and ours not in log, log  # no frame of ours in any traceback
        assert not [line for line in log.splitlines() if line.startswith("peerd:")], log
    finally:
        machine.stop()


def test_a_machine_that_cannot_start_says_why_once(tmp_path):
    base = ["join", "--nproc-per-node", "2", "--listen", "127.0.0.1:0"]
    train = [*base, "--task", "digits", "--bootstrap-timeout", "2"]
    cases = {  # what a user got wrong: (arguments, exit code, what the one line says)
        "notask": (base, 1, "give --task"),
        "unreachable": ([*train, "--initial-peer", "127.0.0.1:1"], 2, "could not reach any initial DHT peer"),
        "lonesharded": ([*train[:1], *train[3:], "--shard-model"], 1, "run several (--nproc-per-node N)"),
        "unshardable": (
            [*base, "--task", "tests.support.rank_slice:unshardable_digits", "--shard-model"],
            5,
            "could not shard the model (--shard-model): fully_shard doesn't support scalar parameters",
        ),
    }
    if not torch.cuda.is_available():  # (a machine with a GPU has nothing wrong to say here)
        cases["nocuda"] = ([*train, "--device", "cuda"], 1, "torch sees no CUDA device")
    started = {}
    for name, (args, _code, _said) in cases.items():
        started[name] = PeerdProcess([*args, "--identity", str(tmp_path / f"{name}.key")], tmp_path / f"{name}.log")
    for name, (_args, code, said) in cases.items():
        process = started[name]
        assert process.process.wait(60) == code, process.log()
        process.stop()
        lines = [line for line in process.log().splitlines() if line.startswith("peerd:")]
        assert len(lines) == 1 and said in lines[0] and "Traceback" not in process.log(), process.log()


@pytest.mark.slow
def test_a_two_rank_peer_trains_local_updates_with_a_lone_peer(tmp_path):
    mode = ("--mode", "local-updates", "--local-steps", "10")
    lone, lone_port = start_peer(tmp_path, "lone", "0/2", None, *mode)
    machine = None
    try:
        address = status_of(lone_port)["address"]
        machine, port = start_peer(tmp_path, "machine", "1/2", address, "--nproc-per-node", "2", *mode)
        wait_until_accurate((port, lone_port), 120)
        wait_until_averaged_in(port, 2, 60, "an outer round of the machine and the lone peer")
        ranks = status_of(port)["ranks"]
        assert ranks["ranks"][1]["samples"] > 0
    finally:
        if machine is not None:
            machine.stop()
        lone.stop()
