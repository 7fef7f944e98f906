"""A trainer with no swarm: the ``textlm`` task's own loop, no DHT, no averaging. The baseline of
``benchmarks/wan.py``: what one machine does alone, on the same CPU, in the same time.

Prints ``ready`` once the task is built, then (after ``go`` on stdin) trains and prints one JSON
line per ``--report-every`` seconds: ``samples``, ``seconds``. With ``--samples N`` it stops after N
samples and prints ``{"done": true, "samples", "seconds", "eval": {...}}`` (held-out figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peerd.tasks import ShardSpec, load_task  # noqa: E402


def main(args: argparse.Namespace) -> None:
    task = load_task("textlm", shard=ShardSpec(args.shard, args.shards), model_size=args.model_size)
    optimizer = task.make_optimizer(list(task.model.parameters()))
    print("ready", flush=True)
    sys.stdin.readline()

    def train_step() -> None:
        task.model.train()
        task.loss_fn(task.model, next(task.batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Steps run in a worker thread, as peerd's trainer runs them: torch's intra-op threading
    # differs between the main thread and others (on a busy machine by up to 5x), and the
    # baseline must compute exactly as the swarm's peers do.
    worker = ThreadPoolExecutor(1)
    started = last_report = time.monotonic()
    samples = 0
    while args.samples is None or samples < args.samples:
        worker.submit(train_step).result()
        samples += task.batch_size
        now = time.monotonic()
        if now - last_report >= args.report_every:
            last_report = now
            print(json.dumps({"samples": samples, "seconds": now - started}), flush=True)
    task.model.eval()
    outcome = {"done": True, "samples": samples, "seconds": time.monotonic() - started}
    outcome["eval"] = task.evaluate(task.model)
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--samples", type=int, default=None, help="stop after this many samples")
    parser.add_argument("--report-every", type=float, default=1.0)
    main(parser.parse_args())
