"""`unbroken simulate`: the Monte Carlo against closed forms and published figures, its
planning, its inputs from real runs, and its command line (pure: numpy, no processes)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from unbroken.cli import main
from unbroken.errors import UserError
from unbroken.simulate.draws import draw
from unbroken.simulate.engine import Checkpoints, simulate
from unbroken.simulate.from_run import from_reports, poisson_mtbf
from unbroken.simulate.inputs import Failures, Job, Kind, Scale, Strategy
from unbroken.simulate.planning import plan_spares
from unbroken.simulate.validation import (
    closed_form_check,
    llama3_check,
    rsc_fit,
    young_daly_check,
)

SMALL = Job(gpus=1024, days=10)


def test_no_failures_and_free_checkpoints_give_an_ettr_of_one():
    failures = Failures(gpu_mtbf_hours=1e15)
    draws = draw(failures, SMALL, 5)
    assert draws.count(SMALL.horizon_s).sum() == 0
    free = Checkpoints(every_s=600.0, stall_s=0.0, persist_s=0.0)
    for s in Strategy:
        out = simulate(draws, SMALL, failures, Scale(), s, free)
        out.check()
        assert (out.ettr == 1.0).all(), s


def test_a_constant_rate_with_restarts_matches_the_closed_form_within_two_percent():
    """16,384 GPUs at 1.8 h MTTF (some 720 failures a run), 100 runs of 54 days."""
    c = closed_form_check(gpus=16384, seeds=100)
    assert c.error < 0.02, c


def test_young_dalys_interval_wastes_within_one_percent_of_the_best_interval():
    sweep = young_daly_check(seeds=30)
    assert sweep.daly_waste <= sweep.best_waste * 1.01, sweep
    assert sweep.waste[0] > sweep.daly_waste and sweep.waste[-1] > sweep.daly_waste


def test_llama3s_interruption_rate_with_sourced_costs_gives_its_reported_ettr():
    check = llama3_check(seeds=20)
    assert check.ettr >= check.published  # published: "higher than 90 %"
    assert check.inputs["mttf_hours"] == pytest.approx(54 * 24 / 419, abs=1e-3)
    daly = [r["ettr"] for r in check.sensitivity if r["checkpoint_every_min"] is None]
    assert daly == sorted(daly, reverse=True)  # a slower restart, a lower ETTR
    hourly = [r["ettr"] for r in check.sensitivity if r["checkpoint_every_min"] == 60.0]
    assert max(hourly) < check.published  # an hourly checkpoint could not have given 90 %


def test_the_rsc_model_of_one_rate_per_node_fits_its_own_projection_not_its_small_jobs():
    fit = rsc_fit()
    assert fit.paper_ratio[16384] == pytest.approx(1.0, abs=0.01)  # 1.8 h came from the rate
    assert fit.paper_ratio[8] > 3 and fit.paper_ratio[1024] > 3  # it overestimates both
    assert max(abs(np.log(r)) for r in fit.fitted_ratio.values()) < np.log(2.5)


def test_every_second_is_charged_and_recovery_in_place_beats_a_restart_on_the_same_draws():
    failures = Failures()
    job = Job(gpus=16384, days=10)
    draws = draw(failures, job, 20)
    ettr = {}
    for s in Strategy:
        out = simulate(draws, job, failures, Scale(), s)
        out.check()
        ettr[s] = out.ettr.mean()
    assert ettr[Strategy.TORCHRUN] < ettr[Strategy.IN_PLACE] < ettr[Strategy.SPARES] \
        <= ettr[Strategy.SPARES_STANDBY]


def test_a_seed_reproduces_its_run_and_another_seed_does_not():
    failures = Failures()
    a = simulate(draw(failures, SMALL, 5, seed=1), SMALL, failures, Scale(), Strategy.IN_PLACE)
    b = simulate(draw(failures, SMALL, 5, seed=1), SMALL, failures, Scale(), Strategy.IN_PLACE)
    c = simulate(draw(failures, SMALL, 5, seed=2), SMALL, failures, Scale(), Strategy.IN_PLACE)
    assert (a.ettr == b.ettr).all() and not (a.ettr == c.ettr).all()


def test_weibull_gaps_keep_the_mean_failure_count():
    job = Job(gpus=16384, days=20)
    n = [draw(Failures(weibull_shape=k), job, 50).count(job.horizon_s).mean() for k in (1, 0.7)]
    assert n[1] == pytest.approx(n[0], rel=0.1)


def test_a_lost_node_costs_a_restart_its_replacement_time_in_place_and_a_switch_with_a_standby():
    failures = Failures(shares={k: 1.0 if k == Kind.NODE_LOST else 0.0 for k in Kind})
    job = Job(gpus=64, days=30, node_replace_s=6 * 3600)
    draws = draw(failures, job, 20)
    cap = {s: simulate(draws, job, failures, Scale(), s).seconds for s in Strategy}
    from unbroken.telemetry.categories import Category

    lost = {s: cap[s][Category.CAPACITY_LOST] for s in Strategy}
    assert lost[Strategy.IN_PLACE].mean() > 0 and not lost[Strategy.TORCHRUN].any()
    assert (lost[Strategy.SPARES_STANDBY] <= lost[Strategy.IN_PLACE]).all()
    assert lost[Strategy.SPARES_STANDBY].mean() < 0.5 * lost[Strategy.IN_PLACE].mean()


# ---------------------------------------------------------------- capacity planning
def test_spares_auto_picks_the_cheapest_reserve_or_the_fewest_gpus_reaching_a_target():
    job = Job(gpus=4096, days=10)
    plan = plan_spares(Failures(), job, Scale(), 5, gpu_hour_cost=2.0)
    assert plan.chosen is min(plan.options, key=lambda o: o.gpu_hours)
    assert plan.chosen.cost == pytest.approx(plan.chosen.gpu_hours * 2.0)
    target = sorted(o.ettr for o in plan.options)[-3]
    aimed = plan_spares(Failures(), job, Scale(), 5, target_ettr=target)
    assert aimed.chosen.ettr >= target
    assert aimed.chosen.reserve_gpus == min(o.reserve_gpus for o in aimed.options
                                            if o.ettr >= target)
    unreachable = plan_spares(Failures(), job, Scale(), 5, target_ettr=0.99999)
    assert unreachable.chosen is None and "no reserve reaches" in unreachable.why


# ---------------------------------------------------------------- from the user's runs
def _report(faults, world=4, wall=3600.0):
    return {"world_size": world, "wall_s": wall, "faults": faults, "spares": [],
            "recoveries": [{"t": 100.0, "duration": 0.2, "faults": ["crash"]},
                           {"t": 200.0, "duration": 0.4, "faults": ["crash"]},
                           {"t": 300.0, "duration": 9.0, "faults": []}],
            "checkpoints": [{"ok": True, "stall": 0.01, "durable": 0.5}]}


def _fault(injected):
    return {"kind": "crash", "in_place": True, "injected": injected, "detection": 0.05,
            "cost_s": {}}


def test_injected_faults_give_costs_and_never_a_rate():
    m = from_reports([_report([_fault(True), _fault(True)])])
    assert m.gpu_mtbf_hours is None and m.injected_faults == 2
    assert m.costs["switch_s"].median == pytest.approx(0.3)  # the grow-back is not a recovery
    assert m.measured().switch_s == pytest.approx(0.3)
    assert any("injected faults give costs, never rates" in line for line in m.describe())


def test_real_faults_give_a_rate_with_the_uncertainty_of_a_small_sample():
    m = from_reports([_report([_fault(False), _fault(False), _fault(True)])])
    est, lo, hi = m.gpu_mtbf_hours
    assert est == pytest.approx(4 * 1.0 / 2)  # 4 GPU-hours, 2 real faults
    assert lo < est < hi and hi / lo > 10  # two faults say little
    est, lo, hi = poisson_mtbf(100, 1000.0)
    assert lo < est < hi and hi / lo < 1.6


# ---------------------------------------------------------------- bad input, the CLI
def test_bad_failure_inputs_are_one_clear_error():
    with pytest.raises(UserError, match="sum to 1"):
        Failures(shares={Kind.CRASH: 0.5})
    with pytest.raises(UserError, match="must be positive"):
        Failures(job_mttf_hours=-1.0)
    with pytest.raises(UserError, match="not be negative"):
        Failures(shares={Kind.CRASH: 1.5, Kind.HANG: -0.5})


@pytest.mark.parametrize("argv, says", [
    (["--job-mttf-hours", "-2"], "--job-mttf-hours must be positive"),
    (["--gpu-mtbf-hours", "0"], "--gpu-mtbf-hours must be positive"),
    (["--shares", "crash=0.4,hang=0.4"], "must sum to 1"),
    (["--shares", "meteor=1"], "--shares takes KIND=SHARE"),
    (["--target-ettr", "1.5", "--spares", "auto"], "--target-ettr must be between 0 and 1"),
    (["--target-ettr", "0.99"], "are for --spares auto"),
    (["--sweep", "--spares", "auto"], "works at one scale"),
    (["--sweep", "--gpus-per-node", "3"], "--gpus-per-node must divide 8"),
    (["--shares", "crash=nan,hang=1"], "must not be negative"),
    (["--weibull-shape", "0.004"], "--weibull-shape must be between 0.1 and 20"),
    (["--job-mttf-hours", "1e-9"], "too many to simulate"),
    (["--switch-s", "-1"], "--switch-s must be zero or more"),
])
def test_the_command_refuses_bad_input_in_one_line_with_exit_2(argv, says, capsys):
    try:
        code = main(["simulate", *argv])
    except SystemExit as exc:  # argparse's own refusals exit there
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_run_dir_without_events_is_refused(tmp_path, capsys):
    assert main(["simulate", "--from-run", str(tmp_path)]) == 2
    assert "no event log" in capsys.readouterr().err


def test_json_holds_every_strategy_and_the_llama3_check(capsys):
    assert main(["simulate", "--gpus", "1024", "--days", "10", "--seeds", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for s in Strategy:
        assert 0 < out[s.value]["ettr"] <= 1 and "infrastructure_recovery" in out[s.value][
            "badput_s"]
    assert out["llama3_check"]["ettr"] >= out["llama3_check"]["published"] == 0.90


def test_the_plot_and_the_page_are_written(tmp_path, capsys):
    png, html = tmp_path / "sim.png", tmp_path / "sim.html"
    assert main(["simulate", "--gpus", "512", "--days", "5", "--seeds", "3", "--png", str(png),
                 "--html", str(html)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = html.read_text()
    assert "data:image/png;base64," in page and "torchrun restart" in page


def test_costs_grow_with_scale_as_the_model_states():
    scale = Scale()
    small, big = Job(gpus=32), Job(gpus=16384)
    assert scale.restart_s(big) > scale.restart_s(small) > 60
    assert 19 < scale.switch_s(small) < scale.switch_s(big) < 30  # TrainMover: ~20 s
    assert scale.restart_s(replace(big, restart_s=120.0)) == 120.0


def test_a_switch_given_or_measured_replaces_the_modelled_one_at_every_scale():
    scale, big = Scale(), Job(gpus=16384, days=10)
    given = replace(big, switch_s=0.083)
    assert scale.switch_s(given) == 0.083  # no communicator set-up added on top
    transfer = big.state_gb_per_gpu / big.host_copy_gbps
    assert scale.spare_s(given) == pytest.approx(0.083 + transfer)
    assert scale.switch_s(replace(given, gpus=32)) == 0.083
    assert scale.switch_s(big) > 20  # unchanged without it: the validations do not move
    draws = draw(Failures(), big, 5, seed=1)
    slow = simulate(draws, big, Failures(), scale, Strategy.IN_PLACE)
    fast = simulate(draws, given, Failures(), scale, Strategy.IN_PLACE)
    assert fast.ettr.mean() > slow.ettr.mean()  # the same draws, each switch cheaper


FIXTURE_RUN = __import__("pathlib").Path(__file__).parent / "fixtures" / "old_run"


def test_the_switchs_figure_says_where_it_comes_from(capsys):
    small = ["simulate", "--gpus", "64", "--days", "2", "--seeds", "2"]
    assert main([*small, "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["switch_s"] is None and inputs["switch_source"].startswith("modelled")
    assert main([*small, "--switch-s", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["switch_s"] == 0.5 and "(--switch-s)" in out["inputs"]["switch_source"]
    assert out["costs"]["switch_s"] == 0.5
    assert main([*small, "--from-run", str(FIXTURE_RUN), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # the run measured 0.082 and 0.096 s
    assert out["inputs"]["switch_s"] == pytest.approx(0.089, abs=0.001)
    assert "as --from-run measured it" in out["inputs"]["switch_source"]
    assert main([*small, "--from-run", str(FIXTURE_RUN), "--switch-s", "3"]) == 0
    text = capsys.readouterr().out
    assert "in-place switch: 3 s at every scale (--switch-s)" in text


def test_the_best_interval_is_young_dalys_for_restarts_and_longer_in_place():
    from unbroken.simulate.cli import _best_interval

    best = _best_interval(Failures(), Job(gpus=16384, days=10), Scale(), 5, 0)
    assert best["torchrun"]["daly_waste"] <= best["torchrun"]["best_waste"] * 1.01
    assert best["in_place"]["best_s"] > best["in_place"]["daly_s"]  # failures lose no work


def test_no_category_goes_negative_whatever_fails_and_however_often():
    """Windows (shrunk, slowed) and lost work are charged only on compute that happened:
    one kind of failure at a time, at 131,072 GPUs (a failure every 13 min)."""
    job = Job(gpus=131072, days=2)
    for kind in Kind:
        failures = Failures(shares={k: 1.0 if k == kind else 0.0 for k in Kind})
        draws = draw(failures, job, 3)
        for s in Strategy:
            out = simulate(draws, job, failures, Scale(), s)  # checks itself
            assert (0 <= out.ettr).all() and (out.ettr <= 1).all(), (kind, s)


def test_a_failure_during_the_wait_for_the_only_node_does_not_end_the_wait():
    from unbroken.simulate.draws import KINDS, Draws
    from unbroken.telemetry.categories import Category

    job = Job(gpus=8, days=1, node_replace_s=6 * 3600)  # one node: nothing to shrink to
    draws = Draws(t=np.array([[1000.0, 2000.0]]),
                  kind=np.array([[KINDS.index(Kind.NODE_LOST), KINDS.index(Kind.HANG)]]),
                  node=np.array([[0, 0]]))
    out = simulate(draws, job, Failures(), Scale(), Strategy.IN_PLACE)
    assert out.seconds[Category.INFRASTRUCTURE_RECOVERY][0] >= 6 * 3600


def test_checkpoints_are_never_closer_than_their_persist_time():
    assert Checkpoints(every_s=1.0, stall_s=0.0, persist_s=64.0).every_s == 64.0


def test_the_poisson_interval_is_exact():
    assert poisson_mtbf(1, 10.0) == pytest.approx((10.0, 1.7948, 394.98), rel=1e-3)
