"""A worker's watchdog thread: proves the process runs, and aborts a generation on notice.

Every `period` seconds it
- ticks the heartbeat page's `alive` field: a stopped process (SIGSTOP, a frozen host) stops
  ticking, a process blocked in a collective does not, which is how the leader tells the
  culprit of a hang from the ranks waiting for it (`launch/planning/culprit.py`);
- reads the switch target its agent mirrors from the leader. If the leader has broken the
  worker's generation (a member died, hung or was cut off: the target names a newer
  generation, to be left at once, `LEAVE_NOW`) while the main thread is inside a step, it
  aborts the generation's groups (`AbortableGroups.interrupt`). A planned switch (a
  grow-back, a drain: a step number) is made at that step boundary, never aborted. A collective
  blocked on a peer that will never answer then fails at once, and the main thread leaves by
  the normal path (a peer error), instead of waiting for a socket that never closes;
- dumps torch's flight recorder (where the user turned it on) before such an abort, and when
  its agent asks, before the agent kills a rank blamed for a hang
  (`runtime/generations/flight_recorder.py`).

The contract with the main thread (the engine's step transaction): it calls `entered(gen, step)` before a step's
body and `left()` after the step's last collective (its checkpoint decision included). The
watchdog only aborts between the two, under the same lock, so it never aborts groups being
formed or a step already over; at the next boundary the main thread sees the due switch and
leaves anyway. Each generation is aborted at most once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from unbroken.runtime.generations.flight_recorder import FlightRecorder
from unbroken.runtime.heartbeat import LEAVE_NOW, HeartbeatWriter
from unbroken.telemetry import schema as ev


class Watchdog:
    def __init__(self, heartbeat: HeartbeatWriter, interrupt: Callable[[], None],
                 on_abort: Callable[[int, int, int], None], period: float = 0.05,
                 dump: Callable[[str], object] = lambda reason: None) -> None:
        """`interrupt()` aborts the current generation's groups without tearing them down;
        `on_abort(gen, target_gen, step)` records that it did (called outside the lock);
        `dump(reason)` dumps the flight recorder (`FlightRecorder.dump`)."""
        self._heartbeat = heartbeat
        self._dump = dump
        self._dumped_gen = -1
        self._dump_lock = threading.Lock()
        self._interrupt = interrupt
        self._on_abort = on_abort
        self.period = period
        self._lock = threading.Lock()
        self._inside: tuple[int, int] | None = None  # (generation, step) of the running step
        self._aborted_gen = -1
        self._stop = threading.Event()
        self.errors: list[str] = []  # what failed in the thread (it goes on ticking)
        self._thread = threading.Thread(target=self._run, name="unbroken-watchdog", daemon=True)

    def start(self) -> None:
        self._heartbeat.tick()
        self._thread.start()

    def entered(self, gen: int, step: int) -> None:
        with self._lock:
            self._inside = (gen, step)

    def left(self) -> None:
        with self._lock:
            self._inside = None

    def aborted(self, gen: int) -> bool:
        """This watchdog aborted generation `gen` (set before it interrupts the groups: the
        fence reads it, `runtime/generations/fence.py`)."""
        return self._aborted_gen >= gen

    def dump(self, reason: str, gen: int) -> None:
        """Dump the flight recorder for generation `gen`'s end, once per generation: the first
        to see it end (this thread's abort, or the main thread leaving on a peer's error,
        `Generations.leave`) has the evidence; a later dump would record the abort's work."""
        with self._dump_lock:
            if self._dumped_gen >= gen:
                return
            self._dumped_gen = gen
        self._dump(reason)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._heartbeat.tick()
            try:
                asked = self._heartbeat.dump_asked()
                if asked is not None:
                    try:
                        self._dump("asked")
                    finally:
                        self._heartbeat.dumped(asked)
                aborted = self._abort_if_due()
                if aborted is not None:
                    self._on_abort(*aborted)
            except Exception as exc:  # noqa: BLE001 - the thread must go on ticking
                self.errors.append(f"{type(exc).__name__}: {exc}")  # read by the worker

    def _abort_if_due(self) -> tuple[int, int, int] | None:
        target_gen, at_step = self._heartbeat.target()
        with self._lock:
            if self._inside is None:
                return None
            gen, step = self._inside
            if target_gen <= gen or at_step != LEAVE_NOW or self._aborted_gen >= gen:
                return None
            self.dump("abort", gen)  # the collective it is blocked in, before the abort ends it
            self._aborted_gen = gen
            self._interrupt()
        return gen, target_gen, step


def watch(heartbeat: HeartbeatWriter, interrupt: Callable[[], None],
          record: Callable[..., object], node_dir: str | None,
          rank: Callable[[], int]) -> Watchdog:
    """The engine's watchdog, started: its aborts are `abort_on_notice` events, and it dumps
    the flight recorder of the worker now at `rank()` under `node_dir` (`FlightRecorder`).
    Called once the worker's first generation is up."""
    flight = FlightRecorder(node_dir, rank, record)
    dog = Watchdog(heartbeat, interrupt, lambda gen, target, step: record(
        ev.AbortOnNotice(gen=gen, target_gen=target, step=step)), dump=flight.dump)
    dog.start()
    return dog


class _NoWatchdog(Watchdog):
    """Where no watchdog runs (no agent, or not in place): the same calls, doing nothing."""

    def __init__(self) -> None:
        self.errors = []

    def dump(self, reason: str, gen: int) -> None:
        pass

    def start(self) -> None:
        pass

    def entered(self, gen: int, step: int) -> None:
        pass

    def left(self) -> None:
        pass

    def aborted(self, gen: int) -> bool:
        return False

    def stop(self) -> None:
        pass


NO_WATCHDOG: Watchdog = _NoWatchdog()
"""The engine's watchdog until one starts."""
