"""The benchmark harness's statistics (benchmarks/harness.py): pure functions, no processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness import (  # noqa: E402
    ArmStats,
    Try,
    alternate,
    change_pct,
    lost_steps,
    median_of,
    paired_ratios,
    percentile,
    ratio,
    recovery_times,
    restart_would_lose,
)


def test_arm_stats_has_the_keys_the_benchmarks_print():
    tries = [Try("a", recovery=r, lost_steps=lost) for r, lost in
             [(0.5, 0), (0.1, 2), (0.3, 1), (0.2, 0), (0.4, 6)]]
    stats = ArmStats.of(tries)
    assert stats.as_json() == {"tries": 5, "median_s": 0.3, "p90_s": 0.5,
                               "lost_steps_median": 1, "lost_steps_max": 6, "hangs": 0,
                               "failed": 0}


def test_hangs_and_errors_count_but_give_no_time():
    tries = [Try("a", recovery=1.0), Try("a", recovery=9.0, hang=True), Try("a", hang=True),
             Try("a", error="never reached the kill step"), Try("a", recovery=3.0)]
    stats = ArmStats.of(tries)
    assert recovery_times(tries) == [1.0, 3.0]
    assert (stats.tries, stats.hangs, stats.failed) == (5, 2, 1)
    assert stats.median_s == 2.0
    assert stats.lost_steps_median is None and stats.lost_steps_max is None


def test_a_try_that_recovered_but_did_not_end_well_failed():
    assert Try("a", recovery=0.2, finished=False).failed
    assert Try("a", recovery=0.2, exit=1).failed
    assert not Try("a", recovery=0.2, exit=0, finished=True).failed
    assert not Try("a", hang=True).failed


def test_no_tries_give_nulls_not_errors():
    assert ArmStats.of([]).as_json() == {"tries": 0, "median_s": None, "p90_s": None,
                                         "lost_steps_median": None, "lost_steps_max": None,
                                         "hangs": 0, "failed": 0}


def test_medians_round_to_the_millisecond():
    assert ArmStats.of([Try("a", recovery=0.12345), Try("a", recovery=0.2)]).median_s == 0.162
    assert median_of([3, 1, 2]) == 2
    assert median_of([1, 2]) == 1.5
    assert median_of([0.12345], 3) == 0.123
    assert median_of([]) is None


def test_percentile_is_the_nearest_rank_from_below():
    ten = [float(x) for x in range(1, 11)]
    assert percentile(ten, 0.9) == 10.0  # floor(0.9 * 10) = index 9: the largest
    assert percentile(list(range(1, 21)), 0.9) == 19
    assert percentile([7.0], 0.9) == 7.0
    assert percentile([3, 1, 2], 0.0) == 1
    with pytest.raises(ValueError):
        percentile([], 0.9)


def test_ratio_and_change():
    assert ratio(4.902, 0.14) == 35.0
    assert ratio(1.0, 3.0, 2) == 0.33
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    assert ratio(0.0, 2.0) == 0.0
    assert change_pct(28.654, 28.434) == 0.77
    assert change_pct(1.0, None) is None and change_pct(None, 1.0) is None
    assert change_pct(1.0, 0.0) is None


def test_paired_ratios_skip_rounds_without_both_figures():
    assert paired_ratios([2.0, None, 4.0], [3.0, 1.0, None]) == [0.5]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


def test_alternate_reverses_every_other_round_and_honours_per_arm_tries():
    order = []
    results = alternate(["a", "b", "c"], 3, lambda arm, i: order.append((i, arm)) or f"{arm}{i}",
                        tries={"c": 1})
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert results == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0"]}


def test_alternate_can_keep_one_order_and_reports_each_try():
    seen = []
    alternate(["x", "y"], 2, lambda arm, i: i, reverse=False,
              report=lambda i, arm, r: seen.append((i, arm, r)))
    assert seen == [(0, "x", 0), (0, "y", 0), (1, "x", 1), (1, "y", 1)]


def test_what_a_restart_would_redo_counts_from_the_newest_checkpoint_durable_at_the_kill():
    events = [{"event": "step", "step": s, "t": float(s)} for s in range(30)]
    events += [{"event": "checkpoint_saved", "step": 20, "t": 21.5},  # durable at 21.5
               {"event": "checkpoint_saved", "step": 25, "t": 27.5}]  # durable after the kill
    killed_at = 26.2  # steps 0..26 done
    assert restart_would_lose(events, killed_at) == 27 - 20
    # In place resumed at the round of step 25: 2 steps redone, 5 fewer than a restart.
    assert lost_steps(events, killed_at, {"step": 25}) == 2
    assert restart_would_lose(events[:5], 3.5) == 4  # no checkpoint yet: from step 0
