"""A newcomer joining a training swarm: how soon it averages, and how many of the rounds after it
joined it takes part in, with delayed parameter updates against immediate ones in the same run.

    python benchmarks/join.py [--quick] [--runs R] [--veterans V] [--joined-at E] [--epochs N]

What is measured. In one process on 127.0.0.1, ``--veterans`` peers (real ``DHTNode`` and
``CollaborativeOptimizer``, the built-in ``digits`` task, groups formed ahead as the daemon forms
them, the test suite's short deadlines) train; once they reach epoch ``--joined-at`` one more peer
starts, loads a donor's state and trains on for ``--epochs`` epochs. Per run and mode:

* ``epochs_to_first_average``: the epoch of the first round it averaged in with others, less its
  first epoch (where loading the state put it): 0 when it averages in its first epoch;
* ``averaged_fraction``: the rounds it averaged in with others, of the epochs from its first one
  to the last but one (the last one's round may still run in the background when a delayed
  trainer stops, so neither mode counts it); a newcomer that fails to match, finds itself behind
  and loads state again skips epochs and averages in few of them;
* ``loads``: how often it loaded state, or tried to (1: once, at joining).

Modes alternate run by run (immediate, delayed, immediate, ...), so machine load hits both alike;
``immediate`` (``ImmediateUpdates``: each epoch waits for its round) is the baseline, ``delayed``
(``DelayedUpdates``: ``peerd join --delay-updates``) the schedule whose joins the ratio judges:
``delayed_averaged_ratio`` = delayed's median ``averaged_fraction`` / immediate's. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from averaging.match_ahead import MatchAhead  # noqa: E402
from averaging.update_schedules import DelayedUpdates, ImmediateUpdates  # noqa: E402
from tests.support.newcomer import run_newcomer  # noqa: E402

MODES = ("immediate", "delayed")


async def one_join(mode: str, veterans: int, joined_at: int, epochs: int) -> dict:
    """One swarm, one newcomer: its figures (see the module's docstring)."""

    def schedule(background: trio.Nursery) -> dict:
        updates = DelayedUpdates(background) if mode == "delayed" else ImmediateUpdates()
        return {"updates": updates, "matching": MatchAhead(background)}

    run = await run_newcomer(schedule, veterans=veterans, joined_at=joined_at, epochs=epochs, timeout=180)
    rounds, loads = run.rounds, run.loads
    first = next((epoch for epoch, _, _ in rounds if epoch > 0), None)
    averaged = {
        last["epoch"] for _, last, _ in rounds if last.get("averaged") and last.get("group", 0) >= 2
    }  # the rounds' own epochs
    last = joined_at + epochs - 1  # the last epoch whose round both modes see end
    counted = {epoch for epoch in averaged if first is not None and first <= epoch < last}
    first_averaged = min(averaged, default=None)
    span = max(1, last - (first or joined_at))
    return {
        "epochs_to_first_average": None if first is None or first_averaged is None else first_averaged - first,
        "averaged_fraction": round(len(counted) / span, 3),
        "loads": loads,
    }


def median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 runs per mode (full: 8)")
    parser.add_argument("--runs", type=int, default=None, help="runs per mode")
    parser.add_argument("--veterans", type=int, default=3)
    parser.add_argument("--joined-at", type=int, default=5, help="the veterans' epoch when the newcomer starts")
    parser.add_argument("--epochs", type=int, default=20, help="epochs after that, for every peer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    runs = args.runs or (3 if args.quick else 8)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for run in range(runs):
        for mode in MODES if run % 2 == 0 else MODES[::-1]:
            results[mode].append(trio.run(one_join, mode, args.veterans, args.joined_at, args.epochs))
    print(f"{'mode':<10}{'run':>4}{'epochs to first average':>26}{'averaged fraction':>19}{'loads':>7}")
    for mode in MODES:
        for run, figures in enumerate(results[mode]):
            to_first = figures["epochs_to_first_average"]
            shown = "never" if to_first is None else str(to_first)
            print(f"{mode:<10}{run:>4}{shown:>26}{figures['averaged_fraction']:>19.3f}{figures['loads']:>7}")
    summary: dict = {"benchmark": "join", "runs": runs, "veterans": args.veterans, "quick": args.quick}
    for mode in MODES:
        summary[f"{mode}_epochs_to_first_average"] = median([r["epochs_to_first_average"] for r in results[mode]])
        summary[f"{mode}_never_averaged"] = sum(r["epochs_to_first_average"] is None for r in results[mode])
        summary[f"{mode}_averaged_fraction"] = median([r["averaged_fraction"] for r in results[mode]])
        summary[f"{mode}_loads"] = median([r["loads"] for r in results[mode]])
    baseline = summary["immediate_averaged_fraction"]
    summary["delayed_averaged_ratio"] = round(summary["delayed_averaged_fraction"] / baseline, 3) if baseline else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
