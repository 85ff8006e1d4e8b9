"""How a simulation's results are shown: text tables, a PNG plot, and one HTML page in the
style of `unbroken report --html` (the same stylesheet and category colours).

matplotlib and Jinja2 are imported when a plot or page is asked for (`unbroken[report]`)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.simulate.inputs import Strategy
from unbroken.simulate.planning import SparesPlan
from unbroken.telemetry.categories import Category

LABELS = {Strategy.TORCHRUN: "torchrun restart", Strategy.IN_PLACE: "in place",
          Strategy.SPARES: "spares", Strategy.SPARES_STANDBY: "spares + standby nodes"}
STRATEGY_COLORS = {Strategy.TORCHRUN: "#d62728", Strategy.IN_PLACE: "#1f77b4",
                   Strategy.SPARES: "#2ca02c", Strategy.SPARES_STANDBY: "#006d2c"}
BADPUT = (Category.INFRASTRUCTURE_RECOVERY, Category.WASTED_PROGRESS, Category.CHECKPOINT_SAVE,
          Category.CAPACITY_LOST, Category.STRAGGLER)


SHORT = {Strategy.TORCHRUN: "torchrun restart", Strategy.IN_PLACE: "in place",
         Strategy.SPARES: "spares", Strategy.SPARES_STANDBY: "spares+standby"}
COLUMNS = {Category.INFRASTRUCTURE_RECOVERY: "recovery", Category.WASTED_PROGRESS: "redone",
           Category.CHECKPOINT_SAVE: "ckpt", Category.CAPACITY_LOST: "capacity",
           Category.STRAGGLER: "straggler"}


def strategy_table(result: dict[str, Any], job: Any = None) -> list[str]:
    """One scale, at most 100 columns: a row per strategy, ETTR with its CI's half-width,
    badput by category (hours, or minutes where hours would round to zero), the GPUs held
    in reserve and the goodput per paid GPU-hour."""
    rows = [result[s.value] for s in Strategy]
    biggest = max(v for r in rows for v in r["badput_s"].values())
    unit, per = ("hours", 3600.0) if biggest >= 360 else ("minutes", 60.0)
    gpus = result.get("gpus") or 0
    lines = [f"ETTR: productive time of the training GPUs over wall time; badput: {unit} of",
             "the job's wall time; paid: goodput per GPU-hour paid, the reserve included",
             f"{'strategy':<17}{'ETTR':>7}{'95% CI':>9}" + "".join(
                 f"{name:>10}" for name in COLUMNS.values()) + f"{'reserved':>9}{'paid':>7}"]
    for s, r in zip(Strategy, rows, strict=True):
        lo, hi = r["ettr_ci"]
        reserved = job.reserved_gpus(s) if job is not None else 0
        paid = r["ettr"] * gpus / (gpus + reserved) if gpus else r["ettr"]
        lines.append(f"{SHORT[s]:<17}{r['ettr']:>7.4f}{'±' + f'{(hi - lo) / 2:.4f}':>9}" + "".join(
            f"{r['badput_s'][c.value] / per:>10.1f}" for c in COLUMNS)
            + f"{reserved:>9}{paid:>7.4f}")
    return lines


def sweep_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'GPUs':>8} {'job MTTF':>10}" + "".join(f"{LABELS[s]:>24}" for s in Strategy)]
    for r in rows:
        lines.append(f"{r['gpus']:>8} {r['costs']['job_mttf_h']:>9.2f}h" + "".join(
            f"{r[s.value]['ettr']:>24.4f}" for s in Strategy))
    return lines


def wrapped(text: str, width: int = 100) -> list[str]:
    """A long line as lines of at most `width` columns, the later ones indented."""
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)


def costs_lines(costs: dict[str, float]) -> list[str]:
    return wrapped("costs at this scale (s): " + ", ".join(f"{k} {v:g}" for k, v in costs.items()))


def sensitivity_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'cost':<14}{'x':>5}" + "".join(f"{LABELS[s]:>24}" for s in Strategy)]
    for r in rows:
        lines.append(f"{r['cost']:<14}{r['factor']:>5g}" + "".join(
            f"{r[s.value]:>15.4f} ({r[f'{s.value}_delta']:+.4f})" for s in Strategy))
    return lines


def plan_table(plan: SparesPlan) -> list[str]:
    priced = any(o.cost is not None for o in plan.options)
    lines = [f"{'spares/node':>11} {'standby':>8} {'reserve GPUs':>13} {'ETTR':>8} "
             f"{'reserve GPU-h':>14} {'wasted GPU-h':>13} {'total GPU-h':>12}"
             + (f" {'cost':>14}" if priced else "")]
    for o in plan.options:
        mark = " <-" if o is plan.chosen else ""
        lines.append(f"{o.spares_per_node:>11} {o.standby_nodes:>8} {o.reserve_gpus:>13} "
                     f"{o.ettr:>8.4f} {o.reserve_gpu_hours:>14,.0f} {o.wasted_gpu_hours:>13,.0f} "
                     f"{o.gpu_hours:>12,.0f}" + (f" {o.cost:>14,.0f}" if priced else "") + mark)
    lines.append(plan.why)
    return lines


def _require(module: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise UserError(f"the plot and the page need {module}: pip install "
                        "'unbroken[report]'") from None


def plot_png(result: dict[str, Any]) -> bytes:
    """A sweep: ETTR against GPUs per strategy, with the 95 % CI band. One scale: each
    strategy's badput by category, stacked."""
    _require("matplotlib")
    from matplotlib.figure import Figure

    from unbroken.telemetry.html_plots import color

    fig = Figure(figsize=(9, 4.8), dpi=100)
    ax = fig.add_subplot()
    if "sweep" in result:
        rows = result["sweep"]
        xs = [r["gpus"] for r in rows]
        for s in Strategy:
            ys = [r[s.value]["ettr"] for r in rows]
            ax.plot(xs, ys, marker="o", ms=3, label=LABELS[s], color=STRATEGY_COLORS[s])
            ax.fill_between(xs, [r[s.value]["ettr_ci"][0] for r in rows],
                            [r[s.value]["ettr_ci"][1] for r in rows],
                            color=STRATEGY_COLORS[s], alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("effective training time ratio")
        ax.set_title(f"ETTR by scale, {result['days']:g} days, {result['seeds']} seeds")
    else:
        names = [LABELS[s] for s in Strategy]
        bottom = [0.0] * len(names)
        for c in BADPUT:
            hours = [result[s.value]["badput_s"][c.value] / 3600 for s in Strategy]
            ax.bar(names, hours, bottom=bottom, label=c.value, color=color(c.value))
            bottom = [b + h for b, h in zip(bottom, hours, strict=True)]
        for i, s in enumerate(Strategy):
            ax.annotate(f"ETTR {result[s.value]['ettr']:.4f}", (i, bottom[i]),
                        ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("badput, hours of wall time")
        ax.set_title(f"{result['gpus']:,} GPUs, {result['days']:g} days, {result['seeds']} seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_png(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_bytes(plot_png(result))
    return path


def write_html(result: dict[str, Any], text: list[str], path: str | Path) -> Path:
    """One self-contained page: the plot, and the tables as printed."""
    _require("jinja2")
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("unbroken.telemetry", "templates"),
        autoescape=True, trim_blocks=True, lstrip_blocks=True,
        undefined=jinja2.StrictUndefined)
    page = env.get_template("simulate.html.j2").render(
        title=f"unbroken simulate: {result.get('gpus', 'sweep')} GPUs",
        png=base64.b64encode(plot_png(result)).decode("ascii"), text="\n".join(text),
        inputs=sorted(result.get("inputs", {}).items()))
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
