"""The Trainer integration under the last transformers 4.x (4.57), whose epoch loop differs
from 5.x's (`integrations/hf_versions.py`): the same unmodified job as test_hf_trainer.py,
its workers importing transformers 4.57 from `.venv/transformers-4.57` (installed next to the
venv's 5.x by `make install`; PYTHONPATH reaches the workers through `unbroken run`'s
environment).

The job is shaped so that the replacement lands where 4.x differs: 9 micro-batches per rank
and epoch with an accumulation of 2 (each epoch ends with a partial update of one
micro-batch), 5 updates per epoch, rank 1 SIGKILLed after step 6, so the replacement joins
in a later epoch than its loop's first, part-way through it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from conftest import REPO, assert_recovered_in_place, events_of, finish, launch, start, wait_for

TRANSFORMERS_4 = REPO / ".venv" / "transformers-4.57"
"""transformers 4.57.6 with the huggingface_hub, tokenizers and datasets it needs
(`pip install --no-deps --target`): on PYTHONPATH it shadows the venv's 5.x."""

if not (TRANSFORMERS_4 / "transformers").is_dir():
    if os.environ.get("CI"):  # CI installs it (make install): a skip there would hide a gap
        raise RuntimeError(f"{TRANSFORMERS_4} is not installed: run make install")
    pytest.skip(f"{TRANSFORMERS_4} is not installed (make install)", allow_module_level=True)

SCRIPT = REPO / "examples" / "hf_trainer" / "train.py"
STEPS = 16
FLAGS = ("--nproc-per-node", "2", "--max-restarts", "2", "--exact-reduction")


@pytest.fixture(autouse=True)
def transformers_4(monkeypatch):
    path = [str(TRANSFORMERS_4), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))


def _args(out, final, *extra: str) -> list[str]:
    return ["--output-dir", str(out), "--steps", str(STEPS), "--samples", "36", "--accum", "2",
            "--save-steps", "4", "--final", str(final), *extra]


def test_a_trainer_job_under_transformers_4_recovers_in_place_bit_identical(tmp_path):
    clean = launch(tmp_path / "clean", *FLAGS, script=SCRIPT, timeout=300,
                   args=_args(tmp_path / "clean-out", tmp_path / "clean.pt"))
    assert clean.code == 0, clean.output
    config = json.loads((tmp_path / "clean-out" / f"checkpoint-{STEPS}" / "config.json").read_text())
    assert config["transformers_version"] == "4.57.6"  # the workers ran 4.57

    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = start(run_dir, *FLAGS, "--on-fault", "wait", script=SCRIPT,
                 args=_args(out, tmp_path / "faulted.pt", "--step-sleep", "0.2"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: any(e["step"] >= 6 for e in events_of(run_dir, "step")), 120, "step 6",
             explain=run_dir)
    shutil.rmtree(out, ignore_errors=True)  # no checkpoint on storage to recover from
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS)
    joined = [e["step"] for e in result.events("gen_switch") if e["slot"] == 1][-1]
    assert joined > 5 and joined % 5, joined  # a later epoch than the loop's first, part-way

    reference = torch.load(tmp_path / "clean.pt", weights_only=True)
    final = torch.load(tmp_path / "faulted.pt", weights_only=True)
    differ = [k for k in reference if not torch.equal(reference[k], final[k])]
    assert not differ, f"parameters differ from the fault-free run: {differ}"
