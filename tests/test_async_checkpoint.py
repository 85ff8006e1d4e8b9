"""Async checkpoints: a consistent snapshot, a background persist, and every fault it meets.

The in-process tests use real threads, real DCP writes and a real optimizer; the job tests
launch real workers and inflict real faults: a SIGKILL mid-write, a writer that raises, a
writer that stalls, a full filesystem (a small tmpfs), and resharding under FSDP2.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch
from conftest import SCRIPTS, events_of, finish, launch, start, wait_for

from unbroken.checkpoint.checkpointer import Checkpointer, committed_checkpoints
from unbroken.checkpoint.interval import Schedule, daly_interval
from unbroken.checkpoint.layout import to_delete
from unbroken.checkpoint.manifest import verify_manifest

CKPT_TRAIN = SCRIPTS / "ckpt_train.py"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def _train_step(model, optimizer) -> None:
    model(torch.randn(32, 8)).pow(2).mean().backward()  # also moves BatchNorm's statistics
    optimizer.step()
    optimizer.zero_grad()


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, [optimizer])
    return {"model": model_sd, "optim": optim_sd}


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a} != {b}"


def test_snapshot_is_the_state_at_start_even_as_training_goes_on(tmp_path):
    """The optimizer update right after start() waits for the copy; BatchNorm statistics
    changed by the next forward are not in the checkpoint; the learning rate a scheduler
    changes afterwards is not either."""
    model, optimizer = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    events = []
    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda name, **kw: events.append((name, kw)))
    ckpt.protect(model, [optimizer])
    for _ in range(3):
        _train_step(model, optimizer)
    expected = _clone(_state(model, optimizer))
    assert ckpt.start(_state(model, optimizer), step=3)
    for _ in range(3):  # training goes on at once, while the copy and the write happen
        _train_step(model, optimizer)
        scheduler.step()
    assert ckpt.wait(60)
    moved = _state(model, optimizer)
    assert not torch.equal(moved["model"]["0.weight"], expected["model"]["0.weight"])
    fresh_model, fresh_optimizer = _model()
    torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1)  # adds initial_lr, as above
    target = _state(fresh_model, fresh_optimizer)
    assert ckpt.load_latest(target) == 3
    _assert_same(target["model"], expected["model"])
    _assert_same(target["optim"], expected["optim"])
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
    expected = _clone(_state(model, optimizer))
    assert ckpt.start(_state(model, optimizer), step=2)
    optimizer.step()  # the gradients are still there: this changes every tensor at once
    assert not torch.equal(model.weight, expected["model"]["weight"])
    assert ckpt.wait(60)
    target_model = torch.nn.Linear(2048, 2048)
    target_optimizer = torch.optim.Adam(target_model.parameters())
    target_model(torch.randn(1, 2048)).sum().backward()
    target_optimizer.step()  # so that the optimizer has state to load into
    target = _state(target_model, target_optimizer)
    assert ckpt.load_latest(target) == 2
    _assert_same(target, expected)


def test_buffers_are_reused_between_saves(tmp_path):
    model, optimizer = _model()
    ckpt = Checkpointer(tmp_path / "ckpt", keep=5)
    ckpt.protect(model, [optimizer])
    _train_step(model, optimizer)
    ckpt.save(_state(model, optimizer), 1)
    first = {k: v.data_ptr() for k, v in ckpt._snapshot._buffers.items()}
    _train_step(model, optimizer)
    ckpt.save(_state(model, optimizer), 2)
    assert {k: v.data_ptr() for k, v in ckpt._snapshot._buffers.items()} == first
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


def test_a_deferred_save_is_retried_and_never_waited_for(tmp_path):
    """A save due while the last is still being written is deferred (not waited for) and
    retried after 1, 2, 4, 8 steps."""
    model, optimizer = _model()
    events = []
    slow = {"first": True}

    def stall_first(point, step):
        if point == "persist" and slow.pop("first", False):
            time.sleep(2.0)

    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda name, **kw: events.append((name, kw)),
                        schedule=Schedule(every_steps=10), fault_point=stall_first)
    ckpt.protect(model, [optimizer])
    started, longest = [], 0.0
    for step in range(1, 41):
        t0 = time.monotonic()
        _train_step(model, optimizer)
        if ckpt.due(step):
            started.append((step, ckpt.start(_state(model, optimizer), step)))
        time.sleep(0.02)
        longest = max(longest, time.monotonic() - t0)
    assert ckpt.wait(30)
    assert started[0] == (10, True)
    assert [s for s, ok in started if not ok][:5] == [20, 21, 23, 27, 35]
    assert [kw["step"] for name, kw in events if name == "checkpoint_deferred"][:5] == [20, 21, 23, 27, 35]
    assert longest < 1.0, f"a step took {longest:.2f} s: the loop waited for the slow writer"
    saved = [kw["step"] for name, kw in events if name == "checkpoint_saved"]
    assert saved[0] == 10


def _job(tmp_path, *flags, steps=40, every=5, extra=(), nproc=2, **kw):
    ckpt = tmp_path / "ckpt"
    args = ["--steps", str(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every),
            *extra]
    return launch(tmp_path / "run", "--nproc-per-node", str(nproc), *flags, script=CKPT_TRAIN,
                  args=args, **kw), ckpt


@pytest.mark.parametrize("on_fault", ["restart", "shrink"])
def test_worker_killed_mid_write_leaves_the_previous_checkpoint_latest(tmp_path, on_fault):
    """Rank 1 is SIGKILLed after writing its files of a checkpoint, before the commit."""
    result, ckpt = _job(tmp_path, "--max-restarts", "2", "--on-fault", on_fault,
                        "--fault", "crash:rank=1,step=10,at=persist",
                        extra=["--step-sleep", "0.01"])
    assert result.code == 0, result.output
    fault = result.events("fault")[0]
    torn = result.events("fault_injected")[0]["step"]
    committed_before = [e["step"] for e in result.events("checkpoint_saved")
                        if e["rank"] == 0 and e["t"] < fault["t"]]
    assert committed_before and torn not in committed_before and max(committed_before) < torn
    if on_fault == "restart":
        # The restart loads the newest committed checkpoint: the one before the torn save.
        loaded = result.events("checkpoint_loaded")
        assert loaded and loaded[0]["step"] == max(committed_before)
        assert not result.events("checkpoint_invalid"), "a torn save was considered"
    else:
        # Survivors go on in place: their half of the save fails, later ones commit.
        failed = [e for e in result.events("checkpoint_failed") if e["slot"] == 0]
        assert failed and failed[0]["step"] == torn
        assert any(e["step"] > torn for e in result.events("checkpoint_saved"))
    newest = committed_checkpoints(ckpt)
    assert newest[0][0] == 40 and verify_manifest(newest[0][1]) is None
    assert not list(ckpt.glob(".tmp-*")), "a torn save was left behind"


def test_a_writer_that_dies_is_reported_and_training_goes_on(tmp_path):
    # Steps slow enough for the saves to keep up: on a loaded machine, unpaced training
    # outran its writes and the failing save was the final one, leaving none after it.
    result, ckpt = _job(tmp_path, "--fault", "exception:rank=1,step=10,at=persist",
                        extra=["--step-sleep", "0.05"])
    assert result.code == 0, result.output
    assert not result.events("fault") and not result.events("restart")
    failed = result.events("checkpoint_failed")
    assert {e["rank"] for e in failed} == {0, 1}  # both ranks know nothing was committed
    assert all("rank 1" in e["error"] and "InjectedFault" in e["error"] for e in failed)
    torn = failed[0]["step"]
    assert torn not in [s for s, _ in committed_checkpoints(ckpt)]
    later = [e["step"] for e in result.events("checkpoint_saved") if e["rank"] == 0]
    assert any(s > torn for s in later), "no checkpoint after the failed one"
    assert len({e["step"] for e in result.events("step")}) == 40


def test_a_stuck_writer_never_stalls_training(tmp_path):
    """Rank 1's writer stalls for 4 s; training goes on, saves are deferred, the stall is
    reported as stuck after the 1 s checkpoint timeout, and the save commits in the end."""
    result, ckpt = _job(tmp_path, "--fault", "slow:rank=1,step=5,seconds=4,at=persist",
                        steps=500, extra=["--checkpoint-timeout", "1", "--step-sleep", "0.005"])
    assert result.code == 0, result.output
    injected = result.events("fault_injected")[0]
    during = [e for e in result.events("step") if injected["t"] < e["t"] < injected["t"] + 3.5]
    assert len(during) > 40, f"training stalled with the writer: {len(during)} steps in 3.5 s"
    assert result.events("checkpoint_deferred")
    stuck = result.events("checkpoint_stuck")
    assert stuck and stuck[0]["step"] == injected["step"]
    saved = [e["step"] for e in result.events("checkpoint_saved") if e["rank"] == 0]
    assert injected["step"] in saved and saved[-1] == 500


def _mount_tmpfs(path, size: str) -> None:
    path.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def test_a_full_disk_keeps_training_and_the_next_save_succeeds(tmp_path):
    ckpt = tmp_path / "ckpt"
    _mount_tmpfs(ckpt, "1m")
    try:
        filler = ckpt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to the last byte
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        args = ["--steps", "400", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10",
                "--step-sleep", "0.01"]
        proc = start(tmp_path / "run", "--nproc-per-node", "2", script=CKPT_TRAIN, args=args)
        failed = wait_for(lambda: events_of(tmp_path / "run", "checkpoint_failed"), 120,
                          "a checkpoint to fail on the full disk")
        filler.unlink()  # space again
        result = finish(proc, tmp_path / "run")
        assert result.code == 0, result.output
        assert "No space left on device" in failed[0]["error"]
        assert not result.events("fault")
        saved = [e["step"] for e in result.events("checkpoint_saved") if e["rank"] == 0]
        assert saved and saved[-1] == 400 and min(saved) > failed[0]["step"]
        assert len({e["step"] for e in result.events("step")}) == 400
        assert not list(ckpt.glob(".tmp-*")), "a failed save was left filling the disk"
        assert verify_manifest(committed_checkpoints(ckpt)[0][1]) is None
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)


def test_fsdp2_checkpoint_reshards_from_4_ranks_to_2_and_3(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--fsdp", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    full = {}
    for n in (4, 2, 3):
        out = tmp_path / f"full{n}.pt"
        result = launch(tmp_path / f"run{n}", "--nproc-per-node", str(n), script=CKPT_TRAIN,
                        args=["--steps", "6", "--full-state", str(out), *common], timeout=300)
        assert result.code == 0, result.output
        full[n] = torch.load(out, weights_only=True)
        if n != 4:  # loaded the 4-rank checkpoint, ran no step, saved nothing new
            assert [e["step"] for e in result.events("checkpoint_loaded")] == [6] * n
            assert not result.events("step") and not result.events("checkpoint_saved")
    saved = committed_checkpoints(ckpt)[0][1]
    assert len(list(saved.glob("__*_*.distcp"))) == 4  # one shard file per rank of the 4
    # Uneven shards: 7 rows over 3 ranks. Every tensor identical after resharding.
    _assert_same(full[2], full[4])
    _assert_same(full[3], full[4])
    assert full[4]["model"]["0.weight"].shape == (7, 6)
    shutil.rmtree(ckpt)


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


def test_checkpoints_go_on_across_in_place_generations(tmp_path):
    """A worker dies; the survivors shrink, its replacement joins: each generation agrees on
    saves over its own control group, and the replacement writes its part of the last ones."""
    result, ckpt = _job(tmp_path, "--max-restarts", "2", "--fault", "crash:rank=1,step=8",
                        steps=300, extra=["--step-sleep", "0.02"], nproc=3)
    assert result.code == 0, result.output
    ups = result.events("gen_up")
    assert len(ups) >= 2 and ups[-1]["world_size"] == 3, ups  # shrunk, then grown back
    last_up = ups[-1]["t"]
    after = [e for e in result.events("checkpoint_saved") if e["t"] > last_up]
    assert after, "no checkpoint after the replacement joined"
    final = [e for e in after if e["step"] == 300]
    assert {e["slot"] for e in final} == {0, 1, 2}  # the replacement took part
    assert not [e for e in result.events("checkpoint_failed") if e["t"] > last_up]
    assert verify_manifest(committed_checkpoints(ckpt)[0][1]) is None


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
        return {"lock": threading.Lock()}  # cannot be copied into a snapshot


def test_a_snapshot_that_cannot_be_taken_is_reported_and_training_goes_on(tmp_path):
    model, optimizer = _model()
    events = []
    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda name, **kw: events.append((name, kw)))
    ckpt.protect(model, [optimizer])
    state = {**_state(model, optimizer), "extra": _Unpicklable().state_dict()}
    assert ckpt.start(state, step=1)  # the failure is reported by the writer, on every rank
    _train_step(model, optimizer)  # the optimizer's pre-hook does not wait forever
    assert ckpt.wait(30)
    failed = [kw for name, kw in events if name == "checkpoint_failed"]
    assert failed and "lock" in failed[0]["error"].lower()
    assert ckpt.start(_state(model, optimizer), step=2) and ckpt.wait(30)  # the next one works
    assert [s for s, _ in committed_checkpoints(tmp_path / "ckpt")] == [2]


def test_a_save_still_writing_when_a_generation_forms_is_abandoned_not_waited_for(tmp_path):
    """Regression (seen in CI): a writer whose collective was queued when a generation
    switch destroyed its group waited out the group's timeout, and every later save, the
    final one included, was deferred behind it. The new generation abandons it."""
    model, optimizer = _model()
    events, release = [], threading.Event()

    def stuck_writer(point, step):
        if step == 1:
            release.wait(60)  # the old generation's writer, blocked

    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda name, **kw: events.append((name, kw)),
                        fault_point=stuck_writer)
    ckpt.protect(model, [optimizer])
    assert ckpt.start(_state(model, optimizer), step=1)
    assert not ckpt.wait(0.5) and ckpt.in_flight
    ckpt.use_groups(None, None, generation=1)  # what the switch to generation 1 does
    assert not ckpt.in_flight
    (failed,) = [kw for name, kw in events if name == "checkpoint_failed"]
    assert failed["step"] == 1 and "abandoned" in failed["error"]
    _train_step(model, optimizer)
    assert ckpt.start(_state(model, optimizer), step=2) and ckpt.wait(30)  # not deferred
    release.set()  # the old writer ends; its outcome was already reported, and is not again
    time.sleep(0.5)
    assert [name for name, _ in events].count("checkpoint_failed") == 1
    assert 2 in [s for s, _ in committed_checkpoints(tmp_path / "ckpt")]
