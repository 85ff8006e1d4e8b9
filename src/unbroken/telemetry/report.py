"""`unbroken report`: one run's events (from every node's run dir, the nodes' copies in an
event dir, or saved pod logs) turned into the goodput
report, and that report written as JSON, CSV (and Parquet) tables, or HTML.

The tables' schema is in docs/goodput.md; `TABLES` declares each table's columns once.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.telemetry import anomaly_report
from unbroken.telemetry import schema as ev
from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import account
from unbroken.telemetry.sources import event_sources, load_events  # noqa: F401  (re-exported)
from unbroken.telemetry.summary import summary_of


def build_report(run_dirs: list[str | Path]) -> dict[str, Any]:
    """The goodput report (`goodput.account`) of the run in `run_dirs`, with its dirs."""
    events = load_events(run_dirs)
    if not events:
        raise UserError(f"the event log in {run_dirs[0]} is empty: the run wrote no events")
    report = account(events)
    # Each fault's downtime, redone steps and host (the summary's definitions), beside its
    # cost: both list the run's distinct faults in the order they happened.
    outcomes = summary_of(ev.decode_all(events), "")["faults"]
    for row, outcome in zip(report["faults"], outcomes, strict=True):
        row.update(host=outcome["host"], downtime=outcome["downtime"],
                   redone=outcome["redone"])
    anomalies = anomaly_report.summarize(events)
    if anomalies is not None:  # only where a detector ran: older reports stay as they were
        report["anomalies"] = anomalies
    report["run_dir"] = ", ".join(str(d) for d in run_dirs)
    return report


# ------------------------------------------------------------------ tables (CSV, Parquet)
TABLES: dict[str, tuple[str, ...]] = {
    "steps": ("slot", "rank", "attempt", "gen", "step", "start", "end", "duration", "loss",
              "redone"),
    "faults": ("kind", "rank", "node", "attempt", "step", "t", "in_place", "detection",
               "cost_s", "detail"),
    "recoveries": ("gen", "t", "duration", "world_size", "faults"),
    "checkpoints": ("step", "t", "slot", "stall", "durable", "bytes", "ok"),
    "goodput": ("scope", "slot", "attempt", "category", "seconds"),
    "timeline": ("slot", "start", "end", "category"),
}
"""Each table the report writes, with its columns in order (docs/goodput.md)."""


def table_rows(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The report's tables as rows. `goodput` is long-format: one row per (scope, category),
    scope `run` (seconds per rank), `rank` (that slot's seconds) or `attempt`."""
    goodput = [{"scope": "run", "slot": None, "attempt": None, "category": c,
                "seconds": v} for c, v in report["seconds"].items()]
    goodput += [{"scope": "rank", "slot": r["slot"], "attempt": None, "category": c,
                 "seconds": v} for r in report["ranks"] for c, v in r["seconds"].items()]
    goodput += [{"scope": "attempt", "slot": None, "attempt": a["attempt"], "category": c,
                 "seconds": v} for a in report["attempts"] for c, v in a["seconds"].items()]
    faults = [dict(f, cost_s=sum(f["cost_s"].values())) for f in report["faults"]]
    recoveries = [dict(r, faults=",".join(r["faults"])) for r in report["recoveries"]]
    return {"steps": report["steps"], "faults": faults, "recoveries": recoveries,
            "checkpoints": report["checkpoints"], "goodput": goodput,
            "timeline": report["timeline"]}


def write_tables(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write each table as CSV, and as Parquet too when pyarrow is installed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        pyarrow = None
    for name, rows in table_rows(report).items():
        columns = TABLES[name]
        path = out / f"{name}.csv"
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        written.append(path)
        if pyarrow is not None:
            table = pyarrow.table({c: [r.get(c) for r in rows] for c in columns})
            pyarrow.parquet.write_table(table, out / f"{name}.parquet")
            written.append(out / f"{name}.parquet")
    return written


def format_goodput(report: dict[str, Any]) -> str:
    """The breakdown for the terminal: seconds per rank by category, biggest first."""
    wall = report["wall_s"]
    lines = []
    if report["goodput"] is None:
        lines.append("  goodput         unknown: the script reports no steps to unbroken "
                     "(the time its processes ran is untracked)")
    else:
        lines.append(f"  goodput         {100 * report['goodput']:.1f}% of {wall:.1f}s x "
                     f"{report['world_size']} rank(s)")
    lines += _measured(report.get("watched"), report["seconds"])
    shown = sorted(((v, c) for c, v in report["seconds"].items() if v > 0), reverse=True)
    for v, c in shown:
        share = f"{100 * v / wall:5.1f}%" if wall > 0 else ""
        lines.append(f"    {Category(c).value:<24} {v:9.2f}s {share}")
    if report.get("events_dropped"):
        lines.append(f"  events dropped  {report['events_dropped']} (the disk under the run dir "
                     "was full): the figures above miss them")
    return "\n".join(lines)


def _measured(watched: dict[str, Any] | None, seconds: dict[str, float]) -> list[str]:
    """What the hooks measured of an unchanged script, and what they could not."""
    if not watched:
        return []
    resumed = "; ".join(f"attempt {a} resumed from step {v}" if v is not None else
                        f"attempt {a}: resume step unknown"
                        for a, v in watched["resumed_from"].items())
    lines = [f"  measured        an unchanged script, by hooks: {watched['saves']} save(s) "
             f"({seconds.get('checkpoint_save', 0):.2f}s a rank), {watched['loads']} load(s)"
             + (f"; {resumed}" if resumed else "")]
    lines += [f"                  {note}" for note in watched["notes"]]
    return lines

