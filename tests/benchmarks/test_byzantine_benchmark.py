"""benchmarks/byzantine.py trains a small in-process swarm against hostile peers and reports one
JSON line; here a few epochs on 4 peers check the report's shape and that liars get caught."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
def test_a_short_byzantine_run_reports_one_json_line():
    completed = subprocess.run(
        [sys.executable, "benchmarks/byzantine.py", "--quick", "--peers", "4", "--epochs", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    for name in ("accuracy_clean", "accuracy_f1", "accuracy_f2", "accuracy_f3", "robust_time_ratio"):
        assert isinstance(summary[name], float), name
    # with one or two liars among 4 peers, every honest sender checks every reducer: all caught
    assert summary["liars"] == 6 and summary["liars_caught"] >= 3
    assert summary["caught_after_epochs"]["f1"] == 1
    # the quick subset of quiet attacks, each measured against the clean run of the same swarm
    assert sorted(summary["quiet_accuracy"]) == sorted(
        f"{attack}/f2of4/iid/gradient" for attack in ("ipm-4", "alie-zmax", "label-flip", "min-max-std")
    )
    assert summary["quiet_clean"] == {"4/iid/gradient": summary["accuracy_clean"]}
    for family in ("model_poisoning", "label_flip"):
        assert isinstance(summary[f"worst_drop_{family}"], float)
        assert summary[f"worst_case_{family}"] in summary["quiet_accuracy"]
    # in two epochs the last tenth of the rounds is the last round: the late figures are the last ones
    assert {name: summary["quiet_late"][name] for name in summary["quiet_accuracy"]} == summary["quiet_accuracy"]
    assert summary["worst_drop_late"] == {f: summary[f"worst_drop_{f}"] for f in ("model_poisoning", "label_flip")}
