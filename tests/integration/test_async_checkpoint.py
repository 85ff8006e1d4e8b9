"""Async checkpoints: a consistent staged copy, a background persist, and every fault it meets.

The in-process tests use real threads, real DCP writes and a real optimizer; the job tests
launch real workers and inflict real faults: a SIGKILL mid-write, a writer that raises, a
writer that stalls, a full filesystem (a small tmpfs), and resharding under FSDP2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest
import torch
from builders import assert_same, state_of, tiny_model, train_step
from conftest import SCRIPTS, events_of, finish, launch, start, wait_for

from unbroken.checkpoint.checkpointer import Checkpointer, committed_checkpoints
from unbroken.checkpoint.interval import Schedule
from unbroken.checkpoint.manifest import verify_manifest
from unbroken.telemetry.schema import encode

CKPT_TRAIN = SCRIPTS / "ckpt_train.py"


@pytest.mark.serial  # measures time: alone, never beside another test
def test_a_deferred_save_is_retried_and_never_waited_for(tmp_path):
    """A save due while the last is still being written is deferred (not waited for) and
    retried after 1, 2, 4, 8 steps."""
    model, optimizer = tiny_model()
    events = []
    slow = {"first": True}

    def stall_first(point, step):
        if point == "persist" and slow.pop("first", False):
            time.sleep(2.0)

    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda e: events.append((e.event, encode(e))),
                        schedule=Schedule(every_steps=10), fault_point=stall_first)
    ckpt.protect(model, [optimizer])
    started, longest = [], 0.0
    for step in range(1, 41):
        t0 = time.monotonic()
        train_step(model, optimizer)
        if ckpt.due(step):
            started.append((step, ckpt.start(state_of(model, optimizer), step)))
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
    assert_same(full[2], full[4])
    assert_same(full[3], full[4])
    assert full[4]["model"]["0.weight"].shape == (7, 6)
    shutil.rmtree(ckpt)


def test_checkpoints_go_on_across_in_place_generations(tmp_path):
    """A worker dies; the survivors shrink, its replacement joins: each generation agrees on
    saves over its own control group, and the replacement writes its part of the last ones."""
    run_dir, ckpt, fast = tmp_path / "run", tmp_path / "ckpt", tmp_path / "fast"
    # Paced until the replacement has joined (on a loaded machine 300 unpaced steps ended
    # first), then at full speed.
    proc = start(run_dir, "--nproc-per-node", "3", "--max-restarts", "2",
                 "--fault", "crash:rank=1,step=8", script=CKPT_TRAIN,
                 args=["--steps", "300", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
                       "--step-sleep", "0.02", "--sleep-until", str(fast)])
    wait_for(lambda: [e for e in events_of(run_dir, "gen_up") if e["world_size"] == 3], 120,
             "the replacement to join")
    fast.touch()
    result = finish(proc, run_dir)
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


def test_a_save_still_writing_when_a_generation_forms_is_abandoned_not_waited_for(tmp_path):
    """Regression (seen in CI): a writer whose collective was queued when a generation
    switch destroyed its group waited out the group's timeout, and every later save, the
    final one included, was deferred behind it. The new generation abandons it."""
    model, optimizer = tiny_model()
    events, release = [], threading.Event()

    def stuck_writer(point, step):
        if step == 1:
            release.wait(60)  # the old generation's writer, blocked

    ckpt = Checkpointer(tmp_path / "ckpt", record=lambda e: events.append((e.event, encode(e))),
                        fault_point=stuck_writer)
    ckpt.protect(model, [optimizer])
    assert ckpt.start(state_of(model, optimizer), step=1)
    assert not ckpt.wait(0.5) and ckpt.in_flight
    ckpt.use_groups(None, None, generation=1)  # what the switch to generation 1 does
    assert not ckpt.in_flight
    (failed,) = [kw for name, kw in events if name == "checkpoint_failed"]
    assert failed["step"] == 1 and "abandoned" in failed["error"]
    train_step(model, optimizer)
    assert ckpt.start(state_of(model, optimizer), step=2) and ckpt.wait(30)  # not deferred
    release.set()  # the old writer ends; its outcome was already reported, and is not again
    time.sleep(0.5)
    assert [name for name, _ in events].count("checkpoint_failed") == 1
    assert 2 in [s for s, _ in committed_checkpoints(tmp_path / "ckpt")]
