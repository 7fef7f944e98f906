"""Benchmarks that cannot rot: each in-process benchmark runs at its smallest size, as a user
would run it, and must end with one JSON line that carries its headline figure and no error.
(The lab's benchmarks, byzantine.py and the report helpers have tests of their own beside this.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMALLEST = {
    "transport": (["--quick", "--size-mib", "16", "--rounds", "1", "--calls", "200"], "stream_ratio"),
    "allreduce": (["--quick", "--numel", "65536", "--reps", "1"], "gloo_ratio"),
    "moe": (["--quick", "--hidden", "64", "--batch", "32"], "ratio"),
    "training": (["--quick", "--solo-s", "0.5", "--collab-s", "1.5", "--target-batch-sizes", "256"], "overhead_ratio"),
    "diloco_sim": (["--quick"], "rows"),
}


@pytest.mark.parametrize("name", list(SMALLEST))
def test_a_benchmark_at_its_smallest_size_ends_with_its_json_line(name):
    flags, headline = SMALLEST[name]
    completed = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", *flags], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    last = json.loads(completed.stdout.strip().splitlines()[-1])
    assert "error" not in last, last
    assert last[headline] is not None, last
