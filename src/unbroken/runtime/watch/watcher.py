"""The worker's watch on its script: the `script_*` events, from what the hooks see.

One `Watch` per worker process at most (`start`), made by the bootstrap before the script
runs; the hooks (`hooks.py`, armed earlier and inherited across the fork server's forks)
call the module-level `active()` one, and do nothing while there is none. Its methods are
called from the script's threads: a save may be made from a thread of the script's own.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.control.worker_env import Role, WorkerEnv
from unbroken.runtime.host import process_start_time
from unbroken.runtime.watch.calls import Call, Op
from unbroken.runtime.watch.clock import Ended, StepClock
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EVENTS_FILE, EventLog


@dataclass
class Frame:
    """An outermost save or load in progress on one thread."""

    call: Call
    path: str | None
    began: float
    step: int
    files: list[list[int]] = field(default_factory=list)


def identity(path: str) -> list[int] | None:
    """What identifies a file across a rename: `[st_dev, st_ino, st_size, st_mtime_ns]`."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


class Watch:
    """Writes the script's steps, saves and loads to the run's event log."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.clock = StepClock()
        self.steps_muted = False
        self.last_step = 0  # the step of the last outermost save or load
        self._frames = threading.local()

    # --- steps (main thread) ---

    def ended(self, done: Ended | None) -> None:
        """A step the clock closed: written at once, one short line (`emit_encoded`: about
        5 µs), so that a SIGKILL loses no step but the open one."""
        if done is None or self.steps_muted:
            return
        loss = done.loss
        shown = repr(float(loss)) if loss is not None and math.isfinite(loss) else "null"
        self.log.emit_encoded(Event.SCRIPT_STEPS, f'"steps":[[{done.step},{done.began:.6f},'
                                                  f'{done.ended:.6f},{int(done.updated)},{shown}]]')

    def mute_steps(self) -> None:
        """The script made a `Run`, which reports its own steps: ours would count them twice."""
        self.steps_muted = True

    # --- saves and loads ---

    def enter(self, call: Call, path: str | None) -> bool:
        """A watched call begins; True if it is the outermost on this thread."""
        stack = self._stack()
        if not stack and threading.current_thread() is threading.main_thread():
            # A save or load after an update ends the step: written with the save, so that a
            # kill after it cannot lose the step the checkpoint holds.
            self.ended(self.clock.finish())
        done = self.clock.steps + bool(self.clock.stepped)  # updates made, the open step's too
        stack.append(Frame(call, path, time.perf_counter(), done))
        return len(stack) == 1

    def leave(self, ok: bool) -> None:
        """The watched call begun last on this thread returned (or raised: `ok` False, and
        the outermost is then not written: nothing was saved or loaded)."""
        stack = self._stack()
        frame = stack.pop()
        seconds = time.perf_counter() - frame.began
        if frame.path is not None:
            marker = frame.call.directory_marker
            found = identity(os.path.join(frame.path, marker) if marker and
                             os.path.isdir(frame.path) else frame.path)
            if found is not None:
                (stack[0] if stack else frame).files.append(found)
        if stack or not ok:
            return
        self.last_step = frame.step
        size = _size(frame.path) if frame.path is not None else None
        body = ev.ScriptSave if frame.call.op == Op.SAVE else ev.ScriptLoad
        self.log.emit(body(call=frame.call.name, path=frame.path, bytes=size,
                           duration=round(seconds, 6), step=frame.step, files=frame.files))

    def waits_on(self, future: Any, call: Call, path: str | None, step: int) -> None:
        """Time the script's waits on an asynchronous save's `future` (and on the futures
        an `AsyncSaveResponse` holds): each `result()` that waited is a `script_save_wait`."""
        futures = [future] if callable(getattr(future, "result", None)) else [
            f for f in (getattr(future, "staging_completion", None),
                        getattr(future, "upload_completion", None))
            if callable(getattr(f, "result", None))]
        for f in futures:
            original = f.result

            def result(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                out = _original(*args, **kwargs)
                waited = time.perf_counter() - t0
                marker = call.directory_marker
                found = None if path is None else identity(
                    os.path.join(path, marker) if marker and os.path.isdir(path) else path)
                self.log.emit(ev.ScriptSaveWait(call=call.name, path=path,
                                                duration=round(waited, 6), step=step,
                                                files=[found] if found else []))
                return out

            f.result = result  # this future only: the class is torch's

    def inside_ours(self) -> bool:
        """A call made inside a save or load of unbroken's own (`ours`)."""
        return getattr(self._frames, "ours", 0) > 0

    @contextmanager
    def ours(self) -> Iterator[None]:
        """unbroken's own save or load runs: the library calls inside it are not the script's."""
        self._frames.ours = getattr(self._frames, "ours", 0) + 1
        try:
            yield
        finally:
            self._frames.ours -= 1

    def _stack(self) -> list[Frame]:
        stack = getattr(self._frames, "stack", None)
        if stack is None:
            stack = self._frames.stack = []
        return stack

    def finish(self) -> None:
        """The script returned: its open step, if it updated."""
        self.ended(self.clock.finish())


def _size(path: str) -> int | None:
    try:
        p = Path(path)
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        return p.stat().st_size
    except OSError:
        return None


_active: Watch | None = None


def active() -> Watch | None:
    return _active


def wanted(env: WorkerEnv) -> bool:
    """A worker under `unbroken run` (not a spare), integrations not turned off."""
    return (env.control is not None and env.integrations and env.run_dir is not None
            and env.role == Role.WORKER)


def start(hooks: list[str], failed: list[str]) -> Watch | None:
    """Begin watching this process's script, if `wanted`: its first line says what is
    watched (`script_watched`)."""
    global _active
    env = WorkerEnv.from_environ()
    if not wanted(env):
        return None
    log = EventLog(Path(env.run_dir) / EVENTS_FILE, source="worker", node=env.node_rank,
                   rank=env.rank, attempt=env.attempt)
    log.context["slot"] = env.slot if env.slot is not None else env.rank
    log.shared = True  # a `Run` the script makes writes to it too (`shared_log`)
    started = process_start_time()
    log.emit(ev.ScriptWatched(pid=os.getpid(),
                              startup=round(time.time() - started, 6) if started else None,
                              hooks=hooks, failed=failed))
    _active = Watch(log)
    return _active


def finish() -> None:
    """The script ended (returned or raised): what is queued is written."""
    watch = _active
    if watch is not None:
        try:
            watch.finish()
        except Exception as exc:  # noqa: BLE001 - never in the way of the script's exit
            print(f"unbroken: the script's last steps were not recorded: {exc}",
                  file=sys.stderr)


def shared_log() -> EventLog | None:
    """The worker's event log, where the watch opened it: a `Run` writes to the same one
    (one file descriptor, one count of dropped events per worker)."""
    return _active.log if _active is not None else None


def mute_steps() -> None:
    """Called by `Run`: a script that reports its own steps is not clocked by the hooks."""
    if _active is not None:
        _active.mute_steps()
