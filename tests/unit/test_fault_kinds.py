"""The fault kinds for anomaly detection (`nan`, `spike`, `bitflip`, a `slow` window): the
grammar round-trips and refuses mistakes in one line; the injector fires each fault once per
job, or again and again in the one process that holds a persistent fault; and each
corruption does exactly what it says to the tensors it is given."""

from __future__ import annotations

import math

import pytest
import torch

from unbroken.errors import UserError
from unbroken.faults import FaultSpec, parse_faults
from unbroken.faults.inject import FaultInjector
from unbroken.telemetry import schema as ev


class Claims:
    """The control plane's claim: True only the first time a key is asked, job-wide."""

    def __init__(self) -> None:
        self.claimed: set[str] = set()
        self.asked: list[str] = []

    def __call__(self, key: str) -> bool:
        self.asked.append(key)
        if key in self.claimed:
            return False
        self.claimed.add(key)
        return True


def _injector(text: str, rank: int = 0, claims: Claims | None = None,
              sleep=None) -> tuple[FaultInjector, list, Claims]:
    claims = claims or Claims()
    events: list = []
    kwargs = {"sleep": sleep} if sleep else {}
    return FaultInjector(parse_faults(text), rank, claims, events.append, **kwargs), events, claims


def _params(*shapes, dtype=torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


# The grammar


@pytest.mark.parametrize("text, spec", [
    ("crash:rank=1,step=30", FaultSpec("crash", 1, 30)),
    ("hang:rank=0,step=2,at=join", FaultSpec("hang", 0, 2, at="join")),
    ("device_error:rank=3,step=7", FaultSpec("device_error", 3, 7)),
    ("exception:rank=1,step=5,at=persist", FaultSpec("exception", 1, 5, at="persist")),
    ("slow:rank=0,step=3,seconds=2", FaultSpec("slow", 0, 3, 2.0)),
    ("slow:rank=0,step=3,seconds=0.25,steps=4", FaultSpec("slow", 0, 3, 0.25, steps=4)),
    ("slow:rank=0,step=3,steps=4,factor=3", FaultSpec("slow", 0, 3, steps=4, factor=3.0)),
    ("slow:rank=0,step=3,factor=1.5", FaultSpec("slow", 0, 3, factor=1.5)),
    ("slow:rank=0,step=3,seconds=60,at=update,until=abort",
     FaultSpec("slow", 0, 3, 60.0, at="update", until="abort")),
    ("nan:rank=1,step=10", FaultSpec("nan", 1, 10)),
    ("nan:rank=1,step=10,persistent=1", FaultSpec("nan", 1, 10, persistent=True)),
    ("spike:rank=0,step=4,scale=100", FaultSpec("spike", 0, 4, scale=100.0)),
    ("spike:rank=0,step=4,scale=0.001,persistent=1",
     FaultSpec("spike", 0, 4, scale=0.001, persistent=True)),
    ("bitflip:rank=2,step=8", FaultSpec("bitflip", 2, 8)),
    ("bitflip:rank=2,step=8,param=3,index=17,bit=62,persistent=1",
     FaultSpec("bitflip", 2, 8, param=3, index=17, bit=62, persistent=True)),
])
def test_every_kind_parses_and_prints_back_to_itself(text, spec):
    assert parse_faults(text) == [spec]
    assert str(spec) == text  # only what differs from the defaults, in one order
    assert parse_faults(str(spec)) == [spec] and spec.key == str(spec)


def test_round_trip_keeps_full_precision_and_field_order_does_not_matter():
    spec = parse_faults("spike:scale=1234567.125,step=1,rank=0")[0]
    assert spec.scale == 1234567.125 and parse_faults(str(spec)) == [spec]
    assert parse_faults("nan:rank=0,step=1,persistent=0") == [FaultSpec("nan", 0, 1)]


def test_numeric_kinds_fire_at_their_own_point():
    points = {f.kind: f.point for f in parse_faults(
        "nan:rank=0,step=1;spike:rank=0,step=1,scale=2;bitflip:rank=0,step=1;"
        "slow:rank=0,step=1,seconds=1;crash:rank=0,step=1,at=send")}
    assert points == {"nan": "grad", "spike": "loss", "bitflip": "update", "slow": "step",
                      "crash": "send"}


@pytest.mark.parametrize("bad, needle", [
    ("nan:rank=0,step=1,at=step", "always fires at 'grad'; drop at="),
    ("bitflip:rank=0,step=1,at=join", "always fires at 'update'"),
    ("spike:rank=0,step=1", "needs scale="),
    ("spike:rank=0,step=1,scale=0", "scale= must be a finite number > 0"),
    ("spike:rank=0,step=1,scale=-2", "scale= must be"),
    ("spike:rank=0,step=1,scale=nan", "scale= must be"),
    ("bitflip:rank=0,step=1,bit=64", r"bit= must be in 0\.\.63"),
    ("bitflip:rank=0,step=1,bit=-1", "bit= must be"),
    ("bitflip:rank=0,step=1,index=-1", "param= and index= must be >= 0"),
    ("slow:rank=0,step=1,factor=1", "factor= must be a finite number > 1"),
    ("slow:rank=0,step=1,factor=0.5", "factor= must be"),
    ("slow:rank=0,step=1,steps=0", "steps= must be >= 1"),
    ("slow:rank=0,step=1,seconds=2,factor=2", "seconds= or factor=, not both"),
    ("slow:rank=0,step=1,steps=3,at=persist", "need at=step"),
    ("slow:rank=0,step=1,seconds=inf", ">= 0"),
    ("nan:rank=0,step=1,persistent=yes", "persistent= must be 1 or 0"),
    ("slow:rank=0,step=1,until=abort", "until= takes abort, with at=update"),
    ("slow:rank=0,step=1,at=update,until=never", "until= takes abort, with at=update"),
    ("crash:rank=0,step=1,at=update,until=abort", "field until= is not valid for crash"),
    ("bitflip:rank=0,step=1,bit=x", "non-numeric"),
    # a field another kind takes is named, with the kind that refuses it
    ("crash:rank=0,step=1,factor=2", "field factor= is not valid for crash"),
    ("crash:rank=0,step=1,seconds=2", "field seconds= is not valid for crash"),
    ("crash:rank=0,step=1,persistent=1", "field persistent= is not valid for crash"),
    ("slow:rank=0,step=1,persistent=1", "field persistent= is not valid for slow"),
    ("nan:rank=0,step=1,scale=2", "field scale= is not valid for nan"),
    ("spike:rank=0,step=1,scale=2,bit=3", "field bit= is not valid for spike"),
    ("bitflip:rank=0,step=1,seconds=1", "field seconds= is not valid for bitflip"),
    ("nan:rank=0,step=1,steps=2", "field steps= is not valid for nan"),
])
def test_mistakes_are_one_clear_line(bad, needle):
    with pytest.raises(UserError, match=needle) as caught:
        parse_faults(bad)
    assert "\n" not in str(caught.value)


# Firing: once per job, or held by one process


def test_a_transient_fault_fires_once_per_job():
    claims = Claims()
    params = _params((3,))
    inj, events, _ = _injector("nan:rank=0,step=5", claims=claims)
    assert not inj.corrupt_gradients(4, params)
    assert inj.corrupt_gradients(5, params)
    params = _params((3,))
    assert not inj.corrupt_gradients(5, params)  # the rerun of the step: claimed already
    assert not torch.isnan(params[0].grad).any()
    again, _, _ = _injector("nan:rank=0,step=5", claims=claims)  # a replacement process
    assert not again.corrupt_gradients(5, params)
    assert len(events) == 1


def test_a_persistent_fault_fires_again_in_its_process_only():
    claims = Claims()
    inj, events, _ = _injector("nan:rank=0,step=5,persistent=1", claims=claims)
    for _ in range(3):  # the step, its rerun, a replay after a rollback
        assert inj.corrupt_gradients(5, _params((3,)))
    assert claims.asked == ["nan:rank=0,step=5,persistent=1"]  # claimed once, then held
    assert not inj.corrupt_gradients(6, _params((3,)))
    replacement, other_events, _ = _injector("nan:rank=0,step=5,persistent=1", claims=claims)
    params = _params((3,))
    assert not replacement.corrupt_gradients(5, params)
    assert not torch.isnan(params[0].grad).any()
    assert len(events) == 3 and other_events == []


def test_only_the_named_rank_keeps_a_fault_and_a_spare_keeps_none():
    text = "spike:rank=1,step=2,scale=10;bitflip:rank=1,step=2"
    for rank in (0, -1):
        inj, events, claims = _injector(text, rank=rank)
        assert not inj.has("spike") and not inj.has("bitflip")
        assert inj.scale_loss(2, 3.0, _params((2,))) == 3.0
        assert not inj.corrupt_update(2, _params((2,)))
        assert events == [] and claims.asked == []
    inj, _, _ = _injector(text, rank=1)
    assert inj.has("spike") and inj.has("bitflip") and not inj.has("nan")
    assert inj.scale_loss(2, 3.0, _params((2,))) == 30.0


def test_each_firing_is_recorded_at_its_point():
    inj, events, _ = _injector("nan:rank=0,step=1;spike:rank=0,step=1,scale=2;"
                               "bitflip:rank=0,step=1;slow:rank=0,step=1,seconds=0.5",
                               sleep=lambda s: None)
    params = _params((4,))
    inj.at_step(1)
    inj.corrupt_gradients(1, params)
    inj.scale_loss(1, 1.0, params)
    inj.corrupt_update(1, params)
    assert events == [
        ev.FaultInjected(fault="slow:rank=0,step=1,seconds=0.5", kind="slow", step=1, at="step"),
        ev.FaultInjected(fault="nan:rank=0,step=1", kind="nan", step=1, at="grad"),
        ev.FaultInjected(fault="spike:rank=0,step=1,scale=2", kind="spike", step=1, at="loss"),
        ev.FaultInjected(fault="bitflip:rank=0,step=1", kind="bitflip", step=1, at="update"),
    ]


# What each corruption does


def test_nan_poisons_exactly_one_element_of_the_first_gradient():
    inj, _, _ = _injector("nan:rank=0,step=0")
    params = _params((2, 3), (4,))
    params[0].grad = None  # the first with a gradient is poisoned
    before = params[1].grad.clone()
    assert inj.corrupt_gradients(0, params)
    nan = torch.isnan(params[1].grad)
    assert nan.sum() == 1 and nan[0]
    assert torch.equal(params[1].grad[1:], before[1:])
    assert params[0].grad is None


def test_nan_with_no_gradient_to_poison_is_a_user_error():
    inj, _, claims = _injector("nan:rank=0,step=0")
    params = _params((2,))
    params[0].grad = None
    with pytest.raises(UserError, match="no parameter given has a gradient"):
        inj.corrupt_gradients(0, params)
    assert claims.asked == []  # not spent


def test_spike_scales_every_gradient_and_the_loss():
    inj, _, _ = _injector("spike:rank=0,step=3,scale=1000")
    params = _params((2, 2), (3,), (1,))
    params[2].grad = None
    before = [p.grad.clone() for p in params[:2]]
    assert inj.scale_loss(2, 0.5, params) == 0.5
    assert inj.scale_loss(3, 0.5, params) == 500.0
    for p, b in zip(params[:2], before, strict=True):
        torch.testing.assert_close(p.grad, b * 1000)
    assert params[2].grad is None


_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bit", [0, 5, 15, None])
def test_bitflip_flips_exactly_one_bit(dtype, bit):
    nbits = torch.finfo(dtype).bits
    bit = nbits - 1 if bit is None else bit  # the sign bit, the top of the integer view
    inj, _, _ = _injector(f"bitflip:rank=0,step=2,param=1,index=4,bit={bit}")
    params = _params((3,), (2, 3), dtype=dtype)
    before = [p.detach().clone() for p in params]
    assert inj.corrupt_update(2, params)
    assert torch.equal(params[0].detach(), before[0])
    was, now = before[1].view(-1).view(_INT[dtype]), params[1].detach().view(-1).view(_INT[dtype])
    diff = [int(x) for x in (was ^ now)]
    assert diff[:4] + diff[5:] == [0] * 5
    assert diff[4] % (1 << nbits) == 1 << bit  # one bit, that one (the sign as it wraps)


def test_the_default_bitflip_changes_a_float32_weight():
    inj, _, _ = _injector("bitflip:rank=0,step=0")
    params = _params((2,))
    was = params[0].detach().clone()
    inj.corrupt_update(0, params)
    assert params[0][0] != was[0] and params[0][1] == was[1]
    assert params[0].requires_grad  # still the parameter, changed in place


@pytest.mark.parametrize("fault, params, needle", [
    ("bitflip:rank=0,step=0,param=2", lambda: _params((2,), (2,)), "2 parameter"),
    ("bitflip:rank=0,step=0,index=6", lambda: _params((2, 3)), "has 6 element"),
    ("bitflip:rank=0,step=0,bit=16", lambda: _params((2,), dtype=torch.bfloat16), "has 16 bits"),
    ("bitflip:rank=0,step=0", lambda: [torch.randn(3, 2).t()], "not contiguous"),
])
def test_a_bitflip_that_cannot_happen_is_a_user_error(fault, params, needle):
    inj, _, claims = _injector(fault)
    with pytest.raises(UserError, match=needle):
        inj.corrupt_update(0, params())
    assert claims.asked == []


# The slow window


def test_a_slow_window_sleeps_its_factor_of_the_step_time_frozen_at_its_start():
    slept: list[tuple[int, float]] = []
    step = -1
    inj, events, claims = _injector("slow:rank=0,step=3,steps=4,factor=3",
                                    sleep=lambda s: slept.append((step, s)))
    for step in range(10):
        inj.at_step(step, step_time=0.5 + step)  # the step time grows: frozen at 3.5
    assert slept == [(3, 7.0), (4, 7.0), (5, 7.0), (6, 7.0)]
    for step in (4, 5):  # a replay after a rollback, in the holder
        inj.at_step(step, step_time=100.0)
    assert slept[4:] == [(4, 7.0), (5, 7.0)]
    assert len(claims.asked) == 1 and len(events) == 6
    replacement, _, _ = _injector("slow:rank=0,step=3,steps=4,factor=3", claims=claims,
                                  sleep=lambda s: slept.append((step, s)))
    for step in range(10):
        replacement.at_step(step, step_time=1.0)
    assert len(slept) == 6


def test_a_slow_window_of_seconds_and_a_single_slow_step():
    slept: list[float] = []
    inj, _, _ = _injector("slow:rank=0,step=1,steps=2,seconds=0.25;slow:rank=0,step=5,seconds=2;"
                          "slow:rank=0,step=7,factor=2", sleep=slept.append)
    for step in range(10):
        inj.at_step(step, step_time=1.5)
    assert slept == [0.25, 0.25, 2.0, 1.5]
    inj.at_step(5)  # a single slow step fires once per job
    assert slept == [0.25, 0.25, 2.0, 1.5]


def test_a_factor_without_a_step_time_sleeps_nothing_until_one_is_given():
    slept: list[float] = []
    inj, _, _ = _injector("slow:rank=0,step=0,steps=3,factor=2", sleep=slept.append)
    for step in range(3):
        inj.at_step(step, step_time=None if step == 0 else 4.0 + step)
    assert slept == [0.0, 5.0, 5.0] and not any(map(math.isnan, slept))


def test_a_slow_until_abort_wakes_when_its_generation_is_aborted_or_its_seconds_end():
    """The straggler held at its update point until the fault is noticed (a fence test's
    order made independent of how long the notice takes), and never past `seconds`."""
    slept: list[float] = []
    inj, _, _ = _injector("slow:rank=0,step=4,seconds=60,at=update,until=abort",
                          sleep=slept.append)
    polls = iter([False] * 7 + [True])
    inj.at_point("update", 4, aborted=lambda: next(polls))
    assert len(slept) == 7 and sum(slept) == pytest.approx(0.14)
    slept.clear()
    inj, _, _ = _injector("slow:rank=0,step=4,seconds=0.05,at=update,until=abort",
                          sleep=slept.append)
    inj.at_point("update", 4, aborted=lambda: False)
    assert sum(slept) == pytest.approx(0.05) and len(slept) == 3
    slept.clear()
    inj, _, _ = _injector("slow:rank=0,step=4,seconds=2,at=update", sleep=slept.append)
    inj.at_point("update", 4, aborted=lambda: True)  # without until=, its seconds in full
    assert slept == [2.0]
