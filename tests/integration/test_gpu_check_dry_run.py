"""`benchmarks/gpu_check.py --dry-run`: every check runs in a process of its own, with the
in-place worker's environment, on CPU tensors and gloo up to its first CUDA-only call, and
the script ends with the JSON a GPU run gives. This proves the script is ready for the day
a GPU is lent; it proves nothing about CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CONTROL_FLOW = ("A", "C", "D", "E", "F", "G", "J", "K", "L", "M", "1", "6")
"""The checks whose own code runs on CPU (the rest are CUDA's or NCCL's alone)."""


def test_the_dry_run_lists_every_check_and_runs_the_control_flow_of_a_c_d_e_f_g(tmp_path):
    out = tmp_path / "checks.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--jobs", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["dry_run"] is True and report["torch"]
    checks = report["checks"]
    letters = {key.split("_")[0]: value for key, value in checks.items()}
    assert set("ABCDEFGHI") <= set(letters), sorted(letters)
    for letter in CONTROL_FLOW:
        assert letters[letter]["result"] == "pass", (letter, letters[letter])
        assert letters[letter]["why"].startswith("dry run:"), letters[letter]
    assert all(v["result"] in ("pass", "skipped") for v in checks.values()), checks
    assert letters["A"]["fence_refused"] is True and letters["A"]["state_whole"] is True
    ring = letters["M"]  # a shard streamed through the exchange's ring, bytes equal
    assert ring["ring_mib"] == 16 and ring["shard_mib"] > ring["ring_mib"], ring
    assert letters["E"]["host_bytes"] < letters["E"]["nbytes"] * 1.01, letters["E"]
    fork = letters["L"]  # forked with transformers and accelerate pre-imported
    assert fork["before"] == {"torch": True, "transformers": True, "accelerate": True}, fork
    # Each check appended its line as it ended: a run cut off returns what ran.
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["check"] for line in lines) == sorted(checks)


def test_only_reruns_a_subset_and_an_unknown_check_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "f",
                           "--out", str(tmp_path / "c.jsonl")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(json.loads(proc.stdout.strip().splitlines()[-1])["checks"]) == [
        "F_state_sync_on_device"]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "Z"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "--only: no check ['Z']" in bad.stderr
