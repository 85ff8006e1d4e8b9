"""Watching an unchanged script (`runtime/watch/`): where its steps end (the clock, pure),
the hooks on a real optimizer, GradScaler and torch.save in this process, and the
accounting of its events (`telemetry/watched_steps.py`): resume steps by file identity,
who pays for a save, redone steps. No processes."""

from __future__ import annotations

import io
import json

import pytest
import torch

from unbroken.runtime.watch import hooks, watcher
from unbroken.runtime.watch.clock import StepClock
from unbroken.telemetry.categories import Category
from unbroken.telemetry.events import EventLog
from unbroken.telemetry.goodput import account
from unbroken.telemetry.watched_steps import resume_steps

C = Category


# ---------------------------------------------------------------- the clock (pure)
def test_a_step_ends_at_the_next_backward_after_its_update():
    c = StepClock()
    assert c.backward(1.0, 0.5) is None and c.before_update(7) is None
    c.after_update(7, 1.4)
    done = c.backward(2.0, 0.4)
    assert (done.step, done.began, done.ended, done.updated, done.loss) == (1, 1.0, 1.4, True, 0.5)
    c.after_update(7, 2.3)
    assert c.finish().began == 1.4  # the next step begins where the last one ended


def test_gradient_accumulation_is_one_step_and_two_optimizers_step_once_each():
    c = StepClock()
    for t in (1.0, 1.1, 1.2):  # three micro-batches
        assert c.backward(t, None) is None
    assert c.before_update(1) is None
    c.after_update(1, 1.3)
    assert c.before_update(2) is None  # a second optimizer in the same step: not a new step
    c.after_update(2, 1.35)
    done = c.before_update(1)  # the first steps again, with no backward between: a new step
    assert (done.step, done.ended) == (1, 1.35)


def test_a_skipped_update_ends_at_the_scalers_update_as_a_step_without_one():
    c = StepClock()
    c.backward(1.0, None)
    done = c.scaler_update(1.2)  # no optimizer stepped: the scaler skipped it
    assert (done.step, done.updated, done.ended) == (1, False, 1.2)
    c.backward(1.3, None)
    c.after_update(3, 1.5)
    assert c.scaler_update(1.55) is None  # it did update: the step ends at the next backward


# ---------------------------------------------------------------- the hooks, in process
@pytest.fixture
def watch(tmp_path, monkeypatch):
    hooks.arm()
    log = EventLog(tmp_path / "events.jsonl", source="worker", node=0, rank=0, attempt=0,
                   slot=0)
    w = watcher.Watch(log)
    monkeypatch.setattr(watcher, "_active", w)
    yield w, tmp_path / "events.jsonl"
    log.close()


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_real_loop_is_clocked_and_its_torch_save_timed_with_the_files_identity(watch):
    w, path = watch
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = path.parent / "ckpt.pt"
    for step in range(3):
        model(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            torch.save(model.state_dict(), target)
    torch.save(model.state_dict(), io.BytesIO())  # a stream: no path, no identity
    w.finish()
    got = _records(path)
    steps = [s for e in got if e["event"] == "script_steps" for s in e["steps"]]
    assert [s[0] for s in steps] == [1, 2, 3] and all(s[3] == 1 for s in steps)
    assert all(isinstance(s[4], float) for s in steps)  # a CPU loss: read without a sync
    saves = [e for e in got if e["event"] == "script_save"]
    assert [(e["call"], e["step"]) for e in saves] == [("torch.save", 2), ("torch.save", 3)]
    st = target.stat()
    assert saves[0]["files"] == [[st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]]
    assert saves[0]["path"] == str(target) and saves[0]["bytes"] == st.st_size
    assert saves[1]["path"] is None and saves[1]["files"] == []
    # The step the save followed was written before the save: a kill after it loses none.
    order = [e["event"] for e in got]
    assert order.index("script_save") > order.index("script_steps")


def test_a_save_inside_a_save_counts_once_as_the_outermost(watch):
    w, path = watch
    from unbroken.runtime.watch.calls import Call, Op

    outer = Call("x", "y", Op.SAVE, "Trainer._save_checkpoint")
    assert w.enter(outer, None)
    torch.save({"a": torch.zeros(2)}, path.parent / "inner.pt")
    w.leave(True)
    (save,) = [e for e in _records(path) if e["event"] == "script_save"]
    assert save["call"] == "Trainer._save_checkpoint" and len(save["files"]) == 1


def test_a_hook_that_fails_turns_itself_off_and_the_script_goes_on(watch, monkeypatch, capsys):
    w, path = watch

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(w.clock, "after_update", broken)
    monkeypatch.setattr(hooks, "_off", set())
    monkeypatch.setattr(hooks, "failed", [])
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()  # never raises into the script
    assert "optimizer.step" in hooks._off and hooks.failed[0].startswith("optimizer.step")
    assert capsys.readouterr().err.count("stopped watching optimizer.step") == 1


# ---------------------------------------------------------------- the accounting (pure)
F = [1, 2, 300, 5]  # a file's identity: dev, inode, size, mtime_ns


def _w(t, event, attempt, slot, **kw):
    return {"t": t, "event": event, "source": "worker", "node": 0, "rank": slot,
            "slot": slot, "attempt": attempt, **kw}


def _run(load_files):
    """Two ranks, 10 steps of 1 s from t=10; rank 0 saves after step 4 (0.5 s, the file F);
    a crash at t=18.5; attempt 1 loads `load_files` and runs 6 steps from t=30."""
    ev = [{"t": 0.0, "event": "agent_start", "source": "agent", "node": 0},
          {"t": 9.0, "event": "workers_started", "source": "agent", "node": 0, "attempt": 0,
           "pids": {"0": 1, "1": 2}}]
    for slot in (0, 1):
        ev.append(_w(9.5, "script_watched", 0, slot, pid=1, startup=0.4, hooks=[], failed=[]))
        for i in range(1, 9):
            ev.append(_w(10 + i, "script_steps", 0, slot, steps=[[i, 9.0 + i, 10.0 + i, 1,
                                                                 None]]))
    ev.append(_w(14.6, "script_save", 0, 0, call="torch.save", path="/c", bytes=300,
                 duration=0.5, step=4, files=[F]))
    ev.append({"t": 18.5, "event": "fault", "source": "agent", "node": 0, "attempt": 0,
               "kind": "crash", "rank": 1, "pid": 2})
    ev.append({"t": 28.0, "event": "workers_started", "source": "agent", "node": 0,
               "attempt": 1, "pids": {"0": 3, "1": 4}})
    for slot in (0, 1):
        ev.append(_w(29.0, "script_watched", 1, slot, pid=3, startup=0.5, hooks=[], failed=[]))
        ev.append(_w(29.5, "script_load", 1, slot, call="torch.load", path="/c", bytes=300,
                     duration=0.3, step=0, files=load_files))
        for i in range(1, 7):
            ev.append(_w(30 + i, "script_steps", 1, slot, steps=[[i, 29.0 + i, 30.0 + i, 1,
                                                                 None]]))
    ev += [{"t": 37.0, "event": "workers_done", "source": "agent", "node": 0, "attempt": 1},
           {"t": 37.5, "event": "agent_exit", "source": "agent", "node": 0, "code": 0}]
    return sorted(ev, key=lambda e: e["t"])


def test_the_restart_resumes_from_the_save_whose_file_it_loaded_and_the_steps_after_are_redone():
    r = account(_run([F]))
    assert r["steps_known"] and r["watched"]["resumed_from"] == {"1": 4}
    redone = sorted({s["step"] for s in r["steps"] if s["redone"]})
    assert redone == [5, 6, 7, 8]  # computed in attempt 0 after the save, again in 1
    kept = sorted(s["step"] for s in r["steps"] if s["slot"] == 0 and not s["redone"])
    assert kept == list(range(1, 11))
    by_slot = {x["slot"]: x["seconds"] for x in r["ranks"]}
    # 4 steps and the 0.5 s the crash cut short; on rank 0, the save inside step 5 is the save's
    assert by_slot[1][C.WASTED_PROGRESS] == pytest.approx(4.0 + 0.5)
    assert by_slot[0][C.WASTED_PROGRESS] == pytest.approx(4.0 + 0.5 - 0.5)
    for s in by_slot.values():
        assert s[C.CHECKPOINT_RESTORE] == pytest.approx(0.3) and s[C.UNTRACKED] == 0
    assert by_slot[0][C.CHECKPOINT_SAVE] == pytest.approx(0.5)  # the call
    assert by_slot[1][C.CHECKPOINT_SAVE] == 0  # its step after the save was no longer


def test_a_load_that_matches_no_save_leaves_the_resume_step_unknown_and_says_so():
    r = account(_run([[9, 9, 9, 9]]))
    assert r["watched"]["resumed_from"] == {"1": None}
    assert "resume step unknown in attempt(s) 1" in r["watched"]["notes"][0]
    assert not any(s["redone"] for s in r["steps"])  # never matched to attempt 0's


def test_a_waiting_rank_pays_the_excess_of_its_step_after_the_save_at_most_the_saves_time():
    ev = _run([F])
    for e in ev:  # rank 1's step 5 took 1.8 s: 0.8 s beyond its median, 0.5 s of it the save
        if e["event"] == "script_steps" and e["slot"] == 1 and e["attempt"] == 0 \
                and e["steps"][0][0] == 5:
            e["steps"] = [[5, 13.2, 15.0, 1, None]]
    r = account(ev)
    by_slot = {x["slot"]: x["seconds"] for x in r["ranks"]}
    assert by_slot[1][C.CHECKPOINT_SAVE] == pytest.approx(0.5)


def test_no_load_means_the_attempt_started_again_from_step_zero():
    events = [e for e in _run([F]) if e["event"] != "script_load"]
    from unbroken.telemetry.schema import decode_all

    assert resume_steps(decode_all(events)) == {1: 0}


def test_a_name_bound_by_from_import_after_arming_is_the_watched_call():
    """Libraries bind the functions at their own import (`from safetensors.torch import
    save_file`, as transformers does): armed first, they bind the wrapped one."""
    pytest.importorskip("safetensors")
    hooks.arm()
    from safetensors.torch import load_file, save_file

    assert getattr(save_file, hooks.MARK) and getattr(load_file, hooks.MARK)
    assert getattr(torch.save, hooks.MARK) and getattr(torch.autograd.backward, hooks.MARK)
    assert {"safetensors.torch.save_file", "optimizer.step", "backward"} <= set(hooks.installed)


def test_the_live_status_counts_an_unchanged_scripts_steps():
    from unbroken.telemetry.live import LiveStats, status_line

    stats = LiveStats()
    stats.fold(_w(1.0, "script_watched", 0, 0, pid=1, startup=0.5, hooks=[], failed=[]))
    for i in range(1, 4):
        obs = stats.fold(_w(1.0 + i, "script_steps", 0, 0,
                            steps=[[i, 0.5 + i, 1.0 + i, 1, None]]))
        assert [v for _, v in obs] == [1, pytest.approx(0.5)]  # a step, and its duration
    stats.fold(_w(4.5, "script_steps", 0, 1, steps=[[3, 3.5, 4.0, 1, None]]))  # another rank
    assert (stats.step, stats.steps) == (3, 3)
    assert status_line(stats, None).startswith("status: step 3, 1.0 steps/s")


def test_a_wait_on_an_asynchronous_saves_future_is_timed_with_the_saves_files(watch):
    """What `dcp.async_save` returns: the script's `result()` on it is a stall, and the
    save's files, read when the wait ends, let a later load find it."""
    from concurrent.futures import Future

    from unbroken.runtime.watch.calls import Call, Op

    w, path = watch
    target = path.parent / "ckpt"
    call = Call("x", "async_save", Op.SAVE, "torch.distributed.checkpoint.async_save",
                None, "checkpoint_id", ".metadata", returns_future=True)
    future: Future = Future()
    assert w.enter(call, str(target))
    w.leave(True)
    w.waits_on(future, call, str(target), w.last_step)
    target.mkdir()
    (target / ".metadata").write_bytes(b"m")
    future.set_result(None)
    assert future.result() is None
    wait = [e for e in _records(path) if e["event"] == "script_save_wait"]
    st = (target / ".metadata").stat()
    assert len(wait) == 1 and wait[0]["files"] == [[st.st_dev, st.st_ino, st.st_size,
                                                    st.st_mtime_ns]]
    save = [e for e in _records(path) if e["event"] == "script_save"]
    assert save[0]["files"] == []  # nothing written when the call returned


def test_a_script_that_makes_a_run_is_not_clocked_by_the_hooks(watch):
    """`Run` mutes the step hooks: its own steps are the run's, and the hooks cost nothing."""
    w, path = watch
    w.mute_steps()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    w.finish()
    assert w.clock.steps == 0 and w.clock.began is None
    assert not [e for e in _records(path) if e["event"] == "script_steps"]
