"""Byzantine peers: 8 in-process peers train the digits task while f of them attack.

    python benchmarks/byzantine.py [--quick] [--peers 8] [--epochs E]
        [--attacks NAME,...] [--fs 1,2,3] [--shardings iid,non-iid] [--modes gradient,local] [--seeds K]
        [--rule centered-clip|centered-clip-mixed] [--scored] [--outer-lr LR]

Every peer is a real host with its own all-reduce service on 127.0.0.1 (Noise-encrypted streams,
the real reducers, the real reducer checks), in one process (``byzantine_cases/swarm.py``). An
epoch: each peer computes its gradient on one batch (32 samples of its shard of the data: the
task's swarm batch of 256 over 8 peers), the peers average their gradients in one all-reduce round,
and each applies the average with its own Adam (the task's optimizer). Every peer starts from the
same model.

Loud attackers (the last f peers; f = 1, 2, 3) each claim weight 2**40 and send, in turn:
``scaled`` (their gradient times 1e4), ``sign-flipped`` (times -10) or ``random`` (Gaussian, 10x
the gradient's norm); and each lies as a reducer: it aggregates as honest ones do and answers every
part of its shard with the aggregate times -10 (``tests/support/hostile_reducers.py``). Groups are
formed as matchmaking forms them once peers ban each other: without any peer that an honest member
has caught (``averaging/verification.py``).

Quiet attackers are the literature's (``byzantine_cases/attacks.py``): ALIE (z from Baruch et al.'s
formula, z = 1, z = 2), IPM (eps = 0.1, 0.5, 4, 100), sign flip, label flip, and min-max / min-sum
(Shejwalkar and Houmansadr, p = -std or -unit(mean)). They claim weight 1, reduce honestly, and know
every honest update of the round before they send. Cases: f = 1 and 2 of ``--peers``, 3 of twice
as many; ``iid`` shards and ``non-iid`` ones (Dirichlet(0.5) over labels, ``byzantine_cases/
shards.py``); ``gradient`` mode and ``local`` mode (local updates: 5 Adam steps, then the peers
average pseudo-gradients and take peerd's outer step, at lr 0.35 where this task's outer step is
stable, ``--outer-lr`` for another: ``byzantine_cases/swarm.py``; half as many rounds as gradient
mode has epochs). All with a public swarm's defaults: centered-clip and reducer checks (``--rule
centered-clip-mixed``: the quiet cases with nearest-neighbour mixing, ``averaging/mixing.py``).
``--scored``: the quiet cases with every honest peer scoring the contributions it reduces against
the loss of a validation split that every peer holds (256 training images, never the held-out
ones accuracy is measured on; ``averaging/contribution_scores.py``, ``peerd join
--score-contributions``), and banning senders whose contributions keep raising it; groups leave
out whoever an honest peer banned, honest or not (``honest_banned`` counts the honest ones).

Figures, after the same number of epochs:

* ``accuracy_clean``: held-out accuracy of the honest peers (their mean) with no attacker, with
  centered-clip; ``accuracy_clean_mean``: the same with the plain mean;
* ``accuracy_f1`` .. ``accuracy_f3``: with 1-3 loud attackers, centered-clip and reducer checks on;
* ``accuracy_f1_mean`` (not with ``--quick``): one attacker against the plain mean (no checks),
  for contrast;
* ``liars_caught`` / ``liars``: loud attackers that some honest peer caught, over all runs, and how
  many attacked; ``caught_after_epochs``: per run, the epoch by which all its liars were caught;
* ``robust_time_ratio``: median CPU seconds of a round (all 8 peers, this process) with
  centered-clip / with the plain mean, on the clean swarm (a third clean run, checks off);
  ``robust_wall_ratio``, the same in wall-clock seconds (noisier on a shared machine);
* ``checked_time_ratio`` / ``checked_wall_ratio``: the same with the reducer checks on (the
  ``clean`` run): every peer checks every other reducer each round, as the shards of this small
  model fit the check budget (``averaging/reducer_checks.py``), so this is their upper bound;
* ``quiet_clean``: the clean accuracy per ``peers/sharding/mode``; ``quiet_accuracy``: the honest
  peers' accuracy per ``attack/f<f>of<n>/sharding/mode``; ``worst_drop_model_poisoning`` (over
  ALIE, IPM, sign flip, min-max, min-sum) and ``worst_drop_label_flip``: the largest drop from the
  clean run of the same peers, sharding and mode, with ``worst_case_...`` naming the case.
* ``quiet_late`` (clean runs and attacks) and ``worst_drop_late``: ``quiet_accuracy`` and the
  worst drops with each run's accuracy averaged over its last tenth of rounds
  (``RunResult.late_accuracy``): on skewed shards the accuracy swings by up to 0.04 between
  neighbouring rounds, and the last round alone reads the swing's phase as much as what the swarm
  learned.

``--seeds K`` runs each quiet case and its clean run from K initial models (the task's and K - 1
drawn; data and peer order as ever) and reports their mean accuracy: on label-skewed shards one run of a
case differs from another seed's by up to 0.08, more than the drops to be judged.

``--quick``: 60 epochs, no contrast run, and of the quiet attacks IPM eps = 4, ALIE z_max, label
flip and min-max (std) at f = 2, iid, gradient mode. The full run (every case above, 100 epochs)
takes hours on 2 cores; the filters pick a part. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import trio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.byzantine_cases.attacks import QUIET  # noqa: E402
from benchmarks.byzantine_cases.shards import SHARDINGS  # noqa: E402
from benchmarks.byzantine_cases.swarm import MODES, OUTER_LR, Case, RunResult, run_swarm  # noqa: E402
from peerd.arguments import positive_float  # noqa: E402

QUICK_ATTACKS = ("ipm-4", "alie-zmax", "label-flip", "min-max-std")


def loud_runs(peers: int, quick: bool) -> dict[str, Case]:
    runs = {
        "clean": Case(peers, 0, None),
        "clean_mean": Case(peers, 0, None, "mean", False),
        "clean_nochk": Case(peers, 0, None, "centered-clip", False),
        **{f"f{f}": Case(peers, f, "loud") for f in (1, 2, 3)},
    }
    if not quick:
        runs["f1_mean"] = Case(peers, 1, "loud", "mean", False)
    return runs


def quiet_runs(args: argparse.Namespace) -> dict[str, Case]:
    """The quiet cases asked for, and the clean runs they are measured against (the loud runs'
    ``clean`` is the one of ``--peers`` iid gradient peers)."""
    sizes = {1: args.peers, 2: args.peers, 3: 2 * args.peers}
    runs: dict[str, Case] = {}
    for mode in args.modes:
        for sharding in args.shardings:
            for f in args.fs:
                n = sizes[f]
                clean = f"clean/{n}/{sharding}/{mode}"
                shared = dict(sharding=sharding, mode=mode, scored=args.scored, outer_lr=args.outer_lr)
                runs.setdefault(clean, Case(n, 0, None, args.rule, **shared))
                for attack in args.attacks:
                    case = Case(n, f, attack, args.rule, **shared)
                    runs[f"{attack}/f{f}of{n}/{sharding}/{mode}"] = case
    return runs


def run_seeds(case: Case, epochs: int, seeds: int) -> RunResult:
    """``case`` with seeds 0..``seeds - 1``: the mean accuracy, every liar caught and every round."""
    runs = [trio.run(run_swarm, dataclasses.replace(case, seed=seed), epochs) for seed in range(seeds)]
    if len(runs) == 1:
        return runs[0]
    return RunResult(
        statistics.fmean(run.accuracy for run in runs),
        sum(run.caught for run in runs),
        sum(run.liars for run in runs),
        max((run.caught_after for run in runs if run.caught_after is not None), default=None),
        [cpu for run in runs for cpu in run.round_cpu],
        [wall for run in runs for wall in run.round_wall],
        sum(run.honest_banned for run in runs),
        statistics.fmean(run.late_accuracy for run in runs),
    )


def clean_key(case: Case) -> str:
    return f"clean/{case.peers}/{case.sharding}/{case.mode}"


def worst_drop(
    quiet: dict[str, Case], results: dict[str, RunResult], family: str, figure: str = "accuracy"
) -> tuple[float | None, str | None]:
    """The largest drop of ``figure`` from the clean run among ``family``'s cases, and its case."""
    drops = {
        name: getattr(results[clean_key(case)], figure) - getattr(results[name], figure)
        for name, case in quiet.items()
        if case.attack is not None and QUIET[case.attack].family == family
    }
    if not drops:
        return None, None
    name = max(drops, key=drops.get)
    return round(drops[name], 4), name


def print_table(quiet: dict[str, Case], results: dict[str, RunResult]) -> None:
    """Accuracy per attack (rows) and case (columns: f of n, sharding, mode), the clean row first."""
    columns = sorted({(c.attackers, c.peers, c.sharding, c.mode) for c in quiet.values() if c.attack})
    heads = [f"f{f}of{n}/{s}/{m}" for f, n, s, m in columns]
    print(f"\n{'attack':<13} " + " ".join(f"{h:>22}" for h in heads))
    clean = [results[f"clean/{n}/{s}/{m}"].accuracy for f, n, s, m in columns]
    print(f"{'(clean)':<13} " + " ".join(f"{a:>22.3f}" for a in clean))
    for attack in dict.fromkeys(c.attack for c in quiet.values() if c.attack):
        cells = []
        for (f, n, s, m), base in zip(columns, clean, strict=True):
            result = results.get(f"{attack}/f{f}of{n}/{s}/{m}")
            cells.append(f"{result.accuracy:.3f} ({result.accuracy - base:+.3f})" if result else "-")
        print(f"{attack:<13} " + " ".join(f"{cell:>22}" for cell in cells))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs and cases (~2 min on 2 cores)")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--epochs", type=int, help="epochs per run (default 100; --quick: 60)")
    parser.add_argument("--attacks", help=f"quiet attacks, of {','.join(QUIET)} (default: all)")
    parser.add_argument("--fs", help="attackers per quiet case, of 1,2,3 (3 is of twice the peers)")
    parser.add_argument("--shardings", help=f"of {','.join(SHARDINGS)}")
    parser.add_argument("--modes", help=f"of {','.join(MODES)}")
    parser.add_argument(
        "--rule",
        default="centered-clip",
        choices=["centered-clip", "centered-clip-mixed"],
        help="the reducers' rule in the quiet cases",
    )
    parser.add_argument(
        "--scored",
        action="store_true",
        help="quiet cases with honest peers scoring contributions against a validation split's loss",
    )
    parser.add_argument(
        "--outer-lr", type=positive_float, default=OUTER_LR, help=f"local mode's outer step (default {OUTER_LR})"
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="seeds per quiet case and its clean run, their accuracies averaged"
    )
    args = parser.parse_args()
    defaults = {
        "attacks": QUICK_ATTACKS if args.quick else tuple(QUIET),
        "fs": (2,) if args.quick else (1, 2, 3),
        "shardings": ("iid",) if args.quick else SHARDINGS,
        "modes": ("gradient",) if args.quick else MODES,
    }
    for name, default in defaults.items():
        given = getattr(args, name)
        setattr(args, name, tuple(given.split(",")) if given else default)
    args.fs = tuple(int(f) for f in args.fs)
    for name, known in (("attacks", QUIET), ("shardings", SHARDINGS), ("modes", MODES), ("fs", (1, 2, 3))):
        unknown = set(getattr(args, name)) - set(known)
        if unknown:
            parser.error(f"--{name}: unknown {sorted(unknown)}")
    args.epochs = args.epochs or (60 if args.quick else 100)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    loud, quiet = loud_runs(args.peers, args.quick), quiet_runs(args)
    runs = {**loud, **quiet}
    if args.seeds == 1 and args.rule == "centered-clip":
        runs.pop(f"clean/{args.peers}/iid/gradient", None)  # the loud runs' clean is that run
    results: dict[str, RunResult] = {}
    started = time.perf_counter()
    print(f"{args.peers} peers, digits, {args.epochs} epochs per run; {os.cpu_count()} cores")
    print(f"{'run':<36} {'aggregation':>19} {'accuracy':>9} {'caught':>7} {'cpu/round':>10}")
    for name, case in runs.items():
        epochs = args.epochs if case.mode == "gradient" else max(1, args.epochs // 2)
        result = run_seeds(case, epochs, args.seeds if name in quiet else 1)
        results[name] = result
        print(
            f"{name:<36} {case.rule.value:>19} {result.accuracy:>9.3f} "
            f"{result.caught:>3}/{result.liars:<3} {statistics.median(result.round_cpu) * 1e3:>8.1f}ms",
            flush=True,
        )
    results.setdefault(f"clean/{args.peers}/iid/gradient", results["clean"])
    print_table(quiet, results)
    clean, plain, unchecked = results["clean"], results["clean_mean"], results["clean_nochk"]

    def ratio(run: RunResult, figure: str) -> float:
        return round(statistics.median(getattr(run, figure)) / statistics.median(getattr(plain, figure)), 3)

    model_drop, model_case = worst_drop(quiet, results, "model")
    label_drop, label_case = worst_drop(quiet, results, "label")
    summary = {
        "peers": args.peers,
        "epochs": args.epochs,
        "seeds": args.seeds,
        "quiet_rule": args.rule,
        "quiet_scored": args.scored,
        "outer_lr": args.outer_lr if "local" in args.modes else None,
        "honest_banned": sum(results[name].honest_banned for name in quiet),
        "accuracy_clean": round(clean.accuracy, 4),
        "accuracy_clean_mean": round(plain.accuracy, 4),
        **{f"accuracy_f{f}": round(results[f"f{f}"].accuracy, 4) for f in (1, 2, 3)},
        **({"accuracy_f1_mean": round(results["f1_mean"].accuracy, 4)} if "f1_mean" in results else {}),
        "liars_caught": sum(results[f"f{f}"].caught for f in (1, 2, 3)),
        "liars": sum(results[f"f{f}"].liars for f in (1, 2, 3)),
        "caught_after_epochs": {f"f{f}": results[f"f{f}"].caught_after for f in (1, 2, 3)},
        "robust_time_ratio": ratio(unchecked, "round_cpu"),
        "robust_wall_ratio": ratio(unchecked, "round_wall"),
        "checked_time_ratio": ratio(clean, "round_cpu"),
        "checked_wall_ratio": ratio(clean, "round_wall"),
        "quiet_clean": {name[6:]: round(results[name].accuracy, 4) for name in quiet if name.startswith("clean/")},
        "quiet_accuracy": {name: round(results[name].accuracy, 4) for name in quiet if not name.startswith("clean/")},
        "worst_drop_model_poisoning": model_drop,
        "worst_case_model_poisoning": model_case,
        "worst_drop_label_flip": label_drop,
        "worst_case_label_flip": label_case,
        "quiet_late": {name: round(results[name].late_accuracy, 4) for name in quiet},
        "worst_drop_late": {
            family: worst_drop(quiet, results, key, "late_accuracy")[0]
            for family, key in (("model_poisoning", "model"), ("label_flip", "label"))
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
