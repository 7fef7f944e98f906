"""Benchmarks that cannot rot: each benchmark runs at its smallest size, as a user would run it,
and must end with one JSON line that carries its headline figure and no error. (byzantine.py and
the faults and hostile benchmarks have tests of their own beside this; nat.py and wan.py run in
the network lab, so where the lab cannot run they are skipped with the lab's reason, and CI,
which requires the lab, fails instead.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LAB_GROUP
from tests.support.netlab import lab_unavailable

ROOT = Path(__file__).resolve().parents[2]

SMALLEST = {
    "transport": (["--quick", "--size-mib", "16", "--rounds", "1", "--calls", "200"], "stream_ratio"),
    "allreduce": (["--quick", "--numel", "65536", "--reps", "1"], "gloo_ratio"),
    "moe": (["--quick", "--hidden", "64", "--batch", "32"], "ratio"),
    "training": (["--quick", "--solo-s", "0.5", "--collab-s", "1.5", "--target-batch-sizes", "256"], "overhead_ratio"),
    "diloco_sim": (["--quick"], "loss_vs_int8"),
    "billion_sim": (["--quick", "--peers", "3", "--only", "sparse,sparse_streamed"], "wait_fraction_sparse_streamed"),
    "scale_tcp": (["--quick"], "averaged_fraction"),
    "nat": (["--quick", "--tries", "3", "--megabytes", "2"], "punch_success"),
    "dht": (["--smoke"], "get_ratio"),
    "scale": (["--peers", "8", "--dht-nodes", "32", "--optimizer-peers", "8"], "optimizer_averaged_fraction"),
    "wan": (["--quick", "--only", "allreduce"], "defaults_step_line_rate_fraction"),
    "join": (["--quick", "--runs", "1", "--epochs", "10"], "delayed_averaged_ratio"),
    "gpu_check": (["--quick", "--device", "cpu"], "checks"),  # the GPU machine's checks, run on the CPU
}
NEEDS_THE_NAT_LAB = {"nat"}
NEEDS_THE_LAB = {"wan"}


# Runs the GPU machine's checks on the CPU, which other tests cover one by one: ~25 s, so with --run-slow.
SLOW = {"gpu_check"}


def _marks(name: str) -> list:
    return [LAB_GROUP] * (name in NEEDS_THE_NAT_LAB | NEEDS_THE_LAB) + [pytest.mark.slow] * (name in SLOW)


@pytest.mark.parametrize("name", [pytest.param(name, marks=_marks(name)) for name in SMALLEST])
def test_a_benchmark_at_its_smallest_size_ends_with_its_json_line(name):
    flags, headline = SMALLEST[name]
    needs_a_lab = name in NEEDS_THE_NAT_LAB | NEEDS_THE_LAB
    if needs_a_lab and (reason := lab_unavailable(nat=name in NEEDS_THE_NAT_LAB)) is not None:
        if os.environ.get("PEERD_REQUIRE_NETLAB") == "1":
            pytest.fail(f"PEERD_REQUIRE_NETLAB=1 but {reason}")
        pytest.skip(reason)
    completed = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", *flags], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    last = json.loads(completed.stdout.strip().splitlines()[-1])
    assert last.get("error") is None and not last.get("errors"), last
    assert last[headline] is not None, last
