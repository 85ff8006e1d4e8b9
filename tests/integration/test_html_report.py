"""`unbroken report --html`: the page is self-contained, escapes what events say, and every
plot loads in a real browser (headless Chromium; `make install` installs it).

UNBROKEN_REPORT_SCREENSHOT=PATH copies the sample report's screenshot to PATH (how
docs/img/report.png was made).
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from builders import T0, plots_in

from unbroken.telemetry.categories import Category
from unbroken.telemetry.html_report import write_html

CHROMIUM = shutil.which("chromium")


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (`make install` installs Debian's chromium)")


EVIL = "<script>alert('x')</script>&\"quoted\""


class _Sim:
    """Slots' timelines, built segment by segment; every slot covers [0, now) contiguously."""

    def __init__(self, world: int) -> None:
        self.cursor = [0.0] * world
        self.segments: list[dict] = []

    def seg(self, slot: int, seconds: float, category: str) -> tuple[float, float]:
        start = self.cursor[slot]
        self.cursor[slot] = start + seconds
        if self.segments and self.segments[-1]["slot"] == slot \
                and self.segments[-1]["category"] == category:
            self.segments[-1]["end"] = T0 + self.cursor[slot]
        else:
            self.segments.append({"slot": slot, "start": T0 + start, "end": T0 + self.cursor[slot],
                                  "category": category})
        return T0 + start, T0 + self.cursor[slot]

    def all(self, seconds: float, category: str) -> None:
        for slot in range(len(self.cursor)):
            self.seg(slot, seconds, category)

    def sync(self, category: str = Category.IDLE) -> float:
        """Every slot waits (in `category`) for the slowest; returns the time, relative."""
        now = max(self.cursor)
        for slot, at in enumerate(self.cursor):
            if now > at:
                self.seg(slot, now - at, category)
        return now


def sample_report(world: int = 4, last_step: int = 200) -> dict:
    """A 4-rank job: a crash in attempt 0 (restart from the checkpoint of step 75), a hang in
    attempt 1 recovered in place (a spare promoted), a straggling step, a failed save."""
    rng = random.Random(7)
    sim = _Sim(world)
    steps: list[dict] = []
    checkpoints: list[dict] = []

    def loss(step: int) -> float:
        return 4.0 * math.exp(-step / 60) + 1.2 + rng.gauss(0, 0.04)

    def run_steps(first: int, last: int, attempt: int, gen: int, redone: bool = False) -> None:
        for step in range(first, last + 1):
            base = 0.2 + rng.uniform(0, 0.04)
            slow = {40: 1.5, 170: 0.9}.get(step, 0.0) if not redone else 0.0
            for slot in range(world):
                d = base * rng.uniform(0.97, 1.03)
                if slow:
                    start, _ = sim.seg(slot, 3 * 0.22, Category.PRODUCTIVE_STEP)
                    _, end = sim.seg(slot, slow, Category.STRAGGLER)
                else:
                    start, end = sim.seg(slot, d, Category.WASTED_PROGRESS if redone
                                         else Category.PRODUCTIVE_STEP)
                steps.append({"slot": slot, "rank": slot, "attempt": attempt, "gen": gen,
                              "step": step, "start": start, "end": end, "duration": end - start,
                              "loss": loss(step), "redone": redone})
            sim.sync()
            if step % 25 == 0 and not redone:
                for slot in range(world):
                    stall = 0.25 + rng.uniform(0, 0.1)
                    start, end = sim.seg(slot, stall, Category.CHECKPOINT_SAVE)
                    checkpoints.append({"step": step, "t": start, "slot": slot, "stall": stall,
                                        "durable": stall + 1.5, "bytes": 48 * 2**20,
                                        "ok": not (step == 175 and slot == 3)})
                sim.sync()

    # attempt 0: start, steps 1-79 (76-79 computed again after the crash at 80)
    sim.all(2.5, Category.PROGRAM_STARTUP)
    sim.all(1.5, Category.INIT_RENDEZVOUS)
    run_steps(1, 75, attempt=0, gen=0)
    run_steps(76, 79, attempt=0, gen=0, redone=True)
    sim.all(0.12, Category.WASTED_PROGRESS)  # step 80, cut short by the crash
    crash = sim.sync()
    sim.all(0.4, Category.INFRASTRUCTURE_RECOVERY)  # detection
    attempt1 = sim.sync()
    sim.all(2.0, Category.PROGRAM_STARTUP)
    sim.all(1.0, Category.INIT_RENDEZVOUS)
    sim.all(0.8, Category.CHECKPOINT_RESTORE)
    run_steps(76, 139, attempt=1, gen=0)
    hang = sim.sync()  # rank 1 stops; the others wait on it until the hang timeout
    sim.all(3.0, Category.WASTED_PROGRESS)
    sim.all(2.2, Category.INFRASTRUCTURE_RECOVERY)
    recovered = sim.sync()
    run_steps(140, last_step, attempt=1, gen=1)
    sim.all(0.5, Category.IDLE)
    wall = sim.sync()

    categories = [str(c) for c in Category]

    def seconds_of(segments: list[dict], lo: float = -math.inf, hi: float = math.inf) -> dict:
        out = dict.fromkeys(categories, 0.0)
        for s in segments:
            out[s["category"]] += max(0.0, min(s["end"], hi) - max(s["start"], lo))
        return out

    ranks = [{"slot": slot, "seconds": seconds_of([s for s in sim.segments if s["slot"] == slot])}
             for slot in range(world)]
    mean = {c: sum(r["seconds"][c] for r in ranks) / world for c in categories}
    bounds = [(0, T0, T0 + attempt1), (1, T0 + attempt1, T0 + wall)]
    attempts = [{"attempt": a, "start": lo, "end": hi,
                 "seconds": {c: v / world for c, v in seconds_of(sim.segments, lo, hi).items()}}
                for a, lo, hi in bounds]
    crash_cost = {Category.WASTED_PROGRESS: world * (4 * 0.22 + 0.12),
                  Category.INFRASTRUCTURE_RECOVERY: world * 0.4,
                  Category.PROGRAM_STARTUP: world * 2.0, Category.INIT_RENDEZVOUS: world * 1.0,
                  Category.CHECKPOINT_RESTORE: world * 0.8}
    faults = [
        {"kind": "crash", "rank": 2, "node": 0, "attempt": 0, "step": 80, "t": T0 + crash,
         "detail": f"worker exited with SIGKILL {EVIL}", "in_place": False, "detection": 0.4,
         "downtime": attempt1 - crash + 3.8 + 0.9, "redone": 4,
         "cost_s": {str(c): v for c, v in crash_cost.items()} | {Category.IDLE: 0.0}},
        {"kind": "hang", "rank": 1, "node": 1, "attempt": 1, "step": 140, "t": T0 + hang,
         "detail": "no heartbeat for 3.0 s (in backward)", "in_place": True, "detection": 3.0,
         "downtime": recovered - hang + 0.22, "redone": 0,
         "cost_s": {Category.WASTED_PROGRESS: world * 3.0,
                    Category.INFRASTRUCTURE_RECOVERY: world * 2.2}},
    ]
    return {
        "run_dir": f"unbroken_runs/sample-{EVIL}", "t0": T0, "wall_s": wall, "world_size": world,
        "goodput": mean[Category.PRODUCTIVE_STEP] / wall, "steps_known": True,
        "events_dropped": 3, "categories": categories, "seconds": mean,
        "badput_s": {c: v for c, v in mean.items() if c != Category.PRODUCTIVE_STEP},
        "ranks": ranks, "attempts": attempts, "faults": faults,
        "recoveries": [{"gen": 1, "t": T0 + hang + 3.0, "duration": 2.2, "world_size": world,
                        "faults": [f"hang rank 1 {EVIL}"]}],
        "checkpoints": checkpoints, "steps": steps,
        "spares": [{"t": T0 + 3.0, "node": 2, "event": "ready"},
                   {"t": T0 + hang + 3.1, "node": 2, "event": "promoted"}],
        "timeline": sim.segments,
    }


def plain_report() -> dict:
    """A plain script (no unbroken.init): no steps, no checkpoints, nothing but its time."""
    wall, world = 31.5, 2
    seconds = {str(c): 0.0 for c in Category} | {Category.PROGRAM_STARTUP: 1.5, Category.IDLE: 30.0}
    timeline = [seg for slot in range(world) for seg in (
        {"slot": slot, "start": T0, "end": T0 + 1.5, "category": Category.PROGRAM_STARTUP},
        {"slot": slot, "start": T0 + 1.5, "end": T0 + wall, "category": Category.IDLE})]
    return {"run_dir": "unbroken_runs/plain", "t0": T0, "wall_s": wall, "world_size": world,
            "goodput": 0.0, "steps_known": False, "events_dropped": 0,
            "categories": [str(c) for c in Category], "seconds": seconds,
            "badput_s": {c: v for c, v in seconds.items() if c != Category.PRODUCTIVE_STEP},
            "ranks": [{"slot": s, "seconds": dict(seconds)} for s in range(world)],
            "attempts": [{"attempt": 0, "start": T0, "end": T0 + wall, "seconds": seconds}],
            "faults": [], "recoveries": [], "checkpoints": [], "steps": [], "spares": [],
            "timeline": timeline}


def browse(page: Path, tmp_path: Path, *flags: str, timeout: float = 90) -> str:
    """Run headless Chromium on the page in a session of its own (it spawns a zygote, a
    renderer, ...); kill the whole group after, and on timeout. Returns its stdout."""
    env = os.environ | {"UNBROKEN_TEST_DIR": str(tmp_path)}  # conftest finds stragglers by it
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", *flags, page.resolve().as_uri()]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish within {timeout}s: {' '.join(argv)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"chromium exited {proc.returncode}:\n{err.decode()[-3000:]}"
    return out.decode()


def assert_self_contained(text: str) -> None:
    refs = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert not refs, refs
    assert "<link" not in text and "@import" not in text and "url(" not in text
    assert len(re.findall(r"<script", text)) == 1  # the load check only
    assert "<script>alert" not in text  # the event's text came escaped


def title_of(dom: str) -> str:
    found = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert found, dom[:500]
    return found.group(1)


@needs_chromium
def test_the_sample_report_is_self_contained_and_every_plot_loads(tmp_path):
    page = write_html(sample_report(), tmp_path / "report.html")
    text = page.read_text()
    assert_self_contained(text)
    for section in ("timeline", "breakdown", "steps", "loss", "faults", "recoveries", "attempts",
                    "checkpoints"):
        assert f'<section id="{section}">' in text, section
    assert 'id="dropped"' in text  # 3 events dropped, highlighted
    faults = re.search(r'<section id="faults">.*?<tbody>(.*?)</tbody>', text, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", faults, re.S)
    assert len(rows) == 2
    assert "<td>crash</td>" in rows[0] and "restart" in rows[0] and "&lt;script&gt;" in rows[0]
    assert "<td>hang</td>" in rows[1] and "in place" in rows[1]
    assert "checkpoint_restore" in rows[0] and "idle" not in rows[0]  # non-zero costs only
    n = plots_in(page)
    assert n >= 5

    shot = tmp_path / "report.png"
    dom = browse(page, tmp_path, "--dump-dom")
    assert title_of(dom) == f"unbroken report: ok ({n} plots)"
    browse(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000")
    assert shot.stat().st_size > 20_000
    if target := os.environ.get("UNBROKEN_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, target)


@needs_chromium
def test_a_plain_script_report_says_what_is_unknown_and_loads(tmp_path):
    page = write_html(plain_report(), tmp_path / "report.html")
    text = page.read_text()
    assert_self_contained(text)
    assert "Steps are unknown" in text and "Step times are unknown" in text
    assert "The loss is unknown" in text and "No faults." in text
    assert 'id="dropped"' not in text
    assert "<b>unknown</b><span>goodput</span>" in text  # not 0%
    n = plots_in(page)
    assert n == 3  # timeline, breakdown, per rank
    dom = browse(page, tmp_path, "--dump-dom")
    assert title_of(dom) == f"unbroken report: ok ({n} plots)"

    # and the check does tell: a plot that does not decode makes the title say so
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace("base64,iVBOR", "base64,AAAA", 1))
    dom = browse(broken, tmp_path, "--dump-dom")
    assert title_of(dom).startswith(f"unbroken report: broken (1 of {n} plots did not load: "
                                    "Timeline per rank"), title_of(dom)


@needs_chromium
def test_a_real_runs_fault_row_is_filled_in_the_browser(tmp_path):
    """A real job (2 workers, gloo) with an injected crash, its report made as `unbroken
    report --html` makes it, and the fault table's cells read from Chromium's DOM: where,
    whether injected, detection, downtime, redone steps, cost; none left blank."""
    from conftest import TINY, launch

    from unbroken.telemetry.report import build_report

    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "2",
                    "--fault", "crash:rank=1,step=6", args=["--steps", "12", *TINY], timeout=180)
    assert result.code == 0, result.output
    page = write_html(build_report([tmp_path / "run"]), tmp_path / "report.html")
    dom = browse(page, tmp_path, "--dump-dom")
    faults = re.search(r'<section id="faults">.*?<thead>(.*?)</thead>.*?<tbody>(.*?)</tbody>',
                       dom, re.S)
    heads = [re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r"<th[^>]*>(.*?)</th>",
                                                                   faults.group(1), re.S)]
    (row,) = re.findall(r"<tr>(.*?)</tr>", faults.group(2), re.S)
    cells = dict(zip(heads, [re.sub(r"<[^>]+>", " ", c).strip()
                             for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)],
                     strict=True))
    assert cells["kind"] == "crash" and cells["rank"] == "1" and cells["node"] == "0", cells
    assert cells["host"] not in ("", "—") and cells["fault"] == "injected", cells
    for column in ("detection s", "downtime s", "redone steps", "cost rank-s"):
        assert re.fullmatch(r"\d+(\.\d+)?", cells[column]), (column, cells)
    assert float(cells["downtime s"]) > 0 and float(cells["cost rank-s"]) > 0, cells
