"""Remote experts against the same experts in-process: forward+backward throughput and small-call latency.

An expert server runs as a separate OS process (``peerd serve-experts``) on 127.0.0.1;
this process calls it through ``RemoteExpert`` (forward, then backward with the server's optimizer
step) and, as the baseline in the same run, calls an identical FFN expert with the same optimizer
in-process. Prints a table, then one JSON line.

    python benchmarks/moe.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe.client import MoEClient  # noqa: E402
from moe.experts import ExpertBackend  # noqa: E402
from moe.remote import RemoteExpert  # noqa: E402
from peer import LOCAL_DIFFICULTY  # noqa: E402

SERVER_START_TIMEOUT = 60.0


def start_server(hidden: int, batch: int) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "peerd.cli",
        "--log-level",
        "WARNING",
        "serve-experts",
        "--experts",
        "bench.0",
        "--node-id-difficulty",  # a local run, as the client's default
        str(LOCAL_DIFFICULTY),
    ]
    command += ["--hidden-dim", str(hidden), "--max-batch-size", str(batch), "--listen", "127.0.0.1:0", "--seed", "0"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parent.parent,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    line = b""
    while not line.endswith(b"\n"):
        if time.monotonic() > deadline or not selector.select(deadline - time.monotonic()):
            process.kill()
            raise RuntimeError("the expert server did not start")
        chunk = os.read(process.stdout.fileno(), 4096)
        if not chunk:
            raise RuntimeError(f"the expert server exited with {process.wait()}")
        line += chunk
    selector.close()
    return process, line.decode().split(" at ")[-1].strip()


def throughput(step, batch: int, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    hidden = args.hidden or (512 if args.quick else 1024)
    steps, pairs, warmup, small_calls = (4, 9, 2, 200) if args.quick else (5, 15, 3, 500)
    batch = args.batch

    torch.manual_seed(0)
    x = torch.randn(batch, hidden)
    grad = torch.randn(batch, hidden)

    local = ExpertBackend.create("ffn", hidden, seed=0, device="cpu")

    def local_step() -> None:
        inputs = x.clone().requires_grad_(True)
        local.optimizer.zero_grad(set_to_none=True)
        local.module(inputs).backward(grad)
        local.optimizer.step()

    one = torch.randn(1, hidden)
    process, address = start_server(hidden, batch)
    client = MoEClient.start()
    try:
        expert = RemoteExpert("bench.0", address, client, timeout=60)

        def remote_step() -> None:
            inputs = x.clone().requires_grad_(True)
            expert(inputs).backward(grad)

        # Short windows in alternation, so that background load on the machine hits both alike;
        # the ratio is the median over adjacent pairs of windows (this shared machine's speed
        # drifts within a run, and a single slow window must not decide it), each pair's order
        # swapped from the last so that what one side leaves behind (the server's threads still
        # busy) weighs on both alike.
        for _ in range(warmup):
            local_step()
            remote_step()
        local_rates, remote_rates = [], []
        for pair in range(pairs):
            for step, rates in ((local_step, local_rates), (remote_step, remote_rates))[:: 1 if pair % 2 else -1]:
                rates.append(throughput(step, batch, steps))
        local_rate, remote_rate = statistics.median(local_rates), statistics.median(remote_rates)
        ratio = statistics.median(r / loc for loc, r in zip(local_rates, remote_rates, strict=True))

        latencies = []
        with torch.no_grad():
            for _ in range(20):
                expert(one)
            for _ in range(small_calls):
                start = time.perf_counter()
                expert(one)
                latencies.append((time.perf_counter() - start) * 1000)
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # The same single-sample forward in-process: what the expert itself costs (at hidden 1024 it
    # reads 32 MiB of weights per call, which is memory-bound), so the RPC overhead is the difference.
    local_latencies = []
    for _ in range(small_calls // 4):
        start = time.perf_counter()
        local.forward(one)
        local_latencies.append((time.perf_counter() - start) * 1000)
    p50 = statistics.median(latencies)
    local_p50 = statistics.median(local_latencies)
    p90 = statistics.quantiles(latencies, n=10)[-1]
    result = {
        "benchmark": "moe",
        "hidden_dim": hidden,
        "batch": batch,
        "expert": "ffn",
        "remote_samples_per_s": round(remote_rate, 1),
        "local_samples_per_s": round(local_rate, 1),
        "ratio": round(ratio, 3),
        "ratio_pairs": pairs,
        "small_call_p50_ms": round(p50, 3),
        "small_call_p90_ms": round(p90, 3),
        "small_call_local_p50_ms": round(local_p50, 3),
        "small_call_overhead_p50_ms": round(p50 - local_p50, 3),
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
    }
    print(f"{'measure':<36}{'value':>14}")
    print(f"{'local fwd+bwd samples/s':<36}{local_rate:>14.1f}")
    print(f"{'remote fwd+bwd samples/s':<36}{remote_rate:>14.1f}")
    print(f"{'ratio remote/local (median pair)':<36}{ratio:>14.3f}")
    print(f"{'single-sample call p50 ms':<36}{p50:>14.3f}")
    print(f"{'single-sample call p90 ms':<36}{p90:>14.3f}")
    print(f"{'single-sample local forward p50 ms':<36}{local_p50:>14.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
