"""The examples run as a user would run them: separate processes on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_embed_averager_copies_average_with_each_other(tmp_path):
    script = [sys.executable, str(EXAMPLES / "embed_averager.py"), "--rounds", "3", "--group-size", "3"]
    first = subprocess.Popen(script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    others = []
    try:
        line = first.stdout.readline()
        assert line.startswith("started, join with --initial-peer "), line
        address = line.split()[-1]
        others = [
            subprocess.Popen(
                script + ["--initial-peer", address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for _ in range(2)
        ]
        outputs = [first.communicate(timeout=90)[0]] + [p.communicate(timeout=90)[0] for p in others]
    finally:
        for process in [first, *others]:
            process.kill()
            process.wait()
    assert all(p.returncode == 0 for p in [first, *others]), outputs
    weights = []
    for output in outputs:
        assert "averaged with 3 peers" in output, output
        weights.append([line for line in output.splitlines() if "weight[0]" in line])
    # after each round all copies hold the same averaged weight (printed under the tensor lock)
    assert weights[0][-1] == weights[1][-1] == weights[2][-1], weights
