"""`unbroken report --html`, in process: the page is self-contained and escapes what events
say. (Every plot loaded in a real headless Chromium: tests/integration/test_html_report.py.)
"""

from __future__ import annotations

import sys
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from builders import T0, plots_in

import unbroken.telemetry.html_report as html_report
from unbroken.errors import UserError
from unbroken.telemetry.html_report import write_html

ROOT = Path(__file__).resolve().parents[2]
EVIL = "<script>alert('x')</script><img src=x onerror=alert(1)>&\"quoted\""


def bare_report() -> dict:
    return {"run_dir": "x", "t0": T0, "wall_s": 0.0, "world_size": 0, "goodput": 0.0,
            "steps_known": False, "events_dropped": 0, "categories": [], "seconds": {},
            "badput_s": {}, "ranks": [], "attempts": [], "faults": [], "recoveries": [],
            "checkpoints": [], "steps": [], "spares": [], "timeline": []}


def hostile_report() -> dict:
    """Every string the events can put on the page is markup, and nothing needs a plot."""
    fault = {"kind": EVIL, "rank": EVIL, "node": f"node-{EVIL}", "attempt": 0, "step": 3,
             "t": T0 + 1, "detail": f"error: {EVIL}", "in_place": False, "detection": 0.5,
             "downtime": 1.0, "redone": 0, "cost_s": {EVIL: 2.0, "idle": 1.0}}
    return bare_report() | {
        "run_dir": f"runs/{EVIL}", "events_dropped": 2, "faults": [fault],
        "recoveries": [{"gen": 1, "t": T0 + 2, "duration": 0.3, "world_size": 2,
                        "faults": [f"hang {EVIL}"]}],
        "attempts": [{"attempt": EVIL, "start": T0, "end": T0 + 3, "seconds": {}}],
        "checkpoints": [{"step": EVIL, "t": T0 + 1, "slot": 0, "ok": False}]}


class _Tags(HTMLParser):
    """The tags and attributes of a page, and its text, as a browser would parse them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.cells: list[str] = []  # each table cell's text
        self.in_cell = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "td":
            self.cells.append("")
            self.in_cell = True

    def handle_endtag(self, tag):
        if tag == "td":
            self.in_cell = False

    def handle_data(self, data):
        self.text.append(data)
        if self.in_cell:
            self.cells[-1] += data


def parse(text: str) -> _Tags:
    tags = _Tags()
    tags.feed(text)
    return tags


def test_an_empty_report_renders_notes_instead_of_plots(tmp_path):
    text = write_html(bare_report(), tmp_path / "report.html").read_text()
    assert plots_in(tmp_path / "report.html") == 0
    assert "No timeline" in text and "No breakdown" in text


def test_what_events_say_comes_escaped(tmp_path):
    text = write_html(hostile_report(), tmp_path / "report.html").read_text()
    page = parse(text)
    assert [tag for tag, _ in page.tags if tag == "script"] == ["script"]  # the load check only
    assert not [tag for tag, _ in page.tags if tag == "img"]  # no plot here, and no injected one
    assert not [a for _, attrs in page.tags for a in attrs if a.startswith("on")]
    assert "&lt;script&gt;alert(" in text and "<script>alert(" not in text
    # the text reads back as it was: escaped, not mangled
    assert f"runs/{EVIL}" in "".join(page.text)  # the run dir, in the title and the header
    for cell in (EVIL, f"node-{EVIL}", f"error: {EVIL}", f"hang {EVIL}", f"{EVIL} 2.0idle 1.0"):
        assert cell in page.cells, cell  # the kind and the rank, the node, ..., the costs
    # and so does the detail's tooltip, an attribute
    titles = [attrs["title"] for tag, attrs in page.tags if tag == "span" and "title" in attrs]
    assert titles == [f"error: {EVIL}"]
    assert f"<b>1 failed</b> (steps {EVIL}" not in text and "(steps &lt;script&gt;" in text


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UserError, match=r"needs matplotlib: pip install 'unbroken\[report\]'"):
        write_html(bare_report(), tmp_path / "report.html")
    assert not (tmp_path / "report.html").exists()


def test_without_jinja2_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(UserError, match=r"needs jinja2: pip install 'unbroken\[report\]'"):
        write_html(bare_report(), tmp_path / "report.html")
    assert not (tmp_path / "report.html").exists()


def test_the_template_ships_with_the_package():
    """Every template matches the package data that pyproject.toml declares."""
    package = Path(html_report.__file__).parent
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["unbroken.telemetry"]
    templates = sorted(p.relative_to(package) for p in (package / "templates").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    assert Path("templates") / html_report.TEMPLATE in templates
    for template in templates:
        assert any(template.match(g) for g in globs), (template, globs)


def test_the_loss_plot_marks_each_faults_step():
    from unbroken.telemetry.html_plots import FAULT_COLOR, Plots

    steps = [{"step": s, "loss": 3.0 - 0.1 * s, "redone": s == 6} for s in range(12)]
    fig = Plots(bare_report(), T0, []).loss(steps, [6, 9])
    marks = [line for line in fig.axes[0].lines if line.get_color() == FAULT_COLOR]
    assert sorted(line.get_xdata()[0] for line in marks) == [6, 9]
    assert all(len(set(line.get_xdata())) == 1 for line in marks)  # vertical lines
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels.count("fault (its step)") == 1


def test_the_loss_sections_text_names_the_faults_steps():
    report = bare_report() | {
        "steps": [{"step": s, "loss": 1.0, "rank": 0} for s in range(8)],
        "faults": [{"kind": "crash", "step": 5, "t": T0 + 1}, {"kind": "hang", "step": None}]}
    (plot,) = html_report._Page(report).loss_section()
    assert plot.alt == "Loss per step, the mean over ranks, faults marked at step 5"
