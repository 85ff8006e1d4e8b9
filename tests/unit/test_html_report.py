"""`unbroken report --html`, in process: the page is self-contained and escapes what events
say. (Every plot loaded in a real headless Chromium: tests/integration/test_html_report.py.)
"""

from __future__ import annotations

import sys

import pytest
from builders import T0, plots_in

from unbroken.errors import UserError
from unbroken.telemetry.html_report import write_html


def bare_report() -> dict:
    return {"run_dir": "x", "t0": T0, "wall_s": 0.0, "world_size": 0, "goodput": 0.0,
            "steps_known": False, "events_dropped": 0, "categories": [], "seconds": {},
            "badput_s": {}, "ranks": [], "attempts": [], "faults": [], "recoveries": [],
            "checkpoints": [], "steps": [], "spares": [], "timeline": []}


def test_an_empty_report_renders_notes_instead_of_plots(tmp_path):
    text = write_html(bare_report(), tmp_path / "report.html").read_text()
    assert plots_in(tmp_path / "report.html") == 0
    assert "No timeline" in text and "No breakdown" in text


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UserError, match=r"pip install 'unbroken\[report\]'"):
        write_html(bare_report(), tmp_path / "report.html")
    assert not (tmp_path / "report.html").exists()
