"""Async checkpoints in process: a consistent staged copy taken at start, a background persist
with real threads, real DCP writes and a real optimizer, the interval and retention rules.
(Real workers and real faults mid-write: tests/integration/test_async_checkpoint.py.)
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from builders import assert_same, clone, state_of, tiny_model, train_step

from unbroken.checkpoint.checkpointer import Checkpointer, committed_checkpoints
from unbroken.checkpoint.interval import Schedule, daly_interval
from unbroken.checkpoint.layout import to_delete
from unbroken.checkpoint.manifest import verify_manifest
from unbroken.telemetry.schema import encode


def test_the_staged_copy_is_the_state_at_start_even_as_training_goes_on(tmp_path):
    """The optimizer update right after start() waits for the copy; BatchNorm statistics
    changed by the next forward are not in the checkpoint; the learning rate a scheduler
    changes afterwards is not either."""
    model, optimizer = tiny_model()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    events = []
    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda e: events.append((e.event, encode(e))))
    ckpt.protect(model, [optimizer])
    for _ in range(3):
        train_step(model, optimizer)
    expected = clone(state_of(model, optimizer))
    assert ckpt.start(state_of(model, optimizer), step=3)
    for _ in range(3):  # training goes on at once, while the copy and the write happen
        train_step(model, optimizer)
        scheduler.step()
    assert ckpt.wait(60)
    moved = state_of(model, optimizer)
    assert not torch.equal(moved["model"]["0.weight"], expected["model"]["0.weight"])
    fresh_model, fresh_optimizer = tiny_model()
    torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1)  # adds initial_lr, as above
    target = state_of(fresh_model, fresh_optimizer)
    assert ckpt.load_latest(target) == 3
    assert_same(target["model"], expected["model"])
    assert_same(target["optim"], expected["optim"])
    saved = [kw for name, kw in events if name == "checkpoint_saved"]
    assert saved and saved[0]["step"] == 3 and saved[0]["durable"] >= saved[0]["stall"]
    assert verify_manifest(tmp_path / "ckpt" / "step_000000003") is None


def test_the_optimizer_update_waits_for_the_background_copy(tmp_path):
    """48 MB of parameters and Adam state are copied in the background; an update issued
    the instant start() returns must wait for that copy, or the checkpoint would be torn."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)
    optimizer = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.protect(model, [optimizer])
    for _ in range(2):
        model(torch.randn(4, 2048)).sum().backward()
        optimizer.step()
    expected = clone(state_of(model, optimizer))
    assert ckpt.start(state_of(model, optimizer), step=2)
    optimizer.step()  # the gradients are still there: this changes every tensor at once
    assert not torch.equal(model.weight, expected["model"]["weight"])
    assert ckpt.wait(60)
    target_model = torch.nn.Linear(2048, 2048)
    target_optimizer = torch.optim.Adam(target_model.parameters())
    target_model(torch.randn(1, 2048)).sum().backward()
    target_optimizer.step()  # so that the optimizer has state to load into
    target = state_of(target_model, target_optimizer)
    assert ckpt.load_latest(target) == 2
    assert_same(target, expected)


def test_buffers_are_reused_between_saves(tmp_path):
    model, optimizer = tiny_model()
    ckpt = Checkpointer(tmp_path / "ckpt", keep=5)
    ckpt.protect(model, [optimizer])
    train_step(model, optimizer)
    ckpt.save(state_of(model, optimizer), 1)
    first = ckpt._staging._host.tensor.data_ptr()
    staged = ckpt._save.staged
    # One buffer of exactly the staged tensors' bytes (each aligned), not one per tensor.
    tensors = [t for t in state_of(model, optimizer)["model"].values()]
    assert ckpt._staging.host_bytes >= sum(t.numel() * t.element_size() for t in tensors)
    assert ckpt._staging.host_bytes < staged.nbytes + 64 * 64
    assert staged.pinned == 0  # CPU: nothing to pin
    train_step(model, optimizer)
    ckpt.save(state_of(model, optimizer), 2)
    assert ckpt._staging._host.tensor.data_ptr() == first
    assert [s for s, _ in committed_checkpoints(tmp_path / "ckpt")] == [2, 1]


def test_retention_keeps_the_last_k_and_every_nth():
    steps = [10, 20, 30, 40, 50, 60, 70]
    assert sorted(to_delete(steps, keep=2, keep_every=None)) == [10, 20, 30, 40, 50]
    assert sorted(to_delete(steps, keep=2, keep_every=30)) == [10, 20, 40, 50]


def test_young_daly_interval_and_schedules():
    cost, mtbf = 10.0, 24 * 3600.0
    young = math.sqrt(2 * cost * mtbf)
    assert young * 0.99 < daly_interval(cost, mtbf) < young * 1.01  # C << M: Young's formula
    assert daly_interval(cost, 4.0) == 4.0  # a checkpoint dearer than failures: every M
    auto = Schedule(mtbf_hours=1.0)
    # 2 ms of stall, a 0.5 s persist, 20 ms steps: Daly says ~3.8 s, i.e. 190 steps.
    steps = auto.propose(step_time=0.02, cost=0.002, persist=0.5)
    assert 185 <= steps <= 195 and "Young/Daly" in auto.reason
    # The interval never drops below one persist: only one save is in flight.
    assert Schedule(mtbf_hours=1e-6).propose(step_time=0.02, cost=0.002, persist=0.5) == 25
    assert Schedule(every_seconds=2.0).propose(step_time=0.1, cost=None, persist=None) == 20
    fixed = Schedule(every_steps=5)
    assert [s for s in range(1, 16) if fixed.due(s) and fixed.reset(s) is None] == [5, 10, 15]


@pytest.mark.parametrize("direct", [True, False])
def test_checksummed_file_writes_exactly_what_it_was_given(tmp_path, direct):
    """Odd sizes across chunk boundaries; O_DIRECT pads the last block and truncates it."""
    import zlib

    from unbroken.checkpoint.direct_io import CHUNK, ChecksummedFile

    g = torch.Generator().manual_seed(1)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
              for n in (1, 4095, CHUNK - 3, 7, CHUNK + 12345, 100)]
    path = tmp_path / "data.distcp"
    stream = ChecksummedFile(path, direct=direct)
    for piece in pieces:
        assert stream.write(memoryview(piece)) == len(piece)
    assert stream.tell() == sum(map(len, pieces))
    stream.close()
    expected = b"".join(pieces)
    assert path.read_bytes() == expected
    assert stream.crc32 == zlib.crc32(expected)
    if direct:
        assert stream.direct, "O_DIRECT was refused on the test filesystem"


def test_an_unscheduled_checkpointer_proposes_its_interval_unchanged():
    """Saves started by hand (no interval configured) with a known step time."""
    schedule = Schedule()
    assert not schedule.enabled and not schedule.due(10**6)
    assert schedule.propose(step_time=0.5, cost=0.001, persist=1.0) == schedule.interval


def test_parameters_no_optimizer_updates_are_copied_at_once(tmp_path):
    """A momentum encoder's parameters are updated in place by the training step, not by
    the optimizer; the optimizer's pre-hook cannot guard them, so they are copied at once."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"online": torch.nn.Linear(64, 64), "target": torch.nn.Linear(4096, 4096)})
    model["target"].requires_grad_(False)
    optimizer = torch.optim.SGD(model["online"].parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.protect(model, [optimizer])
    expected = model["target"].weight.detach().clone()
    assert ckpt.start({"model": model.state_dict()}, step=1)
    with torch.no_grad():
        model["target"].weight.mul_(0.5).add_(1.0)  # the EMA update, right after start()
    assert ckpt.wait(60)
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    assert ckpt.load_latest(target) == 1
    assert torch.equal(target["model"]["target.weight"], expected)


class _Unpicklable:
    def state_dict(self):
        return {"lock": threading.Lock()}  # cannot be copied into a staged copy


def test_a_copy_that_cannot_be_staged_is_reported_and_training_goes_on(tmp_path):
    model, optimizer = tiny_model()
    events = []
    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda e: events.append((e.event, encode(e))))
    ckpt.protect(model, [optimizer])
    state = {**state_of(model, optimizer), "extra": _Unpicklable().state_dict()}
    assert ckpt.start(state, step=1)  # the failure is reported by the writer, on every rank
    train_step(model, optimizer)  # the optimizer's pre-hook does not wait forever
    assert ckpt.wait(30)
    failed = [kw for name, kw in events if name == "checkpoint_failed"]
    assert failed and "lock" in failed[0]["error"].lower()
    assert ckpt.start(state_of(model, optimizer), step=2) and ckpt.wait(30)  # the next one works
    assert [s for s, _ in committed_checkpoints(tmp_path / "ckpt")] == [2]
