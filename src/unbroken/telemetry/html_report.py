"""`unbroken report --html`: one self-contained HTML page of a run's goodput.

The page holds a header (run dir, wall time, world size, goodput, dropped events), a
timeline per slot coloured by category with faults, checkpoints, recoveries and spares
marked, the goodput breakdown (mean seconds per category, and per rank), the step-time
distribution (histogram, and box plots per rank with the steps over the straggler threshold
marked), the loss curve, and tables of faults (with their phases and cost), recoveries, attempts and
checkpoints. Plots are PNGs that matplotlib draws (Agg, no display) embedded as base64; the
CSS is inline; nothing is fetched from the network. Every string from the report is escaped:
event contents are untrusted. A last inline script checks every plot decoded and says so in
`document.title` (tests read it); the page shows everything without it.
"""

from __future__ import annotations

import base64
import html
import io
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from unbroken.errors import UserError
from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import straggler_threshold

COLORS: Mapping[str, str] = MappingProxyType({
    Category.PRODUCTIVE_STEP: "#2ca02c",
    Category.PROGRAM_STARTUP: "#9edae5",
    Category.INIT_RENDEZVOUS: "#17becf",
    Category.CHECKPOINT_SAVE: "#1f77b4",
    Category.CHECKPOINT_RESTORE: "#aec7e8",
    Category.DATA_LOADING: "#bcbd22",
    Category.STRAGGLER: "#ff7f0e",
    Category.WASTED_PROGRESS: "#d62728",
    Category.INFRASTRUCTURE_RECOVERY: "#9467bd",
    Category.CAPACITY_LOST: "#8c564b",
    Category.IDLE: "#c7c7c7",
})
"""The colour of each category, in every plot and table of the page."""
OTHER_COLOR = "#7f7f7f"  # a category this version does not know
FAULT_COLOR = "#000000"
RECOVERY_COLOR = "#e377c2"
SPARE_COLOR = "#006d2c"
DPI = 100
INSTALL_HINT = "the HTML report needs matplotlib: pip install 'unbroken[report]'"

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto;
       max-width: 1250px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.meta { display: flex; flex-wrap: wrap; gap: 0.6em 2em; margin: 0.8em 0; }
.meta div { min-width: 8em; } .meta b { display: block; font-size: 1.35em; }
.meta span { color: #666; font-size: 0.85em; }
.warn { background: #fff3cd; border: 1px solid #e0b100; padding: 0.3em 0.6em; border-radius: 4px; }
.note { color: #555; font-style: italic; background: #f6f6f6; padding: 0.6em; border-radius: 4px; }
img.plot { max-width: 100%; height: auto; display: block; margin: 0.6em 0; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.3em;
          vertical-align: middle; border: 1px solid #0003; }
.scroll { overflow-x: auto; } .nw { white-space: nowrap; }
nav a { margin-right: 1em; } code { background: #f3f3f3; padding: 0 0.2em; }
"""

CHECK_SCRIPT = """<script>
(function () {
  function check() {
    var plots = Array.prototype.slice.call(document.querySelectorAll("img.plot"));
    var bad = plots.filter(function (p) { return !(p.complete && p.naturalWidth > 0); });
    document.title = bad.length
      ? "unbroken report: broken (" + bad.length + " of " + plots.length + " plots did not load: "
        + bad.map(function (p) { return p.alt; }).join("; ") + ")"
      : "unbroken report: ok (" + plots.length + " plots)";
  }
  if (document.readyState === "complete") { check(); } else { window.addEventListener("load", check); }
})();
</script>"""


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    """Render `report` (the goodput accounting's dict) as one self-contained HTML file at
    `path`; returns the path. UserError, saying how to install it, without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    path = Path(path)
    page = _Page(report, Figure)
    path.write_text(page.render(), encoding="utf-8")
    return path


def color(category: str) -> str:
    return COLORS.get(category, OTHER_COLOR)


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def num(value: Any, digits: int = 1, unit: str = "") -> str:
    """A number for a table cell; an em dash for None or a non-finite value."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "—" if value is None else esc(value)
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


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = ()) -> str:
    """A table; headers are escaped here, cells must come escaped (or made of escaped parts)."""
    numeric = set(numeric)
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            "</table></div>")


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


class _Page:
    """One rendering of one report; the figures' class is matplotlib's `Figure`."""

    def __init__(self, report: dict[str, Any], figure_class: type) -> None:
        self.r = report
        self.Figure = figure_class
        self.t0 = float(report.get("t0") or 0.0)
        known = [str(c) for c in report.get("categories") or []]
        extra = [str(c) for c in (report.get("seconds") or {}) if str(c) not in known]
        self.categories = known + extra or [str(c) for c in Category]

    # ---- the page ----

    def render(self) -> str:
        r = self.r
        sections = [
            ("timeline", "Timeline per rank", self.timeline_section()),
            ("breakdown", "Goodput breakdown", self.breakdown_section()),
            ("steps", "Step times", self.steps_section()),
            ("loss", "Loss", self.loss_section()),
            ("faults", "Faults", self.faults_section()),
            ("recoveries", "Recoveries", self.recoveries_section()),
            ("attempts", "Attempts", self.attempts_section()),
            ("checkpoints", "Checkpoints", self.checkpoints_section()),
        ]
        nav = "".join(f'<a href="#{sid}">{esc(title)}</a>' for sid, title, _ in sections)
        body = "".join(f'<section id="{sid}"><h2>{esc(title)}</h2>{content}</section>'
                       for sid, title, content in sections)
        run_dir = esc(r.get("run_dir", ""))
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>unbroken report: {run_dir}</title><style>{CSS}</style></head><body>"
                f"{self.header()}<nav>{nav}</nav>{body}{CHECK_SCRIPT}</body></html>\n")

    def header(self) -> str:
        r = self.r
        goodput = r.get("goodput")
        dropped = r.get("events_dropped") or 0
        started = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.t0))
                   if self.t0 else "—")
        cells = [
            ("goodput", "unknown" if not r.get("steps_known")
             else f"{goodput * 100:.1f}%" if finite(goodput) else "—"),
            ("wall time", duration(r.get("wall_s"))),
            ("world size", num(r.get("world_size"))),
            ("attempts", num(len(r.get("attempts") or []))),
            ("faults", num(len(r.get("faults") or []))),
            ("started", esc(started)),
        ]
        meta = "".join(f"<div><b>{v}</b><span>{esc(k)}</span></div>" for k, v in cells)
        warnings = []
        if dropped:
            warnings.append(f'<p class="warn" id="dropped"><b>{num(dropped)} events dropped</b>: '
                            "the event log is incomplete, and the times below may undercount "
                            "what those events would have said.</p>")
        if not r.get("steps_known"):
            warnings.append(note("Steps are unknown: the script reported no steps (scripts "
                                 "that use unbroken.init do), so productive time cannot be told "
                                 "from the rest, and step times and the loss are not shown."))
        return (f"<header><h1>unbroken report</h1><div>run dir <code>{esc(r.get('run_dir', ''))}"
                f"</code></div><div class=\"meta\">{meta}</div>{''.join(warnings)}</header>")

    # ---- sections ----

    def timeline_section(self) -> str:
        segments = [s for s in self.r.get("timeline") or []
                    if finite(s.get("start")) and finite(s.get("end"))]
        if not segments:
            return note("No timeline: the event log says nothing of what the ranks did when.")
        return self.plot(self.timeline_figure(segments),
                         "Timeline per rank: what each slot did over time, coloured by category")

    def breakdown_section(self) -> str:
        seconds = {c: float(v) for c, v in (self.r.get("seconds") or {}).items() if finite(v)}
        if not seconds:
            return note("No breakdown: the report charges no time to any category.")
        wall = self.r.get("wall_s") if finite(self.r.get("wall_s")) else sum(seconds.values())
        rows = [(f'<span class="swatch" style="background:{color(c)}"></span>{esc(c)}',
                 num(seconds.get(c, 0.0), 2), num(100 * seconds.get(c, 0.0) / wall, 1, "%")
                 if wall else "—")
                for c in self.categories if c in seconds]
        parts = [self.plot(self.breakdown_figure(seconds),
                           "Goodput breakdown: mean seconds per rank in each category"),
                 table(["category", "mean s per rank", "share of wall time"], rows, numeric=(1, 2))]
        ranks = [rk for rk in self.r.get("ranks") or [] if rk.get("seconds")]
        if ranks:
            parts.append(self.plot(self.per_rank_figure(ranks),
                                   "Seconds per category of each rank, stacked"))
        else:
            parts.append(note("No per-rank breakdown: the report has no per-rank seconds."))
        return "".join(parts)

    def steps_section(self) -> str:
        steps = [s for s in self.r.get("steps") or [] if finite(s.get("duration"))]
        if not steps:
            return note("Step times are unknown: no step was reported."
                        if self.r.get("steps_known") or self.r.get("steps")
                        else "Step times are unknown: the script reported no steps.")
        durations = [float(s["duration"]) for s in steps]
        median = statistics.median(durations)
        slow = [s for s in steps if s["duration"] > straggler_threshold(median)]
        summary = (f"<p>{num(len(steps))} step computations, median {num(median, 3)} s, "
                   f"p99 {num(_quantile(durations, 0.99), 3)} s, max {num(max(durations), 3)} s; "
                   f"{num(len(slow))} over the straggler threshold "
                   f"{num(straggler_threshold(median), 3)} s "
                   f"({num(sum(1 for s in steps if s.get('redone')))} redone).</p>")
        return (summary
                + self.plot(self.histogram_figure(durations, median), "Histogram of step durations")
                + self.plot(self.boxplot_figure(steps, median),
                            "Step durations per rank, steps over the straggler threshold marked"))

    def loss_section(self) -> str:
        steps = [s for s in self.r.get("steps") or []
                 if finite(s.get("loss")) and finite(s.get("step"))]
        if not steps:
            return note("The loss is unknown: no step reported one."
                        if self.r.get("steps") else "The loss is unknown: no step was reported.")
        return self.plot(self.loss_figure(steps), "Loss per step, the mean over ranks")

    def faults_section(self) -> str:
        faults = self.r.get("faults") or []
        if not faults:
            return "<p>No faults.</p>"
        rows = []
        for f in faults:
            cost = {c: v for c, v in (f.get("cost_s") or {}).items() if finite(v) and v}
            cost_cell = "<br>".join(
                f'<span class="nw"><span class="swatch" style="background:{color(c)}"></span>'
                f"{esc(c)} {num(v, 1)}</span>"
                for c, v in sorted(cost.items(), key=lambda kv: -kv[1])) or "—"
            detail = f.get("detail")
            detail_cell = "—" if detail is None else (
                f'<span title="{esc(detail)}">{esc(_clip(str(detail), 160))}</span>')
            rows.append([esc(f.get("kind", "?")), num(f.get("rank")), num(f.get("node")),
                         num(f.get("attempt")), num(f.get("step")), num(self.rel(f.get("t")), 2),
                         num(f.get("detection"), 2), num(f.get("downtime"), 2), num(f.get("redone")),
                         "in place" if f.get("in_place") else "restart", cost_cell,
                         num(sum(cost.values()), 1), detail_cell])
        return table(["kind", "rank", "node", "attempt", "step", "at s", "detection s",
                      "downtime s", "redone steps", "recovery", "cost by category (rank-s)",
                      "cost rank-s", "detail"], rows, numeric=(1, 2, 3, 4, 5, 6, 7, 8, 11))

    def recoveries_section(self) -> str:
        recoveries = self.r.get("recoveries") or []
        if not recoveries:
            return "<p>No in-place recoveries.</p>"
        rows = [[num(rc.get("gen")), num(self.rel(rc.get("t")), 2), num(rc.get("duration"), 2),
                 num(rc.get("world_size")), esc(", ".join(str(x) for x in rc.get("faults") or []))
                 or "—"] for rc in recoveries]
        return table(["generation", "at s", "duration s", "world size", "faults"], rows,
                     numeric=(0, 1, 2, 3))

    def attempts_section(self) -> str:
        attempts = self.r.get("attempts") or []
        if not attempts:
            return note("No attempts recorded.")
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
        return table(headers, rows, numeric=range(len(headers)))

    def checkpoints_section(self) -> str:
        checkpoints = self.r.get("checkpoints") or []
        if not checkpoints:
            return "<p>No checkpoints.</p>"
        failed = [c for c in checkpoints if not c.get("ok", True)]
        stalls = [c["stall"] for c in checkpoints if finite(c.get("stall"))]
        durable = [c["durable"] for c in checkpoints if finite(c.get("durable"))]
        sizes = [c["bytes"] for c in checkpoints if finite(c.get("bytes"))]
        parts = [f"{num(len(checkpoints))} checkpoint saves"
                 f" ({len({c.get('step') for c in checkpoints})} steps)"]
        if failed:
            parts.append(f"<b>{num(len(failed))} failed</b> (steps "
                         f"{esc(', '.join(str(c.get('step')) for c in failed[:20]))})")
        if stalls:
            parts.append(f"training stalled a median {num(statistics.median(stalls), 3)} s, "
                         f"at most {num(max(stalls), 3)} s")
        if durable:
            parts.append(f"durable after a median {num(statistics.median(durable), 2)} s")
        if sizes:
            parts.append(f"median size {esc(_bytes(statistics.median(sizes)))}")
        return f"<p>{'; '.join(parts)}.</p>"

    # ---- plots ----

    def rel(self, t: Any) -> float | None:
        return float(t) - self.t0 if finite(t) else None

    def plot(self, fig: Any, alt: str) -> str:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
        data = base64.b64encode(buf.getvalue()).decode("ascii")
        return f'<img class="plot" alt="{esc(alt)}" src="data:image/png;base64,{data}">'

    def timeline_figure(self, segments: list[dict[str, Any]]) -> Any:
        slots = sorted({_int(s.get("slot")) for s in segments})
        spares = [s for s in self.r.get("spares") or [] if finite(s.get("t"))]
        row = {slot: i for i, slot in enumerate(slots)}
        spare_row = len(slots)
        rows = len(slots) + (1 if spares else 0)
        fig = self.Figure(figsize=(12, min(2.6 + 0.38 * rows, 40)), layout="constrained")
        ax = fig.add_subplot()
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for s in segments:
            start, end = float(s["start"]) - self.t0, float(s["end"]) - self.t0
            if end > start:
                bars.setdefault((row[_int(s.get("slot"))], str(s.get("category"))), []).append(
                    (start, end - start))
        for (y, category), spans in bars.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color(category), linewidth=0)
        handles = [_patch(c) for c in self.categories if any(k[1] == c for k in bars)]
        handles += [_patch(c) for c in sorted({k[1] for k in bars} - set(self.categories))]
        faults = [f for f in self.r.get("faults") or [] if finite(f.get("t"))]
        for f in faults:
            x = float(f["t"]) - self.t0
            ax.axvline(x, color=FAULT_COLOR, linewidth=1.2)
            who = f" r{f['rank']}" if f.get("rank") is not None else (
                f" n{f['node']}" if f.get("node") is not None else "")
            ax.text(x, 1.01, f"{_clip(str(f.get('kind', '?')), 24)}{who}", rotation=90,
                    fontsize=8, ha="center", va="bottom", transform=ax.get_xaxis_transform())
        if faults:
            handles.append(_line("fault", FAULT_COLOR, "-"))
        recoveries = [rc for rc in self.r.get("recoveries") or [] if finite(rc.get("t"))]
        for rc in recoveries:
            x = float(rc["t"]) - self.t0
            ax.axvline(x, color=RECOVERY_COLOR, linewidth=1.2, linestyle="--")
            if finite(rc.get("duration")):
                ax.axvspan(x, x + float(rc["duration"]), color=RECOVERY_COLOR, alpha=0.12,
                           linewidth=0)
        if recoveries:
            handles.append(_line("recovery (in place)", RECOVERY_COLOR, "--"))
        checkpoints = [c for c in self.r.get("checkpoints") or []
                       if finite(c.get("t")) and _int(c.get("slot"), -1) in row]
        for ok, marker, edge in ((True, "|", "#000000"), (False, "x", "#d62728")):
            chosen = [c for c in checkpoints if bool(c.get("ok", True)) == ok]
            if chosen:
                ax.scatter([float(c["t"]) - self.t0 for c in chosen],
                           [row[_int(c["slot"])] + 0.42 for c in chosen], marker=marker,
                           color=edge, s=40, linewidths=1.2, zorder=3,
                           label="checkpoint" if ok else "checkpoint failed")
                handles.append(_marker("checkpoint" if ok else "checkpoint failed", marker, edge))
        for event, marker in (("ready", "^"), ("promoted", "*")):
            chosen = [s for s in spares if s.get("event") == event]
            if chosen:
                ax.scatter([float(s["t"]) - self.t0 for s in chosen], [spare_row] * len(chosen),
                           marker=marker, color=SPARE_COLOR, s=70, zorder=3)
                handles.append(_marker(f"spare {event}", marker, SPARE_COLOR))
        for s in spares:
            if s.get("node") is not None:
                ax.annotate(f"n{s['node']}", (float(s["t"]) - self.t0, spare_row),
                            xytext=(4, -3), textcoords="offset points", fontsize=7)
        labels = [f"slot {slot}" for slot in slots] + (["spares"] if spares else [])
        ax.set_yticks(range(rows), labels)
        ax.set_ylim(rows - 0.5, -0.5)
        wall = self.r.get("wall_s")
        ax.set_xlim(0, float(wall) if finite(wall) and wall > 0
                    else max(float(s["end"]) - self.t0 for s in segments))
        ax.set_xlabel("seconds since the job started")
        ax.grid(axis="x", alpha=0.3)
        fig.legend(handles=handles, loc="outside lower center", ncols=min(6, len(handles)),
                   fontsize=8, frameon=False)
        return fig

    def breakdown_figure(self, seconds: dict[str, float]) -> Any:
        cats = [c for c in self.categories if c in seconds]
        fig = self.Figure(figsize=(12, 1.2 + 0.32 * len(cats)), layout="constrained")
        ax = fig.add_subplot()
        values = [seconds[c] for c in cats]
        ax.barh(range(len(cats)), values, color=[color(c) for c in cats])
        ax.set_yticks(range(len(cats)), cats)
        ax.invert_yaxis()
        total = sum(values)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f} s ({100 * v / total:.1f}%)" if total else f"{v:.1f} s", (v, i),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_xlabel("mean seconds per rank")
        ax.set_xlim(0, max(values + [1e-9]) * 1.18)
        ax.grid(axis="x", alpha=0.3)
        return fig

    def per_rank_figure(self, ranks: list[dict[str, Any]]) -> Any:
        ranks = sorted(ranks, key=lambda rk: rk.get("slot", 0))
        present = {c for rk in ranks for c in rk["seconds"]}
        cats = [c for c in self.categories if c in present]
        cats += sorted(present - set(cats))
        fig = self.Figure(figsize=(12, min(1.6 + 0.3 * len(ranks), 40)), layout="constrained")
        ax = fig.add_subplot()
        left = [0.0] * len(ranks)
        for c in cats:
            widths = [float(rk["seconds"].get(c) or 0.0) if finite(rk["seconds"].get(c)) else 0.0
                      for rk in ranks]
            if any(widths):
                ax.barh(range(len(ranks)), widths, left=left, color=color(c), label=c)
                left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_yticks(range(len(ranks)), [f"slot {rk.get('slot', '?')}" for rk in ranks])
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.grid(axis="x", alpha=0.3)
        fig.legend(loc="outside lower center", ncols=6, fontsize=8, frameon=False)
        return fig

    def histogram_figure(self, durations: list[float], median: float) -> Any:
        """Steps up to the straggler threshold in fine bins; the slower ones in one bar."""
        limit = straggler_threshold(median)
        usual = [d for d in durations if d <= limit]
        slow = [d for d in durations if d > limit]
        fig = self.Figure(figsize=(12, 3.6), layout="constrained")
        ax = fig.add_subplot()
        low = min(usual, default=0.0)
        width = max(limit - low, 1e-9) / 50
        ax.hist(usual, bins=[low + i * width for i in range(51)],
                color=COLORS[Category.PRODUCTIVE_STEP], edgecolor="white", linewidth=0.3)
        ax.axvline(median, color="#333333", linestyle=":", label=f"median {median:.3f} s")
        ax.axvline(limit, color=COLORS[Category.STRAGGLER], linestyle="--",
                   label=f"straggler threshold {limit:.3g} s")
        if slow:
            x = limit + 3 * width
            ax.bar([x], [len(slow)], width=2 * width, color=COLORS[Category.STRAGGLER])
            ax.annotate(f"{len(slow)} stragglers\n(max {max(slow):.3g} s)",
                        (x, len(slow)), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
            ax.set_xlim(right=limit + 6 * width)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)
        ax.set_xlabel("step duration (s)")
        ax.set_ylabel("step computations (log)")
        ax.legend(fontsize=8, loc="upper center")
        ax.grid(axis="y", alpha=0.3)
        return fig

    def boxplot_figure(self, steps: list[dict[str, Any]], median: float) -> Any:
        """A box per rank up to the straggler threshold; each rank's slower steps counted at
        the top."""
        by_rank: dict[int, list[float]] = {}
        for s in steps:
            by_rank.setdefault(_int(s.get("rank")), []).append(float(s["duration"]))
        ranks = sorted(by_rank)
        limit = straggler_threshold(median)
        fig = self.Figure(figsize=(12, 3.8), layout="constrained")
        ax = fig.add_subplot()
        ax.boxplot([by_rank[r] for r in ranks], positions=range(len(ranks)), widths=0.6,
                   flierprops={"marker": ".", "markersize": 3, "markerfacecolor": "#888888",
                               "markeredgecolor": "#888888"})
        low = min(min(v) for v in by_rank.values())
        top = limit + 0.2 * (limit - low)
        ax.axhline(limit, color=COLORS[Category.STRAGGLER], linestyle="--", linewidth=0.8,
                   label=f"straggler threshold {limit:.3g} s")
        marked = 0
        for i, r in enumerate(ranks):
            slow = [d for d in by_rank[r] if d > limit]
            if slow:
                marked += len(slow)
                y = limit + 0.1 * (limit - low)
                ax.plot([i], [y], marker="^", color=COLORS[Category.STRAGGLER], markersize=9)
                ax.annotate(f"{len(slow)}, max {max(slow):.3g} s", (i, y), xytext=(7, 0),
                            textcoords="offset points", va="center", fontsize=8)
        ax.set_ylim(max(0.0, low - 0.1 * (limit - low)), top)
        ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks],
                      rotation=90 if len(ranks) > 16 else 0, fontsize=8)
        ax.set_ylabel("step duration (s)")
        ax.set_title(f"{marked} step computations over the straggler threshold (▲, counted "
                     "per rank)" if marked else "no step over the straggler threshold", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        return fig

    def loss_figure(self, steps: list[dict[str, Any]]) -> Any:
        kept: dict[int, list[float]] = {}
        redone: dict[int, list[float]] = {}
        for s in steps:
            (redone if s.get("redone") else kept).setdefault(int(s["step"]), []).append(
                float(s["loss"]))
        fig = self.Figure(figsize=(12, 3.8), layout="constrained")
        ax = fig.add_subplot()
        if redone:
            xs = sorted(redone)
            ax.plot(xs, [statistics.fmean(redone[x]) for x in xs], ".", color="#d62728",
                    alpha=0.3, markersize=4, label="computations redone (discarded)")
        if kept:
            xs = sorted(kept)
            ax.plot(xs, [statistics.fmean(kept[x]) for x in xs], "-", color="#1f77b4",
                    linewidth=1.2, label="kept (mean over ranks)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        return fig


def _patch(category: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=color(category), label=category)


def _line(label: str, line_color: str, style: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], color=line_color, linestyle=style, label=label)


def _marker(label: str, marker: str, marker_color: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], color=marker_color, marker=marker, linestyle="none", markersize=8,
                  label=label)


def _int(value: Any, default: int = 0) -> int:
    """An id from the report (slot, rank), or `default` where it is missing."""
    return int(value) if finite(value) else default


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
