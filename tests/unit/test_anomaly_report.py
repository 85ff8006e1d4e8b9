"""The report's anomalies section (telemetry/anomaly_report.py), from synthetic events."""

from __future__ import annotations

from unbroken.telemetry.anomaly_report import format_anomalies, summarize

CONFIG = {"event": "anomaly_config", "rank": 0}


def _steps(durations: dict[int, float], rank: int = 0) -> list[dict]:
    return [{"event": "step", "step": s, "rank": rank, "duration": d} for s, d in durations.items()]


def test_no_detector_no_section():
    assert summarize(_steps({0: 0.1})) is None
    assert format_anomalies(None) == ""


def test_a_drained_straggler_costs_its_excess_before_the_drain_and_nothing_after():
    durations = {s: 0.10 for s in range(0, 100)}
    durations.update({s: 0.15 for s in range(100, 130)})  # slot 1 runs 1.5x: everyone waits
    durations.update({s: 0.10 for s in range(130, 200)})  # the spare took the slot at 130
    events = [CONFIG, *_steps(durations), *_steps({s: 9.0 for s in durations}, rank=1),
              {"event": "straggler_flagged", "straggler": 1, "straggler_node": 0, "step": 125,
               "since_step": 100, "ratio": 1.5},
              {"event": "straggler_remedied", "straggler": 1, "step": 125, "action": "drain"},
              {"event": "gen_switch", "step": 130}]
    (s,) = summarize(events)["stragglers"]
    assert s["remedy"] == "drain" and s["remedied_step"] == 130 and s["baseline_s"] == 0.10
    assert abs(s["cost_before_s"] - 30 * 0.05) < 1e-6 and s["steps_before"] == 30
    assert s["cost_after_s"] == 0 and s["steps_after"] == 70
    assert "straggler slot 1 (1.50x from step 100" in format_anomalies(summarize(events))


def test_a_reported_straggler_costs_to_the_end_and_numerics_and_sdc_are_listed():
    durations = {s: 0.1 for s in range(60)}
    durations.update({s: 0.2 for s in range(60, 80)})
    events = [CONFIG, *_steps(durations),
              {"event": "straggler_flagged", "straggler": 2, "step": 75, "since_step": 60,
               "ratio": 2.0},
              {"event": "straggler_remedied", "straggler": 2, "step": 75, "action": "report"},
              {"event": "anomaly_classified", "step": 20, "kind": "nan", "cause": "data"},
              {"event": "step_skipped", "step": 20, "rank": 0},
              {"event": "sdc_check", "step": 10, "seconds": 0.08},
              {"event": "sdc_mismatch", "step": 15, "blamed": [2], "resolution": "majority"}]
    summary = summarize(events)
    (s,) = summary["stragglers"]
    assert s["remedy"] == "report" and s["remedied_step"] is None
    assert abs(s["cost_before_s"] - 20 * 0.1) < 1e-6
    assert summary["skipped"] == [20] and summary["numerics"][0]["cause"] == "data"
    assert abs(summary["sdc_overhead_pct"] - 100 * 0.08 / sum(durations.values())) < 1e-3
    text = format_anomalies(summary)
    assert "step 20: nan (data)" in text and "blamed slot(s) [2] (majority)" in text
