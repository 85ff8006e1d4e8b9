"""`unbroken report` still reads a run directory written before the events had a schema:
tests/unit/fixtures/old_run is a real demo run's log (2 workers, 40 steps, a crash, a hang and
an exception), kept as it was written, with the report and summary it gave then."""

import json
import shutil
from pathlib import Path

from unbroken.cli import main
from unbroken.telemetry.report import build_report
from unbroken.telemetry.summary import summarize

OLD_RUN = Path(__file__).parent / "fixtures" / "old_run"


def test_an_old_run_dir_reports_as_it_did(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(OLD_RUN / "events.jsonl", run)
    expected = json.loads((OLD_RUN / "expected.json").read_text())
    report = build_report([run])
    assert report.pop("run_dir") == str(run)
    # Added since (issue 28): whether each fault was injected; the rest is as it was then.
    # The demo injected all three (its log has their `fault_injected` events).
    assert [f.pop("injected") for f in report["faults"]] == [True, True, True]
    # Added since: each fault's host, downtime and redone steps beside its cost (the
    # summary's own figures), and the summary's failed checkpoint saves.
    summary = summarize(run)
    for row, seen in zip(report["faults"], summary["faults"], strict=True):
        assert [row.pop(k) for k in ("host", "downtime", "redone")] == \
            [seen.pop("host"), seen["downtime"], seen["redone"]]
        assert seen.pop("injected") is True
    assert json.loads(json.dumps(report, sort_keys=True)) == expected["report"]
    summary.pop("run_dir")
    failed = summary.pop("checkpoints_failed")
    assert all(set(c) == {"step", "error"} for c in failed)
    assert json.loads(json.dumps(summary, sort_keys=True)) == expected["summary"]


def test_unbroken_report_prints_an_old_run(tmp_path, capsys, monkeypatch):
    shutil.copy(OLD_RUN / "events.jsonl", tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["report", ".", "--csv", "tables"]) == 0
    assert capsys.readouterr().out == (OLD_RUN / "expected.txt").read_text()
    assert (tmp_path / "tables" / "steps.csv").read_text().splitlines()[0] == \
        "slot,rank,attempt,gen,step,start,end,duration,loss,redone"
