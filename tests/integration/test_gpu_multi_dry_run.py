"""`benchmarks/gpu_multi.py --dry-run`: every multi-GPU scenario's `unbroken run` jobs, on
gloo CPU processes, with the checks the GPU run makes (in place, bit-identical to a
fault-free run, the fence's refusal, a generation that never formed, a spare promoted, HSDP
without a lost step). It proves the scenarios and their checks, nothing about NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_multi.py"


def test_every_scenario_runs_on_gloo_and_passes_its_checks(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    scenarios = report["scenarios"]
    assert list(scenarios) == ["kill", "fence", "never_arrives", "spare", "hsdp"], scenarios
    failed = {k: v for k, v in scenarios.items() if v["result"] != "pass"}
    assert not failed, json.dumps(failed, indent=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert scenarios["kill"]["received_bytes"] > 0
    assert scenarios["fence"]["leave_error"].startswith("UpdateRefused")
