"""The leader's Prometheus `/metrics` on a running job, scraped and parsed with
prometheus_client's own parser, and checked against the job's event log; the status line;
a port that cannot be bound."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest
from conftest import TINY, events_of, finish, free_port, launch, start, wait_for
from prometheus_client.parser import text_string_to_metric_families

from unbroken.telemetry.categories import BADPUT
from unbroken.telemetry.goodput import account
from unbroken.telemetry.metric_names import Metric
from unbroken.telemetry.report import load_events

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_scrape_of_a_running_job_agrees_with_its_event_log(tmp_path):
    """Scraped while rank 1 sleeps in an 11 s straggler step (the log is quiet then): the
    counters equal what the log holds, and the goodput gauges equal the accounting of the
    log up to the moment they were computed (the wall gauge says when)."""
    run_dir, port = tmp_path / "run", free_port()
    proc = start(run_dir, "--nproc-per-node", "2", "--metrics-port", str(port),
                 "--status-every", "1", "--hang-timeout", "120", "--max-restarts", "1",
                 "--fault", "slow:rank=1,step=25,seconds=11",
                 args=["--steps", "30", *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--checkpoint-every", "10"])
    try:
        wait_for(lambda: events_of(run_dir, "fault_injected"), 120, "the straggler step")
        time.sleep(7)  # past a poll (0.5 s) and a refresh of the accounting (5 s)
        m = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        result = finish(proc, run_dir)
    assert result.code == 0, result.output
    assert re.search(rf"metrics: http://127\.0\.0\.1:{port}/metrics", result.output)
    events = [e for e in load_events([run_dir]) if e["t"] <= events_of(
        run_dir, "fault_injected")[0]["t"] + 1]
    steps0 = [e for e in events if e["event"] == "step" and e["slot"] == 0]
    assert len(steps0) == 25
    assert m[(f"{Metric.STEPS}_total", ())] == 25
    assert m[(Metric.STEP, ())] == 25
    assert m[(f"{Metric.STEP_TIME}_count", ())] == 25
    assert m[(f"{Metric.STEP_TIME}_sum", ())] == pytest.approx(
        sum(e["duration"] for e in steps0), abs=1e-4)
    stalls = [e for e in events if e["event"] == "checkpoint_saved" and e["slot"] == 0]
    assert m[(f"{Metric.CHECKPOINT_STALL}_count", ())] == len(stalls) >= 1
    assert m[(Metric.WORLD_SIZE, ())] == 2
    assert m.get((f"{Metric.FAULTS}_total", (("kind", "crash"),)), 0) == 0
    # The accounting the gauges came from: every event up to when it ran.
    t0 = min(e["t"] for e in events if e["event"] == "agent_start")
    until = t0 + m[(Metric.WALL, ())]
    expected = account([e for e in events if e["t"] <= until], slots=[0, 1], until=until)
    assert m[(Metric.GOODPUT, ())] == pytest.approx(expected["goodput"], abs=1e-5)
    for c in BADPUT:
        assert m[(Metric.BADPUT, (("category", c.value),))] == pytest.approx(
            expected["badput_s"][c.value], abs=1e-5), c
    assert 0 < m[(Metric.GOODPUT, ())] < 1
    # The node's own series (every agent serves them): both ranks' steps, each fault kind
    # at 0 from the start, its role, and rank-seconds that never exceed the ranks' time.
    def node(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted({"node": "0", **labels}.items())))]

    assert node(f"{Metric.NODE_STEPS}_total") == 50
    assert node(f"{Metric.NODE_FAULTS}_total", kind="crash") == 0
    run_id = events_of(run_dir, "agent_start")[0]["run_id"]
    assert node(Metric.NODE_INFO, role="leader", run=run_id) == 1
    assert node(f"{Metric.NODE_CHECKPOINT_STALL}_total") == pytest.approx(
        sum(e["stall"] for e in events if e["event"] == "checkpoint_saved"), abs=1e-4)
    ranked = sum(v for (name, _), v in m.items() if name == f"{Metric.NODE_RANK_SECONDS}_total")
    productive = node(f"{Metric.NODE_RANK_SECONDS}_total", category="productive_step")
    assert 0 < productive < ranked <= 2 * m[(Metric.WALL, ())] + 1e-6
    assert re.search(r"status: step \d+, [\d.]+ steps/s, goodput \d+% so far, faults 0, "
                     r"spares ready 0", result.output), result.output


def test_a_metrics_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = launch(tmp_path / "run", "--metrics-port", str(port), args=["--steps", "3", *TINY],
                        timeout=120)
    assert result.code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if "error" in x]
    assert f"--metrics-port {port}: cannot serve /metrics on 127.0.0.1" in line
    assert not events_of(tmp_path / "run", "worker_start")
