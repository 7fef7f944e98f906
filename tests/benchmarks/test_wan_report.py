"""benchmarks/wan.py's report of the Hivemind baseline: null without it, peerd's time ÷ Hivemind's
with it, and only full-group, exactly averaged Hivemind steps counted. The lab runs are the
benchmark's own; this checks the arithmetic and the bookkeeping on made-up outcomes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

from benchmarks.wan import line_rate_bound_s, summarize
from benchmarks.wan_cases import hivemind_baseline
from benchmarks.wan_cases.raw_alltoall import rotation_target

BOUND = line_rate_bound_s(4_194_304, 4, 100.0)


def peerd_part(hivemind: dict | None) -> dict:
    return {"allreduce_s": 3.0, "step_s": 3.5, "allreduce_line_rate_fraction": BOUND / 3.0, "hivemind": hivemind}


def test_without_the_baseline_the_hivemind_figures_are_null():
    summary = summarize({"allreduce": peerd_part(None)}, 100.0, 20.0)
    names = [name for name in summary if "hivemind" in name]
    assert sorted(names) == sorted(
        [
            "hivemind_step_s",
            "hivemind_allreduce_s",
            "hivemind_step_line_rate_fraction",
            "hivemind_allreduce_line_rate_fraction",
            "step_vs_hivemind",
            "allreduce_vs_hivemind",
            "hivemind_error",
            "defaults_step_vs_hivemind",
        ]
    )
    assert all(summary[name] is None for name in names)
    assert summary["step_s"] == 3.5


def test_with_the_baseline_peerd_is_compared_to_hivemind_step_for_step():
    done = {"ok": True, "size": 4, "exact": True}
    outcomes = [
        [{**done, "seconds": 2.0 + i / 10, "allreduce_s": 1.5 + i / 10} for i in range(4)],
        [{**done, "seconds": 3.0, "allreduce_s": 2.5} for _ in range(4)],
        [{**done, "seconds": 2.5, "allreduce_s": None} for _ in range(4)],
    ]
    steps = [hivemind_baseline.step_times(outcome) for outcome in outcomes]
    assert steps[0] == {"step_s": 2.3, "allreduce_s": 1.8}  # the slowest peer's
    assert steps[2]["allreduce_s"] is None  # a peer that never saw the stage: no all-reduce time
    hivemind = hivemind_baseline.figures(steps, [], BOUND)
    assert hivemind["step_s"] == 2.5 and hivemind["allreduce_s"] == 2.15  # medians over the timed steps
    summary = summarize({"allreduce": peerd_part(hivemind)}, 100.0, 20.0)
    assert summary["step_vs_hivemind"] == round(3.5 / 2.5, 3)
    assert summary["allreduce_vs_hivemind"] == round(3.0 / 2.15, 3)
    assert summary["hivemind_step_line_rate_fraction"] == round(BOUND / 2.5, 3)


def test_a_partial_or_inexact_hivemind_step_is_a_failure_not_a_time():
    full = [{"ok": True, "size": 4, "exact": True, "seconds": 2.0} for _ in range(4)]
    assert hivemind_baseline.full_group(full, 4)
    assert not hivemind_baseline.full_group([*full[:3], {**full[3], "size": 3}], 4)
    assert not hivemind_baseline.full_group([*full[:3], {**full[3], "exact": False}], 4)
    assert not hivemind_baseline.full_group([*full[:3], {"ok": False, "error": "TimeoutError", "seconds": 15}], 4)
    failed = hivemind_baseline.figures([], [["TimeoutError"]], BOUND)
    assert "step_s" not in failed and failed["failed_steps"] == 1
    assert summarize({"allreduce": peerd_part(failed)}, 100.0, 20.0)["step_vs_hivemind"] is None


class LocalLab:
    """Starts the processes as the lab would, in this namespace: enough for a start that fails."""

    def spawn(self, host, args: list[str], log_path: Path, python: str) -> subprocess.Popen:
        with open(log_path, "wb") as log:
            return subprocess.Popen([python, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)


def test_a_hivemind_that_does_not_start_is_the_baselines_error_and_steps_nothing(tmp_path):
    hosts = [SimpleNamespace(address="127.0.0.1") for _ in range(4)]
    baseline = hivemind_baseline.Baseline(LocalLab(), hosts, tmp_path, "/bin/false", 1000, start_timeout=10)
    assert baseline.peers is None and "did not answer" in baseline.error
    baseline.step(1, limit=5)  # a no-op, not a hang on a dead process's pipe
    baseline.stop()
    figures = baseline.figures(BOUND)
    assert figures["error"] == baseline.error and "step_s" not in figures
    assert summarize({"allreduce": peerd_part(figures)}, 100.0, 20.0)["hivemind_error"] == baseline.error


def test_link_rates_read_as_tc_writes_them():
    from benchmarks.wan import mbit_per_s

    assert mbit_per_s("20") == 20.0
    assert mbit_per_s("20mbit") == 20.0
    assert mbit_per_s("1gbit") == 1000.0


def test_the_rotating_all_to_all_schedule_is_a_permutation_at_every_turn():
    for hosts in range(2, 9):
        for turn in range(3 * hosts):
            targets = [rotation_target(me, hosts, turn) for me in range(hosts)]
            assert sorted(targets) == list(range(hosts))  # nobody receives from two hosts at once
            assert all(target != me for me, target in enumerate(targets))
        for me in range(hosts):  # and every other host gets the same number of turns
            visits = [rotation_target(me, hosts, turn) for turn in range(2 * (hosts - 1))]
            assert sorted(visits) == sorted(2 * [h for h in range(hosts) if h != me])


def test_the_plain_tcp_all_to_all_figures_are_reported():
    summary = summarize({"raw_alltoall": {"parallel_fraction": 0.81, "rotating_fraction": 0.8421}}, 100.0, 20.0)
    assert summary["raw_alltoall_parallel_fraction"] == 0.81
    assert summary["raw_alltoall_rotating_fraction"] == 0.842
    assert summarize({}, 100.0, 20.0)["raw_alltoall_rotating_fraction"] is None


def test_the_defaults_come_first_and_are_compared_to_hivemind_too():
    hivemind = {"step_s": 2.5, "allreduce_s": 2.0}
    part = {**peerd_part(hivemind), "defaults": {"step_s": 4.0, "allreduce_s": 3.8, "step_line_rate_fraction": 0.5}}
    summary = summarize({"allreduce": part}, 100.0, 20.0)
    assert next(iter(summary)) == "defaults_step_line_rate_fraction"
    assert summary["defaults_step_line_rate_fraction"] == 0.5
    assert summary["defaults_step_vs_hivemind"] == round(4.0 / 2.5, 3)
    assert summary["step_vs_hivemind"] == round(3.5 / 2.5, 3)  # the tuned configuration's
    assert summarize({"allreduce": peerd_part(None)}, 100.0, 20.0)["defaults_step_vs_hivemind"] is None
