"""The numerics policy (runtime/anomalies/numerics.py): NaN, Inf and spike verdicts, the rerun's
classification, the remedies, the anomaly limit, and the ledger's restore-and-merge."""

from __future__ import annotations

import math
import random

import pytest

from unbroken.errors import UserError
from unbroken.runtime.anomalies import numerics
from unbroken.runtime.anomalies.numerics import Cause, Kind, NumericsState, Sample, Verdict, decide
from unbroken.runtime.config import NumericsConfig, Remedy

CFG = NumericsConfig(enabled=True)


def sample(step, losses, grad_sq=None, batches=None):
    losses = tuple(losses)
    return Sample(step, losses, tuple(grad_sq or [1.0] * len(losses)),
                  tuple(batches or [float(step * 10 + r) for r in range(len(losses))]))


def warm(n=50, seed=0, start=3.0, slope=-0.01, noise=0.02):
    """A state whose window holds `n` steps of a slowly falling, noisy loss."""
    rng = random.Random(seed)
    state = NumericsState()
    for step in range(n):
        loss = start + slope * step + rng.gauss(0, noise)
        state, d = decide(state, sample(step, [loss, loss]), CFG)
        assert d.verdict == Verdict.COMMIT
    return state


def test_a_falling_noisy_loss_never_flags():
    state = NumericsState()
    rng = random.Random(1)
    for step in range(3000):
        loss = 5.0 * math.exp(-step / 800) + 0.5 + rng.gauss(0, 0.03)
        state, d = decide(state, sample(step, [loss, loss * 1.01]), CFG)
        assert d.verdict == Verdict.COMMIT, (step, d)
    assert len(state.window) == CFG.window


def test_a_nan_on_one_rank_is_rerun_then_skipped_when_it_reproduces():
    state = warm()
    bad = sample(50, [2.5, 2.5], grad_sq=[1.0, float("nan")])
    state, first = decide(state, bad, CFG)
    assert first.verdict == Verdict.RERUN
    assert first.found.kind == Kind.NAN and first.found.ranks == (1,) and first.found.rerun
    state, again = decide(state, bad, CFG)
    assert again.verdict == Verdict.SKIPPED and not again.rollback and not again.hardware
    assert again.classified.cause == Cause.DATA and again.classified.reproduced
    assert 50 in state.skips and state.pending is None
    assert [(e.step, e.kind, e.cause) for e in state.ledger] == [(50, Kind.NAN, Cause.DATA)]


def test_a_nan_that_does_not_reproduce_is_hardware_and_the_clean_rerun_commits():
    state = warm()
    state, first = decide(state, sample(50, [float("nan"), 2.5]), CFG)
    assert first.verdict == Verdict.RERUN and first.found.ranks == (0,)
    before = len(state.window)
    state, again = decide(state, sample(50, [2.5, 2.5]), CFG)
    assert again.verdict == Verdict.COMMIT and again.hardware
    assert again.classified.cause == Cause.HARDWARE and not again.classified.reproduced
    assert 50 not in state.skips and len(state.window) == min(before + 1, CFG.window)


def test_inf_is_its_own_kind():
    state, d = decide(NumericsState(), sample(0, [float("inf"), 1.0]), CFG)
    assert d.verdict == Verdict.RERUN and d.found.kind == Kind.INF


def test_a_spike_needs_history_a_score_and_a_rise():
    state = warm()
    med = sorted(state.window)[len(state.window) // 2]
    state2, d = decide(state, sample(50, [med * 3, med * 3]), CFG)
    assert d.verdict == Verdict.RERUN and d.found.kind == Kind.SPIKE and d.found.score > 6
    # A small rise is not a spike even with a large score (the relative floor).
    tight = NumericsState(window=tuple([1.0] * 50))
    _, small = decide(tight, sample(50, [1.05, 1.05]), CFG)
    assert small.verdict == Verdict.COMMIT
    # Too little history: no spike verdict at all.
    short = NumericsState(window=(1.0,) * (CFG.min_history - 1))
    _, early = decide(short, sample(19, [100.0, 100.0]), CFG)
    assert early.verdict == Verdict.COMMIT


def test_a_spike_whose_rerun_differs_is_hardware_even_if_still_high():
    state = warm()
    state, _ = decide(state, sample(50, [9.0, 9.0]), CFG)
    _, again = decide(state, sample(50, [8.0, 9.0]), CFG)
    assert again.classified.cause == Cause.HARDWARE
    assert again.verdict == Verdict.SKIPPED and again.hardware  # the values are still bad


def test_rerun_tolerance():
    cfg = NumericsConfig(enabled=True, rerun_rtol=1e-3)
    state = warm()
    state, _ = decide(state, sample(50, [9.0, 9.0]), cfg)
    _, again = decide(state, sample(50, [9.0001, 9.0]), cfg)
    assert again.classified.cause == Cause.DATA and again.classified.tolerance == 1e-3


def test_rollback_remedy_and_skip_after():
    cfg = NumericsConfig(enabled=True, remedy=Remedy.ROLLBACK, skip_after=3)
    state = warm()
    bad = sample(50, [float("nan"), 1.0])
    state, _ = decide(state, bad, cfg)
    state, d = decide(state, bad, cfg)
    assert d.verdict == Verdict.ROLLED_BACK and d.rollback
    assert state.skips == frozenset({50, 51, 52, 53})


def test_report_remedy_commits():
    cfg = NumericsConfig(enabled=True, remedy=Remedy.REPORT)
    state = warm()
    bad = sample(50, [9.0, 9.0])
    state, _ = decide(state, bad, cfg)
    state, d = decide(state, bad, cfg)
    assert d.verdict == Verdict.COMMIT and not state.skips and d.classified.cause == Cause.DATA


def test_a_new_step_forgets_an_unfinished_rerun():
    state = warm()
    state, _ = decide(state, sample(50, [float("nan"), 1.0]), CFG)
    state, d = decide(state, sample(51, [2.5, 2.5]), CFG)  # e.g. a recovery moved on
    assert d.verdict == Verdict.COMMIT and state.pending is None and not state.ledger


def test_the_limit_stops_the_job_and_names_steps_and_batches():
    cfg = NumericsConfig(enabled=True, max_anomalies=3, anomaly_window=100)
    state = warm()
    stops = []
    for step in (50, 52, 54):
        bad = sample(step, [float("nan"), 1.0], batches=[step * 100.0, step * 100.0 + 1])
        state, _ = decide(state, bad, cfg)
        state, d = decide(state, bad, cfg)
        stops.append(d.stop)
    assert stops[:2] == [None, None] and stops[2] is not None
    assert [e.step for e in stops[2].entries] == [50, 52, 54]
    line = numerics.report(stops[2])
    assert "step 50" in line and "5400,5401" in line and "limit 3" in line


def test_anomalies_outside_the_window_do_not_count():
    cfg = NumericsConfig(enabled=True, max_anomalies=2, anomaly_window=10)
    state = warm()
    for step in (50, 70):
        bad = sample(step, [float("nan"), 1.0])
        state, _ = decide(state, bad, cfg)
        state, d = decide(state, bad, cfg)
        assert d.stop is None


def test_loading_restores_the_window_and_merges_skips_and_ledger():
    older = warm(30)
    saved = numerics.to_json(older)
    state = warm(60, seed=5)
    bad = sample(60, [float("nan"), 1.0])
    state, _ = decide(state, bad, CFG)
    state, _ = decide(state, bad, CFG)
    loaded = numerics.merged(state, saved)
    assert loaded.window == older.window  # the timeline of the state loaded
    assert 60 in loaded.skips and [e.step for e in loaded.ledger] == [60]
    assert loaded.pending is None
    again = numerics.merged(loaded, numerics.to_json(loaded))
    assert again == loaded  # idempotent


def test_config_is_checked():
    with pytest.raises(UserError):
        NumericsConfig(window=10, min_history=20)
    with pytest.raises(UserError):
        NumericsConfig(max_anomalies=0)
