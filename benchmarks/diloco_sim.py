"""How much of local-updates (DiLoCo) training's loss gap on ``textlm`` is the algorithm's own, and
which settings close it: an in-process simulation, no network, no DHT.

Four replicas of the ``textlm`` model train on shards 0..3 of 4, stepping in turn, and end their
rounds with peerd's own arithmetic: ``OuterStep`` (outer Nesterov SGD from the shared start,
``apply_delayed`` for overlapped rounds), the real codec (int8 blockwise by default) and
``ErrorFeedback``. The all-reduce is simulated as peerd runs it: the flat delta is cut into one
shard per peer; each reducer averages its own shard exactly and the others' as they decode, then
every peer (the reducer too) takes the average as it decodes. Since every replica averages every
round from the same start, the periodic start averaging is a no-op here and is left out.

Baselines, on the same samples: ``solo`` (one trainer on the whole data, 4x the steps of a replica,
the same batch and inner optimizer, as ``benchmarks/wan.py``'s single trainer) and ``sync`` (fully
synchronous data parallelism: the four shards' batches averaged every step, i.e. one trainer with a
4x batch and a quarter of solo's steps; the best any 4-way data-parallel scheme can do at the same
inner hyperparameters). Figures are held-out bits per byte (``task.evaluate``) of the best replica,
as ``wan.py`` reports the swarm's, and ratios against ``solo`` at the same total samples.

Measured (small model, 6 rounds of 20 steps per replica, ratio against solo at 7,680 samples):
sync DP 1.085 (the data-parallel bound at these inner settings), peerd's defaults (overlapped,
int8+EF, outer lr 0.7 Nesterov 0.9) 1.227, the same sequential 1.154, float32 or no error
feedback no different, sequential lr 1.0 momentum 0 (plain averaging) 1.134, overlapped lr 1.0
momentum 0 1.177; lr 1.4, no Nesterov, H 5 or 10 and an H=5 warm-up were all worse. At 12 rounds:
defaults 1.248, overlapped lr 1.0 momentum 0 1.194.

Sparse rounds (2026-12, small model, 6 rounds): ``topk_2bit`` with each peer's unsent progress in
its parameters 1.141 (int8 defaults 1.219); the same under CenteredClip with 8-bit replies, as a
public swarm's checked rounds run, 1.145 (int8 under CenteredClip 1.218).

Streamed fragments (2026-12, small model, 6 rounds, one run; ``outer_fragments.py``: four
fragments taking turns, a round of 5 steps each, the same bytes per 20 steps): int8 1.173 (whole
1.219 in the same run), ``topk_2bit`` 1.149 (whole 1.141).

Over initial models (2026-12, ``--seed``, small model, 6 rounds): sparse rounds against sync DP
1.049, 1.078, 1.064 at seeds 0, 1, 2 (mean 1.064), against int8 0.936 and 0.933 at seeds 1 and 2;
sparse rounds of 10 steps no better (1.052 at seed 0). One seed's figure moves by ~0.03. Tried
against sync DP and no better (2026-12, seed 0, then 1): 80 kept values a chunk instead of 64
1.051; ``topk_4bit`` 1.049; outer lr 1.3 1.049, 1.085 (lr 1: 1.078 at seed 1); inner lr x1.5
1.063, 1.097; inner lr x0.7 3.754 bits per byte against 3.795, but sync DP gains as much at x0.7
(3.558 against 3.617; 3.415 against 3.472 at seed 1): 1.055 against it at the same lr.

Run: ``python benchmarks/diloco_sim.py`` (the full sweep, ~45 min at one thread), ``--only NAME,...``
for chosen rows (and no sync baseline), ``--quick`` (tiny model, a few rows, < 50 s). Prints a table and, last, one JSON
object with the ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from averaging.compression import Codec, get_codec  # noqa: E402
from averaging.error_feedback import ErrorFeedback  # noqa: E402
from averaging.local_updates import start_pieces  # noqa: E402
from averaging.outer_fragments import OuterFragments  # noqa: E402
from averaging.outer_step import OuterStep  # noqa: E402
from averaging.robust import centered_clip  # noqa: E402
from averaging.settings import LOCAL_UPDATES  # noqa: E402
from peerd.tasks import ShardSpec, Task, load_task  # noqa: E402

PEERS = 4
# The swarm averages the shared start (float32) every this many rounds (``AveragingSettings``; with
# a sparse codec a fragment of it): the simulation leaves it out (every replica here averages every
# round), the bytes figures count it.
AVERAGE_STATE_EVERY = LOCAL_UPDATES.average_state_every


@dataclass(frozen=True)
class Config:
    """One way of running the swarm's rounds; the defaults are ``wan.py``'s (peerd's) settings."""

    name: str
    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    local_steps: int = 20
    overlapped: bool = True  # round t's outer step lands at the end of round t+1
    codec: str = "blockwise_8bit"
    error_feedback: bool = True
    owed_in_params: bool = False  # lr 1, momentum 0: each peer's params keep what it still owes
    warmup_rounds: int = 0  # the first rounds take warmup_steps local steps each
    warmup_steps: int = 5
    inner_lr_scale: float = 1.0
    aggregation: str = "mean"  # or "centered-clip": each reducer's shard as a public swarm's (checked) rounds
    fragments: int = 1  # streamed: rounds of local_steps / fragments steps take turns averaging a fragment

    def round_lengths(self, steps: int) -> list[int]:
        """Local steps of each round, adding up to ``steps``."""
        lengths: list[int] = []
        while sum(lengths) < steps:
            size = self.warmup_steps if len(lengths) < self.warmup_rounds else self.local_steps // self.fragments
            lengths.append(min(size, steps - sum(lengths)))
        return lengths


BENCH = Config("bench: overlapped int8+EF lr0.7 m0.9")
SEQ = replace(BENCH, name="sequential int8+EF", overlapped=False)
# The sparse scheme as LocalUpdatesOptimizer runs it with a sparse codec: unsent progress stays in
# each peer's parameters, outer lr 1 without momentum.
SPARSE = replace(
    BENCH, name="overlapped topk_2bit+EF owed in params", codec="topk_2bit", outer_lr=1.0, momentum=0.0,
    nesterov=False, owed_in_params=True,
)  # fmt: skip
# As a public swarm runs them: each shard by CenteredClip, replies in what a checked round sends.
SPARSE_ROBUST = replace(SPARSE, name="overlapped topk_2bit+EF centered-clip", aggregation="centered-clip")
BENCH_ROBUST = replace(BENCH, name="overlapped int8+EF centered-clip", aggregation="centered-clip")
# Streamed fragments (``outer_fragments.py``): four fragments taking turns, one per 5 inner steps.
STREAMED = replace(BENCH, name="overlapped int8+EF 4 fragments", fragments=4)
STREAMED_SPARSE = replace(SPARSE, name="overlapped topk_2bit+EF 4 fragments", fragments=4)
CONFIGS = [
    BENCH,
    SPARSE,
    STREAMED,
    STREAMED_SPARSE,
    SEQ,
    replace(SPARSE, name="sequential topk_2bit+EF owed in params", overlapped=False),
    replace(SPARSE, name="overlapped topk_4bit+EF owed in params", codec="topk_4bit"),
    replace(SPARSE, name="overlapped topk_2bit+EF owed in params, rounds of 10", local_steps=10),
    SPARSE_ROBUST,
    BENCH_ROBUST,
    replace(SPARSE, name="overlapped topk_2bit+EF owed in buffer", owed_in_params=False),
    replace(BENCH, name="overlapped topk_2bit+EF lr0.7 m0.9", codec="topk_2bit"),
    replace(SEQ, name="sequential float32", codec="none", error_feedback=False),
    replace(BENCH, name="overlapped float32", codec="none", error_feedback=False),
    replace(SEQ, name="seq int8 no-EF", error_feedback=False),
    replace(SEQ, name="seq lr1.0 m0.9", outer_lr=1.0),
    replace(SEQ, name="seq lr1.4 m0.9", outer_lr=1.4),
    replace(SEQ, name="seq lr1.0 m0 (=model avg)", outer_lr=1.0, momentum=0.0, nesterov=False),
    replace(SEQ, name="seq lr0.7 m0.9 no-nesterov", nesterov=False),
    replace(SEQ, name="seq H=10", local_steps=10),
    replace(SEQ, name="seq H=5", local_steps=5),
    replace(BENCH, name="overlapped lr1.0 m0", outer_lr=1.0, momentum=0.0, nesterov=False),
    replace(SEQ, name="seq warm-up 4x H=5", warmup_rounds=4, warmup_steps=5),
    replace(SEQ, name="seq inner lr x2", inner_lr_scale=2.0),
]


def _batches(task: Task, count: int) -> list:
    return [next(task.batches) for _ in range(count)]


def _evaluate(task: Task, model: torch.nn.Module) -> float:
    model.eval()
    figure = task.evaluate(model)["bits_per_byte"]
    model.train()
    return figure


def _optimizer(task: Task, model: torch.nn.Module, lr_scale: float) -> torch.optim.Optimizer:
    optimizer = task.make_optimizer(list(model.parameters()))
    for group in optimizer.param_groups:
        group["lr"] *= lr_scale
    return optimizer


def _train(task: Task, model, optimizer, batch) -> None:
    task.loss_fn(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_solo(task: Task, batches: list, every: int, lr_scale: float = 1.0) -> dict[int, float]:
    """bpb after each ``every`` steps (keyed by samples)."""
    model = copy.deepcopy(task.model)
    model.train()
    optimizer = _optimizer(task, model, lr_scale)
    curve = {}
    for step, batch in enumerate(batches, 1):
        _train(task, model, optimizer, batch)
        if step % every == 0:
            curve[step * task.batch_size] = _evaluate(task, model)
    return curve


def run_sync(task: Task, shard_batches: list[list], steps: int, every: int, lr_scale: float = 1.0) -> dict[int, float]:
    """Gradients averaged over the peers every step: one batch of all their batches."""
    merged = [tuple(torch.cat([shard_batches[p][i][k] for p in range(PEERS)]) for k in range(2)) for i in range(steps)]
    curve = run_solo(task, merged, every, lr_scale)
    return {samples * PEERS: value for samples, value in curve.items()}  # run_solo counted one peer's batch


def _average(
    replicas: list[OuterStep], codec_name: str, feedbacks: list[ErrorFeedback] | None, aggregation: str = "mean"
) -> None:
    """All-reduce the replicas' deltas in place, as peerd's butterfly all-reduce computes it: each
    shard's mean, or its CenteredClip from the reducer's own part, replied in the codec a checked
    round replies in (``Codec.reply_codec``)."""
    codec = get_codec(codec_name)
    robust = aggregation == "centered-clip"
    reply = codec.reply_codec(checked=robust)
    lossy = codec_name != "none"
    if feedbacks is not None:
        for feedback, outer in zip(feedbacks, replicas, strict=True):
            feedback.add_residual(outer.deltas)
    flats = [torch.cat([d.reshape(-1) for d in outer.deltas]) for outer in replicas]
    total = flats[0].numel()
    bounds = [(total * j // PEERS, total * (j + 1) // PEERS) for j in range(PEERS)]

    def sent(values: torch.Tensor, by: Codec = codec) -> torch.Tensor:
        return by.decode(*by.encode(values.contiguous()), values.numel()) if lossy else values

    averaged = torch.empty(total)
    for reducer, (start, end) in enumerate(bounds):
        # the reducer's own part exact, as peerd adds it; a sparse codec's as sent (``as_sent``)
        own = codec.sparse
        parts = [flat[start:end] if i == reducer and not own else sent(flat[start:end]) for i, flat in enumerate(flats)]
        if robust:
            aggregate = torch.empty(end - start)
            centered_clip(parts, [1.0] * PEERS, aggregate, center=parts[reducer])
        else:
            aggregate = torch.stack(parts).mean(dim=0)
        averaged[start:end] = sent(aggregate, reply)
    for outer in replicas:
        offset = 0
        for delta in outer.deltas:
            delta.copy_(averaged[offset : offset + delta.numel()].view_as(delta))
            offset += delta.numel()
    if feedbacks is not None:
        plan = SimpleNamespace(num_shards=PEERS, parts=lambda j: [bounds[j]])
        for me, feedback in enumerate(feedbacks):
            result = SimpleNamespace(plan=plan, my_shard=me, local_shards=(), part_contributors={}, contributors={})
            feedback.settle(result, replicas[me].deltas)


def _keep_owed(config: Config, outers, feedbacks: list[ErrorFeedback] | None) -> None:
    """After an outer step, as LocalUpdatesOptimizer.advance: what each peer still owes moves from
    its residual into its parameters (``ErrorFeedback.move_into``)."""
    if config.owed_in_params and feedbacks is not None:
        for outer, feedback in zip(outers, feedbacks, strict=True):
            feedback.move_into(outer.params)


def _outer_steps(model: torch.nn.Module, config: Config) -> list[OuterStep]:
    """One replica's outer step per fragment (one: the whole model)."""
    params = list(model.parameters())
    options = {"lr": config.outer_lr, "momentum": config.momentum, "nesterov": config.nesterov}
    return OuterFragments(params, config.fragments, **options).steps


def run_swarm(
    tasks: list[Task], shard_batches: list[list], config: Config, steps: int, every: int
) -> tuple[dict[int, float], int, float]:
    """bpb of the best replica whenever each has taken a multiple of ``every`` steps (keyed by the
    swarm's samples), the payload bytes one peer sent per round, summed, and the worst replica's
    final bpb (replicas differ where each keeps its unsent progress)."""
    models = [copy.deepcopy(tasks[0].model) for _ in range(PEERS)]
    optimizers = [_optimizer(tasks[0], model, config.inner_lr_scale) for model in models]
    # by fragment, then replica: what the round of fragment f averages is fragments[f]
    fragments = list(zip(*(_outer_steps(model, config) for model in models), strict=True))
    lossy = config.error_feedback and config.codec != "none"
    feedbacks = [
        [ErrorFeedback(outer.deltas, config.codec) for outer in outers] if lossy else None for outers in fragments
    ]
    codec = get_codec(config.codec)
    reply = codec.reply_codec(checked=config.aggregation == "centered-clip")

    def round_bytes(outers: tuple[OuterStep, ...]) -> int:
        shard = sum(d.numel() for d in outers[0].deltas) // PEERS
        return (PEERS - 1) * (codec.payload_size(shard) + reply.payload_size(shard))

    in_flight: tuple[int, list[list[torch.Tensor]]] | None = None  # overlapped: a fragment and its anchors
    curve: dict[int, float] = {}
    sent_bytes, done, worst = 0, 0, float("nan")
    for number, length in enumerate(config.round_lengths(steps)):
        for index in range(length):
            for peer in range(PEERS):
                _train(tasks[peer], models[peer], optimizers[peer], shard_batches[peer][done + index])
        done += length
        turn = number % config.fragments
        outers, feedback = fragments[turn], feedbacks[turn]
        if config.overlapped:
            if in_flight is not None:  # the previous round's average lands now
                landing, anchors = in_flight
                for outer, anchor in zip(fragments[landing], anchors, strict=True):
                    outer.apply_delayed(anchor)
                _keep_owed(config, fragments[landing], feedbacks[landing])
            in_flight = (turn, [outer.compute_deltas_and_anchor() for outer in outers])
            _average(list(outers), config.codec, feedback, config.aggregation)  # in flight until the next round ends
        else:
            for outer in outers:
                outer.compute_deltas()
            _average(list(outers), config.codec, feedback, config.aggregation)
            for outer in outers:
                outer.apply()
            _keep_owed(config, outers, feedback)
        sent_bytes += round_bytes(outers)
        if done % every == 0:
            figures = [_evaluate(tasks[0], model) for model in models]
            curve[done * PEERS * tasks[0].batch_size] = min(figures)
            worst = max(figures)
    return curve, sent_bytes, worst


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    size = "tiny" if args.quick else args.model_size
    rounds, every = (3, 5) if args.quick else (args.rounds, args.every)
    steps = rounds * (5 if args.quick else 20)  # each replica's steps: the benchmark's rounds of 20
    configs = CONFIGS
    if args.quick:
        configs = [replace(c, local_steps=5) for c in (BENCH, SPARSE, STREAMED, STREAMED_SPARSE)]
    elif args.only:
        wanted = args.only.split(",")
        configs = [c for c in CONFIGS if any(w in c.name for w in wanted)]
    tasks = [load_task("textlm", shard=ShardSpec(i, PEERS), model_size=size) for i in range(PEERS)]
    whole = load_task("textlm", shard=ShardSpec(0, 1), model_size=size)
    if args.seed:
        _draw_initial_model([whole, *tasks], args.seed)
    shard_batches = [_batches(task, steps) for task in tasks]
    batch = tasks[0].batch_size
    started = time.process_time()
    solo = run_solo(whole, _batches(whole, PEERS * steps), PEERS * every)
    rows: list[tuple[str, dict[int, float], float | None]] = [("solo (4x steps)", solo, None)]
    rows.append(("sync DP", run_sync(tasks[0], shard_batches, steps, every), None))
    if not args.quick and not args.only:
        rows.append(("sync DP inner lr x2", run_sync(tasks[0], shard_batches, steps, every, lr_scale=2.0), None))
    for name, curve, _ in rows:
        print(f"{name}: " + " ".join(f"{v:.3f}" for v in curve.values()), file=sys.stderr, flush=True)
    print(f"baselines: {time.process_time() - started:.0f} s CPU", file=sys.stderr, flush=True)
    bench_bytes = None
    worst: dict[str, float] = {}
    for config in configs:
        begun = time.process_time()
        curve, sent, worst[config.name] = run_swarm(tasks, shard_batches, config, steps, every)
        per_sample = sent / (steps * batch)
        bench_bytes = per_sample if config is configs[0] else bench_bytes
        rows.append((config.name, curve, per_sample))
        trace = " ".join(f"{v:.3f}" for v in curve.values())
        seconds = time.process_time() - begun
        line = f"{config.name}: {trace}, worst {worst[config.name]:.3f} ({seconds:.0f} s CPU)"
        print(line, file=sys.stderr, flush=True)

    points = sorted(solo)
    width = max(len(name) for name, _, _ in rows)
    header = "  ".join(f"{p:>7}" for p in points)
    print(f"{'held-out bits/byte at swarm samples':<{width}}  {header}  ratio  B/sample")
    summary: dict[str, dict] = {}
    for name, curve, per_sample in rows:
        figures = "  ".join(f"{curve[p]:7.3f}" if p in curve else "      -" for p in points)
        final = curve.get(points[-1])
        ratio = final / solo[points[-1]] if final else None
        note = f"{per_sample:8.0f}" if per_sample is not None else "       -"
        print(f"{name:<{width}}  {figures}  {ratio:5.3f}  {note}")
        summary[name] = {"bpb": round(final, 4) if final else None, "loss_ratio": round(ratio, 4) if ratio else None}
        if per_sample is not None and bench_bytes:
            summary[name]["bytes_per_sample_vs_bench"] = round(per_sample / bench_bytes, 3)
    figures = {"model_size": size, "seed": args.seed, "steps_per_replica": steps, "samples": points[-1]}
    print(json.dumps({**figures, **_sparse_figures(summary, worst, numel_of(tasks[0])), "rows": summary}))


def _draw_initial_model(tasks: list[Task], seed: int) -> None:
    """Every task's model replaced by one other initial model, drawn from ``seed`` (the task's
    own is seed 0), so that a figure can be judged over several initial models, not one."""
    torch.manual_seed(seed)
    drawn = type(tasks[0].model)(tasks[0].model.shape)
    for task in tasks:
        task.model.load_state_dict(drawn.state_dict())


def numel_of(task: Task) -> int:
    return sum(p.numel() for p in task.model.parameters())


def _sparse_figures(summary: dict[str, dict], worst: dict[str, float], numel: int) -> dict:
    """The issue's figures for the sparse scheme: bytes per round against float32 and int8 (one
    peer's, out and back, as ``run_swarm`` counts them), held-out loss against today's int8 local
    updates and synchronous data parallelism at the same samples (best replica, and worst)."""
    shard = numel // PEERS
    sparse_bytes = get_codec(SPARSE.codec).payload_size(shard)
    dense_bytes = get_codec("none").payload_size(shard)
    start_bytes = dense_bytes / AVERAGE_STATE_EVERY  # the start's float32 averaging, per round
    sparse_start_bytes = start_bytes / start_pieces(SPARSE.codec)  # a piece at a time
    figures = {
        "sparse_codec": SPARSE.codec,
        "bytes_vs_float32": round(dense_bytes / sparse_bytes, 1),
        "bytes_vs_int8": round(get_codec(BENCH.codec).payload_size(shard) / sparse_bytes, 1),
        # robust (checked) rounds: contributions as above, replies in the codec checks can bound
        "bytes_vs_float32_robust": round(
            2 * dense_bytes / (sparse_bytes + get_codec(SPARSE.codec).reply_codec(checked=True).payload_size(shard)), 1
        ),
        "bytes_vs_float32_with_start_averaging": round(
            (dense_bytes + start_bytes) / (sparse_bytes + sparse_start_bytes), 1
        ),
    }
    sparse, int8, sync = (summary.get(name, {}).get("bpb") for name in (SPARSE.name, BENCH.name, "sync DP"))
    if sparse and int8:
        figures["loss_vs_int8"] = round(sparse / int8, 4)
        figures["loss_vs_int8_worst_replica"] = round(worst[SPARSE.name] / int8, 4)
    if sparse and sync:
        figures["loss_vs_sync_dp"] = round(sparse / sync, 4)
    for config in (STREAMED, STREAMED_SPARSE):  # streamed fragments against the same scheme whole
        streamed, whole = (summary.get(name, {}).get("bpb") for name in (config.name, BENCH.name))
        key = "loss_streamed_sparse_vs_int8" if config.owed_in_params else "loss_streamed_int8_vs_int8"
        if streamed and whole:
            figures[key] = round(streamed / whole, 4)
    figures["streamed_peak_in_flight_vs_whole"] = round(1 / STREAMED.fragments, 3)
    robust, robust_int8 = (summary.get(name, {}).get("bpb") for name in (SPARSE_ROBUST.name, BENCH_ROBUST.name))
    if robust and robust_int8:  # both under centered-clip, as a public swarm's rounds are
        figures["loss_vs_int8_robust"] = round(robust / robust_int8, 4)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 rounds of 5 steps, 4 rows")
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of 20 local steps per replica")
    parser.add_argument("--every", type=int, default=20, help="evaluate every this many steps per replica")
    parser.add_argument("--only", default="", help="comma-separated parts of row names to run")
    parser.add_argument("--seed", type=int, default=0, help="the initial model: 0 the task's own, another a draw")
    main(parser.parse_args())
