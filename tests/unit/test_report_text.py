"""`unbroken report`'s text (telemetry/summary.py `format_summary`): where each fault
happened (node, host), whether it was injected, what it cost; the checkpoint saves that
failed and why; every line plain text, no Python repr. Pure: summaries built in the test."""

from __future__ import annotations

from unbroken.telemetry import schema as ev
from unbroken.telemetry.summary import format_summary, summary_of


def summary(**changes):
    base = {"run_dir": "/runs/a, /runs/b", "steps_known": True, "steps": 60,
            "steps_computed": 63, "attempts": 1, "wall": 30.0, "step_time": 0.05,
            "first_loss": 4.2, "final_loss": 2.1, "exit_code": 0, "checkpoints_failed": [],
            "faults": [{"kind": "crash", "rank": 1, "node": 0, "host": "ip-10-0-1-7",
                        "attempt": 0, "step": 12, "detail": "", "in_place": True,
                        "injected": True, "detection": 0.05, "downtime": 0.21, "redone": 1,
                        "cost": 0.93, "restart_s": None}]}
    return base | changes


def test_a_fault_says_where_whether_injected_and_what_it_cost():
    text = format_summary(summary())
    assert text.splitlines()[0] == "run /runs/a, /runs/b"
    (line,) = [x for x in text.splitlines() if x.strip().startswith("1.")]
    assert "rank 1 on node 0 (ip-10-0-1-7) at step 12 (injected): detected in 0.05s" in line
    assert "0.21s to the next step (in place), 1 step(s) redone, cost 0.9 rank-s" in line
    assert "[" not in text and "{" not in text


def test_failed_checkpoint_saves_are_named_with_why():
    events = [ev.CheckpointFailed(t=1.0 + r, source="worker", slot=r, rank=r, step=20,
                                  error="rank 1: OSError: [Errno 28] No space left on device")
              for r in (0, 1)]
    failed = summary_of(events, "/runs/a")["checkpoints_failed"]
    assert failed == [{"step": 20, "error": "rank 1: OSError: [Errno 28] No space left on device"}]
    text = format_summary(summary(checkpoints_failed=failed))
    assert "  checkpoints     1 save(s) failed; the previous one stayed the latest:" in text
    assert "    step 20: rank 1: OSError: [Errno 28] No space left on device" in text
