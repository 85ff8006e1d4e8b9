"""The plots of `unbroken report --html`: matplotlib figures (Agg, no display) of one
goodput report, each returned as a PNG encoded in base64 for the page to embed.

matplotlib is imported when a `Plots` is made, not with this module: the page checks it is
installed first, and says how to install it where it is not.
"""

from __future__ import annotations

import base64
import io
import math
import statistics
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

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
    Category.UNTRACKED: "#dbdb8d",
    Category.IDLE: "#c7c7c7",
})
"""The colour of each category, in every plot and table of the page."""
OTHER_COLOR = "#7f7f7f"  # a category this version does not know
FAULT_COLOR = "#000000"
RECOVERY_COLOR = "#e377c2"
SPARE_COLOR = "#006d2c"
DPI = 100


def color(category: str) -> str:
    return COLORS.get(category, OTHER_COLOR)


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Plots:
    """The figures of one report. `t0` is the job's start (x axes count seconds from it);
    `categories` orders the legends and bars."""

    def __init__(self, report: dict[str, Any], t0: float, categories: list[str]) -> None:
        from matplotlib.figure import Figure

        self.r = report
        self.t0 = t0
        self.categories = categories
        self.figure_class = Figure

    def png(self, fig: Any) -> str:
        """`fig` as a PNG, in base64 (its alphabet needs no escaping in HTML)."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def timeline(self, segments: list[dict[str, Any]]) -> Any:
        slots = sorted({_int(s.get("slot")) for s in segments})
        spares = [s for s in self.r.get("spares") or [] if finite(s.get("t"))]
        row = {slot: i for i, slot in enumerate(slots)}
        spare_row = len(slots)
        rows = len(slots) + (1 if spares else 0)
        fig = self.figure_class(figsize=(12, min(2.6 + 0.38 * rows, 40)), layout="constrained")
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
            ax.text(x, 1.01, f"{clip(str(f.get('kind', '?')), 24)}{who}", rotation=90,
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

    def breakdown(self, seconds: dict[str, float]) -> Any:
        cats = [c for c in self.categories if c in seconds]
        fig = self.figure_class(figsize=(12, 1.2 + 0.32 * len(cats)), layout="constrained")
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

    def per_rank(self, ranks: list[dict[str, Any]]) -> Any:
        ranks = sorted(ranks, key=lambda rk: rk.get("slot", 0))
        present = {c for rk in ranks for c in rk["seconds"]}
        cats = [c for c in self.categories if c in present]
        cats += sorted(present - set(cats))
        fig = self.figure_class(figsize=(12, min(1.6 + 0.3 * len(ranks), 40)), layout="constrained")
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

    def histogram(self, durations: list[float], median: float) -> Any:
        """Steps up to the straggler threshold in fine bins; the slower ones in one bar."""
        limit = straggler_threshold(median)
        usual = [d for d in durations if d <= limit]
        slow = [d for d in durations if d > limit]
        fig = self.figure_class(figsize=(12, 3.6), layout="constrained")
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

    def boxplot(self, steps: list[dict[str, Any]], median: float) -> Any:
        """A box per rank up to the straggler threshold; each rank's slower steps counted at
        the top."""
        by_rank: dict[int, list[float]] = {}
        for s in steps:
            by_rank.setdefault(_int(s.get("rank")), []).append(float(s["duration"]))
        ranks = sorted(by_rank)
        limit = straggler_threshold(median)
        fig = self.figure_class(figsize=(12, 3.8), layout="constrained")
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

    def loss(self, steps: list[dict[str, Any]], fault_steps: list[int] = ()) -> Any:
        """The loss per step (kept, and redone computations apart), a vertical line at the
        step of each fault in `fault_steps`."""
        kept: dict[int, list[float]] = {}
        redone: dict[int, list[float]] = {}
        for s in steps:
            (redone if s.get("redone") else kept).setdefault(int(s["step"]), []).append(
                float(s["loss"]))
        fig = self.figure_class(figsize=(12, 3.8), layout="constrained")
        ax = fig.add_subplot()
        if redone:
            xs = sorted(redone)
            ax.plot(xs, [statistics.fmean(redone[x]) for x in xs], ".", color="#d62728",
                    alpha=0.3, markersize=4, label="computations redone (discarded)")
        if kept:
            xs = sorted(kept)
            ax.plot(xs, [statistics.fmean(kept[x]) for x in xs], "-", color="#1f77b4",
                    linewidth=1.2, label="kept (mean over ranks)")
        for i, x in enumerate(sorted(set(fault_steps))):
            ax.axvline(x, color=FAULT_COLOR, linewidth=1.0, linestyle=":",
                       label=None if i else "fault (its step)")
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
