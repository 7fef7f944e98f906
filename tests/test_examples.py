"""The examples run as a user would run them: separate processes on 127.0.0.1 (``examples/embed_averager.py``
drives the synchronous ``Averager`` of ``averaging/facade.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_embed_averager_copies_average_with_each_other(tmp_path):
    # All three in every round: with the example's default minimum of two, two copies that started
    # first can finish all their rounds as a pair (a round of this model takes ~20 ms) while the
    # third still imports torch on a loaded machine.
    script = [
        *[sys.executable, str(EXAMPLES / "embed_averager.py")],
        *["--rounds", "3", "--group-size", "3", "--min-group-size", "3"],
    ]
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
    # A copy that starts late may find the others' first rounds given up ("no group") and run a round
    # behind them; what must hold is that the three copies did average together: some round left
    # all three holding the same averaged weight.
    shared = None
    for output in outputs:
        lines = output.splitlines()
        after_full_rounds = {lines[i + 1] for i, line in enumerate(lines[:-1]) if "averaged with 3 peers" in line}
        assert after_full_rounds, output
        shared = after_full_rounds if shared is None else shared & after_full_rounds
    assert shared, outputs


def test_remote_moe_trains_as_a_user_runs_it_without_any_peerd_variables():
    """The suite sets PEERD_NODE_ID_DIFFICULTY for the processes it starts; a user's shell has none,
    so the script must bring its expert servers and its client to one difficulty by itself."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith("PEERD_")}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "remote_moe.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step   1" in result.stdout
