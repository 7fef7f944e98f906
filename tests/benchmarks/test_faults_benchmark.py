"""benchmarks/faults.py runs its scenarios in the network lab and reports every figure in its last
line, a failed scenario as a result rather than a crash.

Only the two short scenarios run here (~25 s on 2 cores); the figures themselves are not asserted,
since fixes land independently: the report's shape is. Skips like the lab tests when not root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LAB_GROUP
from tests.support.netlab import lab_unavailable

pytestmark = LAB_GROUP  # its benchmark builds the network lab
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
def test_the_fault_benchmark_reports_each_scenario_and_one_json_line():
    reason = lab_unavailable()
    if reason is not None:
        if os.environ.get("PEERD_REQUIRE_NETLAB") == "1":
            pytest.fail(f"PEERD_REQUIRE_NETLAB=1 but {reason}")
        pytest.skip(reason)
    completed = subprocess.run(
        [sys.executable, "benchmarks/faults.py", "--quick", "--only", "dead_reducer", "leader_death"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary) >= {"dead_reducer_detect_s", "leader_death_failed_rounds", "partition_heal_s", "scenarios"}
    assert summary["partition_heal_s"] is None  # not run here
    for name in ("dead_reducer", "leader_death"):
        scenario = summary["scenarios"][name]
        assert isinstance(scenario["ok"], bool) and (scenario["ok"] or scenario["error"]), scenario
        assert any(line.startswith(name) for line in lines), completed.stdout
    if summary["scenarios"]["dead_reducer"]["ok"]:
        assert summary["dead_reducer_detect_s"] >= 0 and summary["scenarios"]["dead_reducer"]["no_fault_s"] > 0
    if summary["scenarios"]["leader_death"]["ok"]:
        assert isinstance(summary["leader_death_failed_rounds"], int)
