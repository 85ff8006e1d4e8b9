"""`unbroken report --html`: one self-contained HTML page of a run's goodput.

The page holds a header (run dir, wall time, world size, goodput, dropped events), a
timeline per slot coloured by category with faults, checkpoints, recoveries and spares
marked, the goodput breakdown (mean seconds per category, and per rank), the step-time
distribution (histogram, and box plots per rank with the steps over the straggler threshold
marked), the loss curve, and tables of faults (with their phases and cost), recoveries,
attempts and checkpoints. Plots are PNGs that matplotlib draws (telemetry/html_plots.py)
embedded as base64; the CSS is inline; nothing is fetched from the network.

This module turns the report into plain values (the `_Page`'s blocks and cells, below); the
template `templates/report.html.j2` lays them out. Jinja2 renders it with autoescaping on,
so every string of the report is escaped there (event contents are untrusted) and none is
escaped here. A last inline script checks every plot decoded and says so in
`document.title` (tests read it); the page shows everything without it.
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from unbroken.errors import UserError
from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import straggler_threshold
from unbroken.telemetry.html_plots import Plots, clip, color, finite

TEMPLATE = "report.html.j2"
REQUIRES = ("matplotlib.figure", "jinja2")
"""What the page needs beyond the package: both come with `unbroken[report]`."""


def install_hint(module: str) -> str:
    """The line that says how to get `module` (a dotted name: its top package is named)."""
    return f"the HTML report needs {module.split('.')[0]}: pip install 'unbroken[report]'"


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    """Render `report` (the goodput accounting's dict) as one self-contained HTML file at
    `path`; returns the path. UserError, saying how to install them, without matplotlib or
    Jinja2 (nothing is written then)."""
    for module in REQUIRES:
        try:
            importlib.import_module(module)
        except ImportError:
            raise UserError(install_hint(module)) from None
    path = Path(path)
    path.write_text(render(report), encoding="utf-8")
    return path


def render(report: dict[str, Any]) -> str:
    """The page's HTML. Needs matplotlib and Jinja2 (see `write_html`)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("unbroken.telemetry", "templates"),
        autoescape=True,  # every {{ value }} is escaped; the template marks nothing safe
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.get_template(TEMPLATE).render(_Page(report).context())


# ---- what the template shows: plain values, escaped by the template ----


@dataclass(frozen=True)
class Note:
    kind: ClassVar[str] = "note"
    text: str


@dataclass(frozen=True)
class Text:
    kind: ClassVar[str] = "text"
    text: str


@dataclass(frozen=True)
class Plot:
    kind: ClassVar[str] = "plot"
    alt: str
    png: str
    """The PNG in base64, whose alphabet has nothing to escape."""


@dataclass(frozen=True)
class Table:
    """A table; a cell is a string, a `CategoryCell`, `Costs` or `Detail`."""

    kind: ClassVar[str] = "table"
    headers: list[str]
    rows: list[list[Any]]
    numeric: frozenset[int] = frozenset()
    """The columns of numbers (right-aligned)."""


@dataclass(frozen=True)
class StepsSummary:
    kind: ClassVar[str] = "steps"
    count: str
    median: str
    p99: str
    max: str
    slow: str
    threshold: str
    redone: str


@dataclass(frozen=True)
class CheckpointsSummary:
    """The sentence on checkpoints; a part that is empty (or None) is left out."""

    kind: ClassVar[str] = "checkpoints"
    count: str
    steps: int
    failed: str = ""
    failed_steps: str = ""
    stall: tuple[str, str] | None = None
    """The median and the longest stall."""
    durable: str = ""
    size: str = ""


@dataclass(frozen=True)
class CategoryCell:
    """A category's name after its colour swatch (`text` may carry a number too)."""

    kind: ClassVar[str] = "category"
    color: str
    text: str


@dataclass(frozen=True)
class Costs:
    """A fault's cost per category, one category a line; an em dash where none."""

    kind: ClassVar[str] = "costs"
    items: list[CategoryCell]


@dataclass(frozen=True)
class Detail:
    """A long text clipped, the whole of it in the tooltip."""

    kind: ClassVar[str] = "detail"
    full: str
    clipped: str


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    blocks: list[Any]


# ---- formatting ----


def num(value: Any, digits: int = 1, unit: str = "") -> str:
    """A number for a table cell; an em dash for None or a non-finite value."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "—" if value is None else str(value)
    if not math.isfinite(value):
        return "—"
    text = f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"
    return text + unit


def duration(seconds: float) -> str:
    """1h02m03s, 4m05s or 6.7 s."""
    if not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "—"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def table(headers: Iterable[str], rows: Iterable[list[Any]], numeric: Iterable[int] = ()) -> Table:
    return Table(list(headers), list(rows), frozenset(numeric))


class _Page:
    """One rendering of one report: the values the template shows."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.r = report
        self.t0 = float(report.get("t0") or 0.0)
        known = [str(c) for c in report.get("categories") or []]
        extra = [str(c) for c in (report.get("seconds") or {}) if str(c) not in known]
        self.categories = known + extra or [str(c) for c in Category]
        self.plots = Plots(report, self.t0, self.categories)

    # ---- the page ----

    def context(self) -> dict[str, Any]:
        r = self.r
        sections = [
            Section("timeline", "Timeline per rank", self.timeline_section()),
            Section("breakdown", "Goodput breakdown", self.breakdown_section()),
            Section("steps", "Step times", self.steps_section()),
            Section("loss", "Loss", self.loss_section()),
            Section("faults", "Faults", self.faults_section()),
            Section("recoveries", "Recoveries", self.recoveries_section()),
            Section("attempts", "Attempts", self.attempts_section()),
            Section("checkpoints", "Checkpoints", self.checkpoints_section()),
        ]
        return {"run_dir": str(r.get("run_dir", "")), "header": self.header(),
                "dropped": num(r["events_dropped"]) if r.get("events_dropped") else "",
                "steps_known": bool(r.get("steps_known")), "sections": sections}

    def header(self) -> list[tuple[str, str]]:
        """The header's figures, as (value, label)."""
        r = self.r
        goodput = r.get("goodput")
        started = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.t0))
                   if self.t0 else "—")
        return [
            ("unknown" if not r.get("steps_known")
             else f"{goodput * 100:.1f}%" if finite(goodput) else "—", "goodput"),
            (duration(r.get("wall_s")), "wall time"),
            (num(r.get("world_size")), "world size"),
            (num(len(r.get("attempts") or [])), "attempts"),
            (num(len(r.get("faults") or [])), "faults"),
            (started, "started"),
        ]

    # ---- sections ----

    def timeline_section(self) -> list[Any]:
        segments = [s for s in self.r.get("timeline") or []
                    if finite(s.get("start")) and finite(s.get("end"))]
        if not segments:
            return [Note("No timeline: the event log says nothing of what the ranks did when.")]
        return [self.plot(self.plots.timeline(segments),
                          "Timeline per rank: what each slot did over time, coloured by category")]

    def breakdown_section(self) -> list[Any]:
        seconds = {c: float(v) for c, v in (self.r.get("seconds") or {}).items() if finite(v)}
        if not seconds:
            return [Note("No breakdown: the report charges no time to any category.")]
        wall = self.r.get("wall_s") if finite(self.r.get("wall_s")) else sum(seconds.values())
        rows = [[CategoryCell(color(c), c), num(seconds.get(c, 0.0), 2),
                 num(100 * seconds.get(c, 0.0) / wall, 1, "%") if wall else "—"]
                for c in self.categories if c in seconds]
        blocks = [self.plot(self.plots.breakdown(seconds),
                            "Goodput breakdown: mean seconds per rank in each category"),
                  table(["category", "mean s per rank", "share of wall time"], rows, numeric=(1, 2))]
        ranks = [rk for rk in self.r.get("ranks") or [] if rk.get("seconds")]
        if ranks:
            blocks.append(self.plot(self.plots.per_rank(ranks),
                                    "Seconds per category of each rank, stacked"))
        else:
            blocks.append(Note("No per-rank breakdown: the report has no per-rank seconds."))
        return blocks

    def steps_section(self) -> list[Any]:
        steps = [s for s in self.r.get("steps") or [] if finite(s.get("duration"))]
        if not steps:
            return [Note("Step times are unknown: no step was reported."
                         if self.r.get("steps_known") or self.r.get("steps")
                         else "Step times are unknown: the script reported no steps.")]
        durations = [float(s["duration"]) for s in steps]
        median = statistics.median(durations)
        threshold = straggler_threshold(median)
        summary = StepsSummary(
            count=num(len(steps)), median=num(median, 3), p99=num(_quantile(durations, 0.99), 3),
            max=num(max(durations), 3), slow=num(sum(1 for s in steps if s["duration"] > threshold)),
            threshold=num(threshold, 3), redone=num(sum(1 for s in steps if s.get("redone"))))
        return [summary,
                self.plot(self.plots.histogram(durations, median), "Histogram of step durations"),
                self.plot(self.plots.boxplot(steps, median),
                          "Step durations per rank, steps over the straggler threshold marked")]

    def loss_section(self) -> list[Any]:
        steps = [s for s in self.r.get("steps") or []
                 if finite(s.get("loss")) and finite(s.get("step"))]
        if not steps:
            return [Note("The loss is unknown: no step reported one."
                         if self.r.get("steps") else "The loss is unknown: no step was reported.")]
        at = sorted({int(f["step"]) for f in self.r.get("faults") or [] if finite(f.get("step"))})
        marked = f", faults marked at step {', '.join(map(str, at))}" if at else ""
        return [self.plot(self.plots.loss(steps, at), f"Loss per step, the mean over ranks{marked}")]

    def faults_section(self) -> list[Any]:
        faults = self.r.get("faults") or []
        if not faults:
            return [Text("No faults.")]
        rows = []
        for f in faults:
            cost = {c: v for c, v in (f.get("cost_s") or {}).items() if finite(v) and v}
            costs = Costs([CategoryCell(color(c), f"{c} {num(v, 1)}")
                           for c, v in sorted(cost.items(), key=lambda kv: -kv[1])])
            detail = f.get("detail")
            rows.append([str(f.get("kind", "?")), num(f.get("rank")), num(f.get("node")),
                         str(f.get("host") or "—"), "injected" if f.get("injected") else "real",
                         num(f.get("attempt")), num(f.get("step")), num(self.rel(f.get("t")), 2),
                         num(f.get("detection"), 2), num(f.get("downtime"), 2), num(f.get("redone")),
                         "in place" if f.get("in_place") else "restart", costs,
                         num(sum(cost.values()), 1),
                         "—" if detail is None else Detail(str(detail), clip(str(detail), 160))])
        return [table(["kind", "rank", "node", "host", "fault", "attempt", "step", "at s",
                       "detection s", "downtime s", "redone steps", "recovery",
                       "cost by category (rank-s)", "cost rank-s", "detail"], rows,
                      numeric=(1, 2, 5, 6, 7, 8, 9, 10, 13))]

    def recoveries_section(self) -> list[Any]:
        recoveries = self.r.get("recoveries") or []
        if not recoveries:
            return [Text("No in-place recoveries.")]
        rows = [[num(rc.get("gen")), num(self.rel(rc.get("t")), 2), num(rc.get("duration"), 2),
                 num(rc.get("world_size")), ", ".join(str(x) for x in rc.get("faults") or [])
                 or "—"] for rc in recoveries]
        return [table(["generation", "at s", "duration s", "world size", "faults"], rows,
                      numeric=(0, 1, 2, 3))]

    def attempts_section(self) -> list[Any]:
        attempts = self.r.get("attempts") or []
        if not attempts:
            return [Note("No attempts recorded.")]
        used = [c for c in self.categories
                if any(finite((a.get("seconds") or {}).get(c)) and a["seconds"][c] for a in attempts)]
        rows = []
        for a in attempts:
            secs = a.get("seconds") or {}
            total = sum(v for v in secs.values() if finite(v))
            productive = secs.get(Category.PRODUCTIVE_STEP, 0.0)
            length = (a["end"] - a["start"]) if finite(a.get("start")) and finite(a.get("end")) else None
            rows.append([num(a.get("attempt")), num(self.rel(a.get("start")), 2),
                         num(self.rel(a.get("end")), 2), num(length, 2),
                         num(100 * productive / total, 1, "%") if total and finite(productive) else "—",
                         *(num(secs.get(c), 1) for c in used)])
        headers = ["attempt", "start s", "end s", "duration s", "goodput", *used]
        return [table(headers, rows, numeric=range(len(headers)))]

    def checkpoints_section(self) -> list[Any]:
        checkpoints = self.r.get("checkpoints") or []
        if not checkpoints:
            return [Text("No checkpoints.")]
        failed = [c for c in checkpoints if not c.get("ok", True)]
        stalls = [c["stall"] for c in checkpoints if finite(c.get("stall"))]
        durable = [c["durable"] for c in checkpoints if finite(c.get("durable"))]
        sizes = [c["bytes"] for c in checkpoints if finite(c.get("bytes"))]
        return [CheckpointsSummary(
            count=num(len(checkpoints)), steps=len({c.get("step") for c in checkpoints}),
            failed=num(len(failed)) if failed else "",
            failed_steps=", ".join(str(c.get("step")) for c in failed[:20]),
            stall=(num(statistics.median(stalls), 3), num(max(stalls), 3)) if stalls else None,
            durable=num(statistics.median(durable), 2) if durable else "",
            size=_bytes(statistics.median(sizes)) if sizes else "")]

    # ---- helpers ----

    def rel(self, t: Any) -> float | None:
        return float(t) - self.t0 if finite(t) else None

    def plot(self, fig: Any, alt: str) -> Plot:
        return Plot(alt, self.plots.png(fig))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
