"""Protection decided by behaviour, in a real job: an unmodified Trainer script under
`unbroken run` (2 workers, gloo) whose installed transformers is altered before the script
imports it (a `sitecustomize` on PYTHONPATH, as a new release would differ). A missing seam
and a broken update order are each one line naming them, and the job trains unprotected
and finishes, as under torchrun."""

from __future__ import annotations

import os

import pytest
from conftest import REPO, launch

pytest.importorskip("transformers")

SCRIPT = REPO / "examples" / "hf_trainer" / "train.py"

RENAMED_PARAMETER = '''
import transformers.trainer as t  # noqa
_original = t.Trainer.training_step
def training_step(self, model, batch, num_items_in_batch=None):  # `inputs` renamed
    return _original(self, model, batch, num_items_in_batch)
t.Trainer.training_step = training_step
'''

NO_PRE_OPTIMIZER_CALLBACK = '''
import transformers.trainer_callback as c
c.CallbackHandler.on_pre_optimizer_step = lambda self, args, state, control: control
'''


def _altered(tmp_path, monkeypatch, code: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    # Every process of the job imports transformers as it starts, altered; the adapter's
    # hook finds the Trainer already imported and protects it (or not) as ever.
    (site / "sitecustomize.py").write_text(code)
    path = [str(site), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))


def _run(tmp_path):
    return launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "1",
                  script=SCRIPT, timeout=300,
                  args=["--output-dir", str(tmp_path / "out"), "--steps", "6",
                        "--save-steps", "100", "--accum", "2"])


def test_a_seam_whose_parameters_changed_is_one_line_and_the_job_trains_unprotected(
        tmp_path, monkeypatch):
    _altered(tmp_path, monkeypatch, RENAMED_PARAMETER)
    result = _run(tmp_path)
    assert result.code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "trains unprotected" in ln]
    assert lines and all("Trainer.training_step takes no parameter inputs" in ln for ln in lines)
    assert not result.events("resume"), "the engine entered a job it should have left alone"


def test_a_broken_update_order_turns_in_place_off_in_one_line_and_the_job_finishes(
        tmp_path, monkeypatch):
    _altered(tmp_path, monkeypatch, NO_PRE_OPTIMIZER_CALLBACK)
    result = _run(tmp_path)
    assert result.code == 0, result.output
    offs = result.events("in_place_unavailable")
    assert len(offs) == 2, offs  # each worker, at its first update
    assert all("optimizer came after clip, not after pre_optimizer" in e["reason"] for e in offs)
    assert "in-place recovery is not available: the Trainer broke an order" in result.output
