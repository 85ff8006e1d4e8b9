"""The recovery engine in one process, over a real control store and a real gloo group.

The collaborators are the real ones over a real in-process control store (a TCPStore served
here, spoken to through `Channel` and `Membership`), a one-process gloo world, and a fake
leader: a thread that answers a departure with the next generation's plan, written under the
keys the real leader writes (`AttemptKeys`). The same scenarios run end to end, with real
worker processes and the real leader, in tests/integration/test_in_place.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from builders import Recorder

from unbroken.control.channel import Channel
from unbroken.control.messages import GenPlan, LeaveReason
from unbroken.control.schema import AttemptKeys
from unbroken.control.tcp import TcpBackend
from unbroken.faults.inject import FaultInjector
from unbroken.runtime.config import EngineSettings
from unbroken.runtime.engine import Engine
from unbroken.runtime.generations.membership import Membership
from unbroken.runtime.generations.recovery import Generations
from unbroken.runtime.groups.process_group import AbortableGroups
from unbroken.runtime.position import Position
from unbroken.runtime.tracked import TrackedState

WID = "0.0"


class FakeLeader(threading.Thread):
    """Plans generation g+1 of the same member once a member has left generation g."""

    def __init__(self, channel: Channel, attempt: int) -> None:
        super().__init__(daemon=True)
        self.channel, self.keys = channel, AttemptKeys(attempt)
        self.stop = threading.Event()
        self.departures: list = []

    def run(self) -> None:
        gen = 0
        while not self.stop.is_set():
            left = self.channel.entries(self.keys.gen(gen).departures, 0)
            if left:
                self.departures += [d for node in left for d in node.departures]
                gen += 1
                self.channel.write(self.keys.gen(gen).plan, GenPlan(gen=gen, members=[WID]))
                self.channel.write(self.keys.latest_gen, gen)
            time.sleep(0.001)


@pytest.fixture
def world():
    """A served control store, and generation 0: a one-process gloo group."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    channel = Channel(TcpBackend(server, "engine-test", "127.0.0.1", server.port))
    groups = AbortableGroups()
    with groups.recording():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups.backend = "gloo"
    leader = FakeLeader(channel, attempt=0)
    leader.start()
    yield channel, groups, leader
    leader.stop.set()
    leader.join(5)
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine(channel: Channel, groups: AbortableGroups, events: Recorder) -> Engine:
    gens = Generations(Membership(channel, 0, WID, lambda: None, timeout=10.0), groups,
                       "gloo", timeout=10.0, join_timeout=3.0, record=events.emit)
    faults = FaultInjector([], 0, lambda key: True, events.emit)
    return Engine(Position(rank=0, world_size=1, step=0), EngineSettings(in_place=True, slot=0,
                  wid=WID, seed=0), events=events, faults=faults, groups=groups,
                  generations=gens)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_fault_leaves_switches_and_resumes_at_the_step_it_broke(world):
    channel, groups, leader = world
    events = Recorder()
    engine = _engine(channel, groups, events)
    model, optimizer = _model()
    engine.track(TrackedState(model, [optimizer], {}))
    ran: list[tuple[int, int]] = []  # (step, generation) of every step body that ran
    t0 = time.monotonic()
    engine.start(6, build=None, shadow_step=lambda step, view: None)
    while (step := engine.begin()) is not None:
        try:
            engine.enter(step)
            ran.append((step, engine.position.gen))
            model(torch.ones(2, 4)).sum().backward()
            if step == 3 and engine.position.gen == 0:
                raise RuntimeError("a fault in the step")
        except Exception as exc:  # noqa: BLE001 - the engine decides
            engine.fail(step, exc)
            continue
        engine.tracked.update()
        engine.commit(step, {"loss": 1.0})
    engine.finish()
    elapsed = time.monotonic() - t0
    engine.close()

    assert ran == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (4, 1), (5, 1)]
    assert engine.position == Position(rank=0, world_size=1, step=6, gen=1, holds_state=True)
    assert [d.reason for d in leader.departures] == [LeaveReason.EXCEPTION]
    assert leader.departures[0].step == 3 and leader.departures[0].holds_state
    names = [r["event"] for r in events.records]
    assert names.index("step_failed") < names.index("gen_leave") < names.index("gen_switch")
    switch = next(r for r in events.records if r["event"] == "gen_switch")
    assert (switch["gen"], switch["step"], switch["rolled_back"]) == (1, 3, 0)
    assert [r["step"] for r in events.records if r["event"] == "step"] == [0, 1, 2, 3, 4, 5]
    # 6 committed SGD steps of d(sum(Wx+b))/db = 2 each: the dropped step left no trace.
    assert model.bias.item() == pytest.approx(_model()[0].bias.item() - 6 * 0.1 * 2)
    assert elapsed < 10.0  # about 0.1 s; loose, as every time bound here
