"""The training benchmark's report: the workers' per-phase results made into trials, runs and the
headline figures (``summarize``), and the table printed above the JSON line (``print_table``)."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.training import Phase

LATE_WARNING = 0.1  # seconds: a worker that starts a phase later than this is reported


def summarize(phases: list[Phase], reports: list[dict[str, Any]], target_accuracy: float) -> dict[str, Any]:
    """One trial per collaborative phase; trials of one target batch size make a run; the run with the
    largest target batch size gives the headline figures."""
    results = {phase.name: [report["phases"][i] for report in reports] for i, phase in enumerate(phases)}

    def rate(phase: Phase) -> float:
        return sum(r["samples"] for r in results[phase.name]) / phase.seconds

    def per_cpu_s(phase: Phase) -> float:
        return sum(r["samples"] for r in results[phase.name]) / max(sum(r["cpu_s"] for r in results[phase.name]), 1e-9)

    trials = []
    for index, phase in enumerate(phases):
        if phase.kind == "collab":
            solo = statistics.mean([rate(phases[index - 1]), rate(phases[index + 1])])
            trial = _trial(phase, results[phase.name], solo, rate(phase))
            solo_per_cpu_s = statistics.mean([per_cpu_s(phases[index - 1]), per_cpu_s(phases[index + 1])])
            trial["cpu_ratio"] = per_cpu_s(phase) / solo_per_cpu_s
            trials.append(trial)
    runs = []
    for batch_size in dict.fromkeys(trial["target_batch_size"] for trial in trials):
        mine = [trial for trial in trials if trial["target_batch_size"] == batch_size]
        collab = statistics.mean(trial["collab_samples_per_s"] for trial in mine)
        solo = statistics.mean(trial["solo_samples_per_s"] for trial in mine)
        reached = [trial["seconds_to_target"] for trial in mine if trial["seconds_to_target"] is not None]
        runs.append(
            {
                "target_batch_size": batch_size,
                "collab_samples_per_s": collab,
                "solo_samples_per_s": solo,
                "overhead_ratio": collab / solo,
                "cpu_ratio": statistics.mean(trial["cpu_ratio"] for trial in mine),
                # the median over trials that got there; null unless every trial did
                "seconds_to_target": statistics.median(reached) if len(reached) == len(mine) else None,
                "seconds_per_epoch": _median([t["seconds_per_epoch"] for t in mine if t["seconds_per_epoch"]]),
                "trials": mine,
            }
        )
    headline = max(runs, key=lambda run: run["target_batch_size"])
    solo_phases = [phase for phase in phases if phase.kind == "solo"]
    solo_reached = [r["seconds_to_target"] for phase in solo_phases for r in results[phase.name]]
    return {
        "peers": len(reports),
        "collab_samples_per_s": headline["collab_samples_per_s"],
        "solo_samples_per_s": headline["solo_samples_per_s"],
        "overhead_ratio": headline["overhead_ratio"],
        "cpu_ratio": headline["cpu_ratio"],
        "seconds_to_target": headline["seconds_to_target"],
        "target_accuracy": target_accuracy,
        "config": f"target_batch_size={headline['target_batch_size']}",
        "runs": runs,
        "solo_phases_samples_per_s": [rate(phase) for phase in solo_phases],
        "solo_seconds_to_target": _median([s for s in solo_reached if s is not None]),
        "max_late_s": max(r["late_s"] for report in reports for r in report["phases"]),
        "cores": os.cpu_count(),
    }


def _trial(phase: Phase, peers: list[dict[str, Any]], solo: float, window_rate: float) -> dict[str, Any]:
    collab = _whole_epochs_rate(peers)
    collab = window_rate if collab is None else collab
    reached = [r["seconds_to_target"] for r in peers if r["seconds_to_target"] is not None]
    epochs = max(r["epochs"] for r in peers)
    rounds = sum(r["rounds"] for r in peers)
    group_sizes = [size for r in peers for size in r["group_sizes"]]
    return {
        "target_batch_size": phase.target_batch_size,
        "collab_samples_per_s": collab,
        "collab_samples_per_s_window": window_rate,
        "solo_samples_per_s": solo,
        "overhead_ratio": collab / solo,
        "seconds_to_target": min(reached) if reached else None,
        "seconds": phase.seconds,
        "epochs": epochs,
        "seconds_per_epoch": phase.seconds / epochs if epochs else None,
        "averaged_fraction": sum(r["averaged"] for r in peers) / rounds if rounds else None,
        "mean_group_size": statistics.mean(group_sizes) if group_sizes else None,
        "best_accuracy": max(r["accuracy"] or 0.0 for r in peers),
    }


def _whole_epochs_rate(peers: list[dict[str, Any]]) -> float | None:
    """Samples/s of the swarm over whole epochs: each peer's samples up to the end of its last epoch
    over the time it took, summed. The phase's cut lands anywhere in an epoch (mid-computation or
    mid-averaging), which would bias a short phase either way; None if some peer finished no epoch."""
    if any(peer["last_epoch_at"] is None for peer in peers):
        return None
    return sum(samples / seconds for seconds, samples in (peer["last_epoch_at"] for peer in peers))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict[str, Any], settle_time: float | None) -> None:
    solo_phases = ", ".join(f"{rate:.0f}" for rate in summary["solo_phases_samples_per_s"])
    settle = "the optimizer's default" if settle_time is None else f"{settle_time:g} s"
    print(
        f"digits task, {summary['peers']} peers, {summary['cores']} cores, one torch thread each, 127.0.0.1, "
        f"matchmaking settle time {settle}"
    )
    print(f"solo phases (plain local loop, all peers), samples/s: {solo_phases}")
    print(
        f"a lone peer on its shard reaches accuracy {summary['target_accuracy']} in "
        f"{_fmt(summary['solo_seconds_to_target'], '.2f')} s (median)"
    )
    header = (
        f"{'target batch':>12} {'collab sps':>10} {'solo sps':>9} {'ratio':>6} {'cpu':>5} {'to target s':>11} "
        f"{'phase s':>7} {'epochs':>6} {'s/epoch':>7} {'averaged':>8} {'group':>5} {'best acc':>8}"
    )
    print(header)
    print("-" * len(header))
    for run in summary["runs"]:
        for trial in run["trials"]:
            print(
                f"{trial['target_batch_size']:>12} {trial['collab_samples_per_s']:>10.0f}"
                f" {trial['solo_samples_per_s']:>9.0f} {trial['overhead_ratio']:>6.2f} {trial['cpu_ratio']:>5.2f}"
                f" {_fmt(trial['seconds_to_target'], '>11.2f')} {trial['seconds']:>7.0f} {trial['epochs']:>6}"
                f" {_fmt(trial['seconds_per_epoch'], '>7.2f')} {_fmt(trial['averaged_fraction'], '>8.0%')}"
                f" {_fmt(trial['mean_group_size'], '>5.1f')} {trial['best_accuracy']:>8.3f}"
            )
        if len(run["trials"]) > 1:
            print(
                f"{'mean':>12} {run['collab_samples_per_s']:>10.0f} {run['solo_samples_per_s']:>9.0f}"
                f" {run['overhead_ratio']:>6.2f} {run['cpu_ratio']:>5.2f} {_fmt(run['seconds_to_target'], '>11.2f')}"
            )
    print(
        "collab sps: samples/s of all peers over their whole epochs (averaging pauses included); solo sps: mean"
        " of the solo phases just before and after; cpu: samples per CPU second, collab / solo;"
        " to target: first peer at the target accuracy, '-' = not"
        " within the phase"
    )
    if summary["max_late_s"] > LATE_WARNING:
        print(f"warning: a worker started a phase {summary['max_late_s']:.2f} s late (machine overloaded?)")
    verdict = "meets" if summary["overhead_ratio"] >= 0.8 else "MISSES"
    print(f"headline: {summary['config']}: overhead_ratio {summary['overhead_ratio']:.2f} {verdict} the 0.8 target")
