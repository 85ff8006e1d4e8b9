"""The recovery engine in-process, with fakes for what needs sockets and processes.

The engine and `Generations.join` (the switch loop: plan, gather, form, sync, build, and
leaving again when a try fails) are the real ones. Faked, each implementing the calls the
real object answers: the membership (`FakeMembership`: the leader's plans, as data), the
process groups (`FakeGroups`: a one-process world needs no sockets), and the state step (a
one-member world holds the newest state itself). The same scenarios run end to end, with
worker processes and the real leader, in tests/integration/test_in_place.py; and over a real
control store and a gloo group in tests/integration/test_engine_in_process.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from builders import Recorder
from torch.distributed import HashStore

from unbroken.control.messages import LeaveReason
from unbroken.faults.inject import FaultInjector
from unbroken.faults.spec import parse_faults
from unbroken.runtime.config import EngineSettings
from unbroken.runtime.engine import Engine
from unbroken.runtime.generations.membership import Plan
from unbroken.runtime.generations.recovery import Generations
from unbroken.runtime.generations.state_sync import NoStateError, SyncResult
from unbroken.runtime.position import Position
from unbroken.runtime.tracked import TrackedState

WID = "0.0"


class FakeMembership:
    """`Membership`'s calls, with the leader's side as data: each departure is answered with
    the next generation of the same one member; `superseded` generations are planned and
    then replaced before they form (a member died on the way)."""

    def __init__(self, superseded: tuple[int, ...] = ()) -> None:
        self.superseded = set(superseded)
        self.departures: list[tuple[int, int, bool, LeaveReason]] = []
        self.up: list[int] = []
        self.done: list[int] = []

    def leave(self, gen: int, step: int, holds_state: bool, reason: LeaveReason,
              **detail: Any) -> None:
        self.departures.append((gen, step, holds_state, LeaveReason(reason)))

    def next_plan(self, after: int, joining: bool = False) -> Plan:
        return Plan(after + 1, [WID], 0)

    def gather(self, plan: Plan) -> bool:
        return plan.gen not in self.superseded

    def store_for(self, plan: Plan, timeout: float) -> HashStore:
        return HashStore()

    def report_up(self, plan: Plan) -> None:
        self.up.append(plan.gen)

    def report_done(self, gen: int) -> None:
        self.done.append(gen)

    def finished(self) -> bool:
        return False

    def await_finished(self) -> None:
        """The leader's fallback came (a full restart stops this worker)."""

    def register_joiner(self, slot: int) -> None:
        raise AssertionError("not a joiner")


class FakeGroups:
    """`AbortableGroups`' calls for a one-process world: nothing to connect or abort."""

    def __init__(self) -> None:
        self.aborted = 0
        self.formed: list[tuple[int, int]] = []

    def form(self, store: Any, rank: int, world_size: int, backend: str, form_timeout: float,
             timeout: float) -> None:
        self.formed.append((rank, world_size))

    def abort(self) -> None:
        self.aborted += 1

    def interrupt(self) -> None:
        self.aborted += 1


class OneMemberGenerations(Generations):
    """The real switch loop; the state step of a one-member world: it holds the newest
    state, or no one does. `broken_syncs` tries fail as a peer's death would."""

    broken_syncs = 0
    oom_syncs = 0  # tries whose state step runs out of device memory

    def replicated(self, get_state: Callable[[], Any], set_state: Callable[[Any], None],
                   ) -> Callable[[Plan, int, bool], SyncResult]:
        def sync(plan: Plan, committed_step: int, holds_state: bool) -> SyncResult:
            if self.broken_syncs:
                self.broken_syncs -= 1
                raise RuntimeError("[gloo] Connection closed by peer")
            if self.oom_syncs:
                self.oom_syncs -= 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if not holds_state:
                raise NoStateError("no member holds committed state")
            return SyncResult(step=committed_step, source=None, received_bytes=0)
        return sync


def _engine(membership: FakeMembership, events: Recorder, faults: str = "",
            checkpointer: Any = None) -> tuple[Engine, FakeGroups]:
    groups = FakeGroups()
    gens = OneMemberGenerations(membership, groups, "gloo", timeout=10.0, join_timeout=3.0,
                                record=events.emit)
    claimed: set[str] = set()  # a fault fires once per job, as the control store's claim says

    def claim(key: str) -> bool:
        first = key not in claimed
        claimed.add(key)
        return first

    injector = FaultInjector(parse_faults(faults), 0, claim, events.emit)
    engine = Engine(Position(rank=0, world_size=1, step=0),
                    EngineSettings(in_place=True, slot=0, wid=WID, seed=0),
                    events=events, faults=injector, groups=groups, generations=gens,
                    checkpointer=checkpointer)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine.track(TrackedState(model, [torch.optim.SGD(model.parameters(), lr=0.1)], {}))
    return engine, groups


def _train(engine: Engine, steps: int, body: Callable[[int], None]) -> list[tuple[int, int]]:
    """run.train's loop, as any client drives the engine; the (step, gen) of each body run."""
    ran = []
    engine.start(steps, build=None, shadow_step=lambda step, view: None)
    while (step := engine.begin()) is not None:
        try:
            engine.enter(step)
            ran.append((step, engine.position.gen))
            engine.view(torch.ones(2, 4)).sum().backward()
            body(step)
        except Exception as exc:  # noqa: BLE001 - the engine decides
            engine.fail(step, exc)
            continue
        engine.tracked.update()
        engine.commit(step, {"loss": 1.0})
    engine.finish()
    engine.close()
    return ran


def _bias_after(commits: int) -> float:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1).bias.item() - commits * 0.1 * 2  # d(sum)/db = 2 per step


def test_a_fault_leaves_switches_and_resumes_at_the_step_it_broke():
    membership, events = FakeMembership(), Recorder()
    engine, groups = _engine(membership, events, faults="exception:rank=0,step=3")
    t0 = time.monotonic()
    ran = _train(engine, 6, lambda step: None)
    assert time.monotonic() - t0 < 1.0  # the bound; about 10 ms here

    assert ran == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]  # the fault: before the body
    assert engine.position == Position(rank=0, world_size=1, step=6, gen=1, holds_state=True)
    assert membership.departures == [(0, 3, True, LeaveReason.EXCEPTION)]
    assert groups.aborted == 1 and groups.formed == [(0, 1)]
    assert membership.up == [1] and membership.done == [1]
    switch, = events.named("gen_switch")
    assert (switch["gen"], switch["step"], switch["tries"], switch["rolled_back"]) == (1, 3, 1, 0)
    assert [r["step"] for r in events.named("step")] == [0, 1, 2, 3, 4, 5]
    assert events.named("step_failed")[0]["error_class"] == "user"
    # Six committed updates: the broken step's gradients were dropped, not applied.
    assert engine.tracked.model.bias.item() == pytest.approx(_bias_after(6))


def test_a_switch_that_fails_on_the_way_tries_the_next_generation():
    membership, events = FakeMembership(superseded=(1,)), Recorder()
    engine, _ = _engine(membership, events)
    engine.generations.broken_syncs = 1  # generation 2's state step: a peer dies mid-switch

    def body(step: int) -> None:
        if step == 2 and engine.position.gen == 0:
            raise RuntimeError("[gloo] Connection closed by peer")

    ran = _train(engine, 4, body)
    assert ran == [(0, 0), (1, 0), (2, 0), (2, 3), (3, 3)]
    assert [d[3] for d in membership.departures] == [
        LeaveReason.PEER, LeaveReason.SUPERSEDED, LeaveReason.PEER]
    assert [d[0] for d in membership.departures] == [0, 1, 2]
    assert events.named("gen_switch")[0]["tries"] == 3
    assert engine.position.gen == 3 and engine.position.step == 4


def _peer_dies_at_step_2(engine: Engine) -> Callable[[int], None]:
    def body(step: int) -> None:
        if step == 2 and engine.position.gen == 0:
            raise RuntimeError("[gloo] Connection closed by peer")
    return body


def test_out_of_memory_in_a_switch_is_the_switchs_fault_freed_and_tried_again():
    membership, events = FakeMembership(), Recorder()
    engine, _ = _engine(membership, events)
    engine.generations.oom_syncs = 1
    ran = _train(engine, 4, _peer_dies_at_step_2(engine))
    assert ran == [(0, 0), (1, 0), (2, 0), (2, 2), (3, 2)]  # the worker lives on, in place
    assert [d[3] for d in membership.departures] == [LeaveReason.PEER, LeaveReason.OUT_OF_MEMORY]
    failed, = events.named("switch_failed")
    assert failed["out_of_memory"] is True and "CUDA out of memory" in failed["error"]
    switch, = events.named("gen_switch")
    assert switch["tries"] == 2 and switch["free"] >= 0.0
    assert not events.named("step_failed")  # never classified as the user's error


def test_out_of_memory_twice_in_a_switch_restarts_the_job():
    membership, events = FakeMembership(), Recorder()
    engine, _ = _engine(membership, events)
    engine.generations.oom_syncs = 2
    with pytest.raises(NoStateError, match="out of memory"):
        _train(engine, 4, _peer_dies_at_step_2(engine))
    assert [d[3] for d in membership.departures] == [
        LeaveReason.PEER, LeaveReason.OUT_OF_MEMORY, LeaveReason.NO_STATE]
    assert [f.get("out_of_memory") for f in events.named("switch_failed")] == [True, True]


def test_a_dropped_step_commits_nothing_and_runs_again():
    membership, events = FakeMembership(), Recorder()
    engine, _ = _engine(membership, events)
    dropped: list[int] = []
    ran = []
    engine.start(3, build=None, shadow_step=lambda step, view: None)
    while (step := engine.begin()) is not None:
        engine.enter(step)
        ran.append(step)
        engine.view(torch.ones(1, 4)).sum().backward()
        if step == 1 and not dropped:
            dropped.append(step)
            engine.drop(step, "a loss spike")
            continue
        engine.tracked.update()
        engine.commit(step)
    engine.close()
    assert ran == [0, 1, 1, 2]
    assert engine.position.step == 3 and engine.position.gen == 0
    assert engine.tracked.model.bias.item() == pytest.approx(_bias_after(3) + 3 * 0.1)
    assert events.named("step_dropped")[0]["reason"] == "a loss spike"
    assert membership.departures == []  # dropping is local: no one left


def test_a_torn_update_then_a_fault_leaves_without_state():
    membership, events = FakeMembership(), Recorder()
    engine, _ = _engine(membership, events)
    engine.start(2, build=None, shadow_step=lambda step, view: None)
    step = engine.begin()
    with pytest.raises(ValueError), engine.updating():
        raise ValueError("half an update")
    assert not engine.tracked.whole
    # No member holds the state now: the switch fails, and the engine waits for the leader's
    # fallback (a full restart), which the fake never gives: the membership's bound says so.
    with pytest.raises(NoStateError):
        engine.fail(step, RuntimeError("[gloo] Connection closed by peer"))
    assert membership.departures[0] == (0, 0, False, LeaveReason.PEER)
    assert membership.departures[-1][3] == LeaveReason.NO_STATE

