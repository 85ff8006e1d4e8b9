"""`Engine.check` and `Engine.skip` in one process (world 1, no process group): the verdicts
as the loop sees them, and a skipped step against a plain PyTorch loop that never ran it."""

from __future__ import annotations

import pytest
import torch
from builders import Recorder

from unbroken.errors import JobStopped
from unbroken.faults.inject import FaultInjector
from unbroken.faults.spec import parse_faults
from unbroken.runtime.anomalies.anomaly_duty import LEDGER
from unbroken.runtime.config import AnomalyConfig, EngineSettings, NumericsConfig
from unbroken.runtime.engine import Engine, Verdict
from unbroken.runtime.position import Position
from unbroken.runtime.tracked import TrackedState

STEPS = 8


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)  # the data is a function of the step
    return model(torch.randn(3, 4, generator=g)).square().mean()


def _engine(faults: str = "", **numerics) -> tuple[Engine, Recorder]:
    events, claimed = Recorder(), set()

    def claim(key: str) -> bool:
        first = key not in claimed
        claimed.add(key)
        return first

    settings = EngineSettings(in_place=False, slot=0, wid="0.0", seed=None, anomalies=AnomalyConfig(
        numerics=NumericsConfig(enabled=True, **numerics)))
    engine = Engine(Position(rank=0, world_size=1, step=0), settings, events=events,
                    faults=FaultInjector(parse_faults(faults), 0, claim, events.emit),
                    groups=None)
    model, optim, sched = _model_and_optim()
    engine.track(TrackedState(model, [optim], {"sched": sched}))
    return engine, events


def _drive(engine: Engine) -> list[tuple[int, Verdict]]:
    """run.train's loop; the verdict of every try."""
    verdicts = []
    engine.start(STEPS, build=None, shadow_step=lambda step, view: None)
    while (step := engine.begin()) is not None:
        engine.enter(step)
        loss = _loss(engine.view, step)
        loss.backward()
        verdict = engine.check(step, {"loss": loss.item(), "data": step * 10})
        verdicts.append((step, verdict))
        if verdict is not Verdict.COMMIT:
            continue
        engine.tracked.update()
        engine.commit(step)
    return verdicts


def _plain(skip: set[int]) -> dict:
    """The same training in plain PyTorch, with `continue` at the skipped steps."""
    model, optim, sched = _model_and_optim()
    for step in range(STEPS):
        if step in skip:
            continue
        _loss(model, step).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        sched.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(),
            "sched": sched.state_dict()}


def _state(engine: Engine) -> dict:
    t = engine.tracked
    return {"model": t.model.state_dict(), "optim": t.optimizers[0].state_dict(),
            "sched": t.extra["sched"].state_dict()}


def _equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_a_persistent_nan_is_rerun_then_skipped_exactly_as_a_loop_that_never_ran_it():
    engine, events = _engine("nan:rank=0,step=3,persistent=1")
    verdicts = _drive(engine)
    assert verdicts[3:5] == [(3, Verdict.RERUN), (3, Verdict.SKIPPED)]
    assert [v for _, v in verdicts].count(Verdict.COMMIT) == STEPS - 1
    assert [(e["step"], e["reason"], e["data"]) for e in events.named("step_skipped")] == [
        (3, "nan", 30)]
    assert [e["step"] for e in events.named("step")] == [0, 1, 2, 4, 5, 6, 7]
    # AdamW's step count, the scheduler's epoch and the weights: as if step 3 never ran.
    _equal(_state(engine), _plain({3}))
    assert 3 in engine.tracked.extra[LEDGER].state.skips


def test_a_transient_nan_commits_the_clean_rerun():
    engine, events = _engine("nan:rank=0,step=3")
    verdicts = _drive(engine)
    assert verdicts[3:5] == [(3, Verdict.RERUN), (3, Verdict.COMMIT)]
    (c,) = events.named("anomaly_classified")
    assert c["cause"] == "hardware" and not c["reproduced"]
    _equal(_state(engine), _plain(set()))


def test_the_limit_raises_job_stopped():
    engine, events = _engine("nan:rank=0,step=2,persistent=1;nan:rank=0,step=4,persistent=1",
                             max_anomalies=2)
    with pytest.raises(JobStopped, match="step 2 .*step 4"):
        _drive(engine)
    assert events.named("anomaly_limit")[0]["steps"] == [2, 4]


def test_steps_asked_to_be_skipped_never_run():
    engine, events = _engine()
    engine.anomalies.asked.update({1, 5})
    verdicts = _drive(engine)
    assert [s for s, _ in verdicts] == [0, 2, 3, 4, 6, 7]
    assert [(e["step"], e["reason"]) for e in events.named("step_skipped")] == [
        (1, "asked"), (5, "asked")]
    _equal(_state(engine), _plain({1, 5}))
