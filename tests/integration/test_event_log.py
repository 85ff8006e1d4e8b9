"""The event log is safe and bounded: a full disk drops (and counts) events but never stops
training; the log rotates past its size bound, safely under concurrent writers; readers read
the rotated files as one log. Real processes and a real full file system, no mocks."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, events_of, finish, start, wait_for

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import (
    EVENTS_FILE,
    EventLog,
    event_files,
    read_events,
)

# Appends N events from its own process once the go-file exists (so that writers overlap).
WRITER = """
import os, sys, time
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EventLog
path, name, n, max_bytes, keep, go = sys.argv[1:]
log = EventLog(path, max_bytes=int(max_bytes), keep=int(keep), source=name)
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.002)
for i in range(int(n)):
    log.emit(Event.STEP, step=i, pad="x" * (i % 40))
log.close()
sys.exit(3 if log.dropped else 0)
"""


DROP_NOTICE = "dropping events and counting them"


DROP_COUNT = re.compile(r"unbroken: (\d+) event\(s\) could not be written to (\S+) \(disk full\?\)")


def _write_concurrently(tmp_path: Path, n: int, max_bytes: int, keep: int,
                        while_writing=lambda procs: None) -> Path:
    """Two writer processes append n events each to one log; the log's path."""
    path = tmp_path / "log" / EVENTS_FILE
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(n),
                               str(max_bytes), str(keep), str(go)], cwd=REPO)
             for name in ("a", "b")]
    try:
        go.touch()
        while_writing(procs)
        for proc in procs:
            assert proc.wait(timeout=120) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return path


def _lines(files: list[Path]) -> list[dict]:
    """Every line of the files, each parsed: a torn or merged line fails the test."""
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_rotation_under_two_concurrent_writers_loses_and_tears_no_line(tmp_path):
    n, max_bytes = 3000, 8192
    snapshots: list[set] = []

    def read_while_writing(procs):  # a reader racing the rotations sees no line twice
        log = tmp_path / "log" / EVENTS_FILE
        wait_for(log.exists, 30, "the log")
        while any(p.poll() is None for p in procs):
            events = read_events(log)
            keys = [(e["source"], e["step"]) for e in events]
            assert len(keys) == len(set(keys))
            snapshots.append(set(keys))

    path = _write_concurrently(tmp_path, n, max_bytes, keep=100_000,
                               while_writing=read_while_writing)
    files = event_files(path.parent)
    rotated = files[:-1]
    assert files[-1] == path and len(rotated) > 20, files  # ~700 KB past an 8 KB bound
    assert [f.name for f in rotated] == [f"{EVENTS_FILE}.{k}" for k in range(len(rotated), 0, -1)]
    lines = _lines(files)
    assert sorted((e["source"], e["step"]) for e in lines) == \
        sorted((s, i) for s in "ab" for i in range(n))  # every line once, none torn
    # Rotated past the bound only. (How far past depends on the scheduler here: the other
    # writer appends while one renames, which is deterministic in the test below.)
    assert all(f.stat().st_size >= max_bytes for f in rotated)
    # Nothing was deleted: a reader racing the renames only ever sees more.
    assert all(a <= b for a, b in zip(snapshots, snapshots[1:], strict=False))
    events = read_events(path)
    assert len(events) == 2 * n
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    for s in "ab":  # each writer's own events keep their order
        assert [e["step"] for e in events if e["source"] == s] == list(range(n))


def test_rotation_keeps_at_most_keep_files(tmp_path):
    n, keep = 2000, 2
    path = _write_concurrently(tmp_path, n, max_bytes=4096, keep=keep)
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == [EVENTS_FILE, f"{EVENTS_FILE}.1", f"{EVENTS_FILE}.2", f"{EVENTS_FILE}.lock"]
    lines = _lines(event_files(path.parent))  # still no torn line
    keys = [(e["source"], e["step"]) for e in lines]
    assert len(keys) == len(set(keys)) and 0 < len(keys) < 2 * n // 10


def test_a_writer_that_exits_without_closing_still_reports_its_drops():
    code = ("from unbroken.telemetry.events import EventLog\n"
            "from unbroken.telemetry.event_names import Event\n"
            "log = EventLog('/dev/full')\n"
            "for i in range(3):\n    log.emit(Event.STEP, step=i)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[-1] == \
        "unbroken: 3 event(s) could not be written to /dev/full (disk full?)"


def test_a_child_forked_while_another_thread_emits_can_emit(tmp_path):
    log = EventLog(tmp_path / EVENTS_FILE, source="worker")
    inside, leave = threading.Event(), threading.Event()

    def emitting():  # holds the log's lock as a thread inside emit does
        with log._lock:
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=emitting)
    thread.start()
    inside.wait(30)
    pid = os.fork()
    if pid == 0:
        log.emit(Event.STEP, step=1)
        os._exit(0)
    leave.set()
    thread.join(30)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child deadlocked on the log's lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert [e["step"] for e in read_events(tmp_path / EVENTS_FILE)] == [1]
    log.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs, unmounted after the test; skipped where it cannot be mounted."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=True)
            raise AssertionError(f"{mnt} was still busy after the test")


def _fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_log_on_a_full_disk_recovers_and_reports_the_count(small_tmpfs, capsys):
    path = small_tmpfs / EVENTS_FILE
    log = EventLog(path, source="worker", rank=0)
    log.emit(Event.STEP, step=0)
    filler = _fill(small_tmpfs)
    for step in range(1, 200):  # the log's last page takes a few, then the disk is full
        log.emit(Event.STEP, step=step, pad="x" * 100)
    assert log.dropped > 150
    filler.unlink()
    log.emit(Event.TRAINING_DONE, step=200)
    dropped = log.dropped
    log.close()
    events = read_events(path)  # a line torn by the full disk is skipped
    assert [e["event"] for e in events][-2:] == ["training_done", "events_dropped"]
    assert events[-1] == {**events[-1], "dropped": dropped, "source": "worker", "rank": 0}
    assert 1 + 199 - dropped == len(events) - 2  # every step not dropped is in the log
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and DROP_NOTICE in err[0], err
    assert DROP_COUNT.fullmatch(err[1])[1] == str(dropped)


def test_a_full_disk_under_the_run_dir_does_not_stop_training(tmp_path, small_tmpfs):
    """A real job whose run dir (event log, heartbeats, secret) fills up while it trains:
    the job trains to its last step and exits 0, and every writer that dropped events says
    how many. Worker output and checkpoints are elsewhere (as they would be on a real job)."""
    run_dir, steps = small_tmpfs, 60
    final = tmp_path / "final.pt"
    # start() writes the agent's output to tmp_path (run_dir's parent), and the workers, not
    # redirected, write to it too. (With --redirects, worker logs go to RUN_DIR/logs: on this
    # full disk the script's own print then fails with ENOSPC, which is the script's fault.)
    proc = start(run_dir, "--nproc-per-node", "2", "--no-warm-restarts", args=[
        *TINY, "--steps", str(steps), "--step-sleep", "0.05", "--final-state", str(final),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "20"])
    try:
        wait_for(lambda: events_of(run_dir, "step"), 120, "the first step")
        before = {e["step"] for e in events_of(run_dir, "step")}
        _fill(run_dir)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise
    result = finish(proc, run_dir, timeout=180)
    assert result.code == 0, result.output
    assert f"step {steps - 1:4d}" in result.output and final.is_file(), result.output
    counts = DROP_COUNT.findall(result.output)
    # The agent (its workers_done and agent_exit at least) and both workers dropped events.
    assert len(counts) == 3 == result.output.count(DROP_NOTICE), result.output
    assert all(int(n) > 0 and where == str(run_dir / EVENTS_FILE) for n, where in counts)
    steps_logged = {e["step"] for e in result.events("step")}
    assert before <= steps_logged and steps - 1 not in steps_logged  # the end was dropped
    assert not result.events("agent_exit")
