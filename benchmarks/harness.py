"""The benchmark harness: what every benchmark in benchmarks/ runs through.

It owns four things, each once:

- **Processes.** `launch` starts an arm's launcher in a process group of its own, every
  process under it marked by `UNBROKEN_RUN_DIR=<run dir>` in its environment, and tracks it.
  `kill_everything` ends one arm: its group, and every process whose marker names its run
  dir (workers that left the group included). `guard`, installed by the first `launch`,
  `track` or `temp_root`, ends every tracked arm when the benchmark is stopped (SIGTERM,
  SIGINT) or exits, so that a benchmark killed by a timeout leaves no process behind; a
  stopped benchmark then exits 128 + the signal's number (143 for SIGTERM).
- **Tries.** `alternate` runs the arms' tries in alternating order; `Try` is one try's
  record; `inject_fault` kills a worker once training passes a step and times the recovery.
- **Statistics.** `ArmStats` (tries, median_s, p90_s, lost_steps_median, lost_steps_max,
  hangs, failed: the keys the benchmarks print), `percentile`, `median_of`, `ratio`,
  `change_pct`, `paired_ratios`.
- **Output.** `emit` prints the figures as the last line, one JSON object.

Nothing here imports torch: the statistics are tested on their own (tests/unit).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"

T = TypeVar("T")


# ------------------------------------------------------------------------------ processes
_groups: dict[int, subprocess.Popen] = {}  # pid -> a process leading a group we started
_marked: set[str] = set()  # run dirs (and temp roots) whose marked processes we end
_roots: list[Path] = []  # temp roots to remove at exit
_owner: int | None = None  # the benchmark's pid: forked children inherit the handlers
_stopped_by: int | None = None  # the stop signal's number, once one came


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def guard() -> None:
    """Make this process end every tracked arm on SIGTERM, SIGINT and at exit (idempotent).

    On a signal: SIGKILL every tracked process group, every process whose
    `UNBROKEN_RUN_DIR` lies under a tracked run dir or temp root, and this process's own
    children; then raise SystemExit(128 + signum), so that `finally` blocks and the exit
    handler still run (temp roots are removed). A second signal meanwhile exits at once.
    At a normal exit, the same minus the children (their owners join them). Called from
    the main thread; `launch`, `track` and `temp_root` call it."""
    global _owner
    if _owner == os.getpid():
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("harness.guard() must first run in the main thread")
    _owner = os.getpid()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    atexit.register(_at_exit)


def _on_signal(signum: int, _frame: object) -> None:
    global _stopped_by
    if os.getpid() != _owner:  # a forked child: the default action, as if no handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _stopped_by is not None:
        os._exit(128 + signum)
    _stopped_by = signum
    ended = end_all(children=True)
    print(f"benchmark stopped by {signal.Signals(signum).name}: ended {ended} process(es)",
          file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _at_exit() -> None:
    if os.getpid() != _owner:
        return
    end_all(children=False)
    for root in _roots:
        shutil.rmtree(root, ignore_errors=True)


def track(proc: subprocess.Popen, run_dir: Path | None = None) -> subprocess.Popen:
    """Have `guard` end `proc` (which must lead its own process group: started with
    start_new_session=True) and, with `run_dir`, every process marked with it. Returns it."""
    guard()
    if run_dir is not None:
        _marked.add(str(run_dir))
    _groups[proc.pid] = proc
    return proc


def launch(cmd: Sequence[str], run_dir: Path, env: Mapping[str, str] | None = None,
           log: str = "launcher.log") -> subprocess.Popen:
    """Start one arm's launcher, tracked: `cmd` from the repository root, in a session (and
    process group) of its own, its output appended to run_dir/log, with this environment
    plus `env` plus UNBROKEN_RUN_DIR=run_dir and PYTHONUNBUFFERED=1. The marker is
    inherited by every process under the launcher, so `kill_everything` finds them even
    outside its group. After a stop signal, raises SystemExit instead of starting."""
    guard()
    if _stopped_by is not None:  # the stop's SystemExit was caught: do not start anew
        raise SystemExit(128 + _stopped_by)
    run_dir.mkdir(parents=True, exist_ok=True)
    _marked.add(str(run_dir))  # before the start: a signal mid-start still finds the child
    full = {**os.environ, **(env or {}), "UNBROKEN_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
    with open(run_dir / log, "ab") as out:
        proc = subprocess.Popen(list(cmd), env=full, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=REPO)
    _groups[proc.pid] = proc
    return proc


def temp_root(prefix: str, keep: bool = False, dir: str | None = None) -> Path:
    """A fresh directory for a benchmark's run dirs. Every process marked with a run dir
    under it is ended at exit or on a stop signal; the directory itself is removed at exit
    unless `keep`."""
    guard()
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    _marked.add(str(root))
    if not keep:
        _roots.append(root)
    return root


def _marker_of(pid: str) -> str | None:
    """The UNBROKEN_RUN_DIR a process started with, or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(b"UNBROKEN_RUN_DIR="):
            return entry[len(b"UNBROKEN_RUN_DIR="):].decode(errors="replace")
    return None


def _under(path: str, forms: set[str]) -> bool:
    return any(path == form or path.startswith(form.rstrip("/") + "/") for form in forms)


def sweep(dirs: set[str], children: bool = False) -> int:
    """SIGKILL every process (but this one) whose UNBROKEN_RUN_DIR is one of `dirs` or under
    one, and with `children` every child of this process. Returns how many were signalled."""
    me, hit = os.getpid(), 0
    forms = set(dirs) | {os.path.realpath(d) for d in dirs}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        marker = _marker_of(entry.name)
        mine = children and _parent_of(entry.name) == me
        if mine or (marker is not None and _under(marker, forms)):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                hit += 1
            except OSError:
                pass
    return hit


def _parent_of(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _killpg(proc: subprocess.Popen) -> None:
    """SIGKILL the group `proc` leads (or `proc` alone if it leads none), while it is
    unreaped: a reaped pid may lead someone else's group by now."""
    if proc.poll() is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def kill_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL a launcher's process group and every process started for `run_dir`, and
    reap the launcher."""
    _killpg(proc)  # a launcher already gone: its group's members carry the marker too
    sweep({str(run_dir)})
    proc.wait()
    _groups.pop(proc.pid, None)


def end_all(children: bool = False) -> int:
    """SIGKILL every tracked group and every marked process (see `guard`), sweeping until a
    pass finds none left (a dying launcher may have been mid-fork); reap the launchers.
    Returns how many processes were signalled."""
    ended = 0
    for proc in list(_groups.values()):
        if proc.poll() is None:
            _killpg(proc)
            ended += 1
    for _ in range(5):
        hit = sweep(_marked, children)
        ended += hit
        if not hit:
            break
        time.sleep(0.05)
    for pid, proc in list(_groups.items()):
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        _groups.pop(pid, None)
    return ended


def wait_or_kill(proc: subprocess.Popen, run_dir: Path, timeout: float) -> int | None:
    """The launcher's exit code; None (everything of the arm killed) if it runs longer
    than `timeout` seconds."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_everything(proc, run_dir)
        return None
    _groups.pop(proc.pid, None)
    return code


# ------------------------------------------------------------------------------ commands
def torchrun_cmd(workers: int, script: Path, run_id: str, *args: str,
                 rdzv_backend: str = "c10d") -> list[str]:
    """The torchrun baseline: one node, `workers` workers, 3 restarts, its own rendezvous
    endpoint on a free port, monitoring every 0.1 s."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
            "--max-restarts", "3", "--rdzv-backend", rdzv_backend,
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
            "--monitor-interval", "0.1", str(script), *args]


def unbroken_cmd(workers: int, run_dir: Path, script: Path, *args: str,
                 flags: Sequence[str] = ()) -> list[str]:
    """`unbroken run` on one node (standalone), `workers` workers, 3 restarts, `flags` for
    the launcher and `args` for the script."""
    return [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node",
            str(workers), "--max-restarts", "3", "--run-dir", str(run_dir), *flags,
            str(script), *args]


# ------------------------------------------------------------------------------ events
class EventTail:
    """The events appended since the last call: polling must not steal the CPU it measures."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "events.jsonl"
        self.offset = 0
        self.partial = b""
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.events += new
        return new


def events_of(run_dir: Path) -> list[dict]:
    """Every event of a run dir's log (rotated files included), in time order; [] with no
    log. Imports the project (src/ must be on sys.path)."""
    from unbroken.telemetry.events import read_events

    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


def step_period(ends: list[float], least: int = 21) -> float | None:
    """The median time between consecutive step ends (the steady state's seconds per step,
    the loop's work between steps included); None with fewer than `least` gaps."""
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return statistics.median(gaps) if gaps and len(gaps) >= least else None


def epoch(e: dict) -> tuple[int, int]:
    """Which incarnation of the job computed a step: (attempt, generation)."""
    return e.get("attempt", 0), e.get("gen", 0)


def lost_steps(events: list[dict], killed_at: float, resumed: dict) -> int:
    """Steps completed before the kill that the recovered job computed again (it resumed at
    `resumed["step"]`)."""
    done = max((e["step"] for e in events if e["event"] == "step" and e["t"] <= killed_at),
               default=-1)
    return max(0, done + 1 - resumed["step"])


def restart_would_lose(events: list[dict], killed_at: float) -> int:
    """Steps completed before the kill that a restart from storage would compute again: it
    resumes from the newest checkpoint committed before the kill (step 0 if there is none)."""
    done = max((e["step"] for e in events if e["event"] == "step" and e["t"] <= killed_at),
               default=-1)
    durable = max((e["step"] for e in events
                   if e["event"] == "checkpoint_saved" and e["t"] <= killed_at), default=0)
    return max(0, done + 1 - durable)


# ------------------------------------------------------------------------------ tries
@dataclass
class Try:
    """One fault injected into one arm, and what came of it: `recovery`, seconds from the
    fault to the first step the recovered job completed; `lost_steps`, steps done before the
    fault and computed again; `hang`, no resumed step within the benchmark's bound (or the
    job did not end after it); `error`, why the try produced no figure; `exit`, the
    launcher's exit code where the benchmark waited for it; `finished`, whether the job
    then completed every step (None: not asked). Benchmarks subclass it for their own
    fields."""

    arm: str
    recovery: float | None = None
    lost_steps: int | None = None
    hang: bool = False
    error: str | None = None
    exit: int | None = None
    finished: bool | None = None

    @property
    def failed(self) -> bool:
        """No figure for a reason other than a hang, or the job did not end well."""
        return self.error is not None or self.finished is False or self.exit not in (0, None)

    def shown(self) -> str:
        """One line's worth: the recovery and lost steps, HANG, or the error."""
        if self.recovery is not None and not self.hang:
            lost = f", {self.lost_steps} lost step(s)" if self.lost_steps is not None else ""
            return f"{self.recovery:.3f}s{lost}"
        return "HANG" if self.hang else str(self.error)


@dataclass(frozen=True)
class Fault:
    """A worker killed at `killed_at` (wall time), and `resumed`: the `step` event of the
    first step the recovered job completed."""

    killed_at: float
    resumed: dict


def alternate(arms: Sequence[str], rounds: int, one_try: Callable[[str, int], T], *,
              tries: Mapping[str, int] | None = None, reverse: bool = True,
              report: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Run `one_try(arm, i)` for every arm in each round i = 0 .. rounds - 1: in the order
    of `arms` in even rounds and in reverse in odd ones (unless `reverse` is False), so that
    machine noise, and whatever one arm leaves behind, hit every arm alike. An arm named in
    `tries` stops after that many. `report(i, arm, result)` follows each try (to print it).
    Returns each arm's results in round order: an arm that ran every round has round k's
    result at index k."""
    results: dict[str, list[T]] = {arm: [] for arm in arms}
    limit = tries or {}
    for i in range(rounds):
        for arm in arms if (i % 2 == 0 or not reverse) else arms[::-1]:
            if i >= limit.get(arm, rounds):
                continue
            result = one_try(arm, i)
            results[arm].append(result)
            if report is not None:
                report(i, arm, result)
    return results


def wait_for_victim(proc: subprocess.Popen, tail: EventTail, kill_at: int, rank: int,
                    timeout: float, ready: Callable[[list[dict]], bool] = lambda events: True,
                    ) -> int | None:
    """The pid of `rank`'s worker once training has passed step `kill_at` and `ready(events)`
    holds; None if the launcher exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail.poll()
        if ready(tail.events) and any(e["event"] == "step" and e["step"] >= kill_at
                                      for e in tail.events):
            return [e["pid"] for e in tail.events
                    if e["event"] == "worker_start" and e["rank"] == rank][-1]
        if proc.poll() is not None:
            return None
        time.sleep(0.02)
    return None


def kill_and_time(proc: subprocess.Popen, tail: EventTail, victim: int,
                  hang_after: float) -> tuple[float, dict | str | None]:
    """SIGKILL `victim`, then wait for the first step the recovered job completes (a later
    attempt or generation). Returns (kill time, that step's event); instead of the event,
    None for a hang, or a string if the launcher exited without resuming."""
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    before = max((epoch(e) for e in tail.events if e["event"] == "step"), default=(0, 0))
    deadline = time.monotonic() + hang_after
    while time.monotonic() < deadline:
        resumed = next((e for e in tail.poll() if e["event"] == "step"
                        and e["t"] > killed_at and epoch(e) > before), None)
        if resumed is not None:
            return killed_at, resumed
        if proc.poll() is not None:
            return killed_at, f"exited {proc.returncode} without resuming"
        time.sleep(0.005)
    return killed_at, None


def inject_fault(arm: str, proc: subprocess.Popen, tail: EventTail, kill_at: int, *,
                 timeout: float, hang_after: float, rank: int = 1,
                 ready: Callable[[list[dict]], bool] = lambda events: True,
                 not_reached: str = "never reached the kill step") -> Fault | Try:
    """Once training passes `kill_at` (and `ready(events)` holds), SIGKILL `rank`'s worker
    and wait up to `hang_after` s for the recovered job's first step: the Fault; or the
    try's end as a Try: `not_reached` if the kill step never came within `timeout` s, a
    hang, or the launcher's exit without resuming."""
    victim = wait_for_victim(proc, tail, kill_at, rank, timeout, ready)
    if victim is None:
        return Try(arm, error=not_reached)
    killed_at, resumed = kill_and_time(proc, tail, victim, hang_after)
    if isinstance(resumed, str):
        return Try(arm, error=resumed)
    if resumed is None:
        return Try(arm, hang=True)
    return Fault(killed_at, resumed)


# ------------------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float:
    """The value at rank floor(q * n) of the n sorted values (the largest at most): p90 of
    10 values is the largest. ValueError with no values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_of(values: Sequence[float], digits: int | None = None) -> float | None:
    """The median, rounded to `digits` when given; None with no values."""
    if not values:
        return None
    middle = statistics.median(values)
    return round(middle, digits) if digits is not None else middle


def ratio(a: float | None, b: float | None, digits: int = 1) -> float | None:
    """a / b rounded to `digits`; None when either is unknown or b is 0."""
    return round(a / b, digits) if a is not None and b else None


def change_pct(value: float | None, base: float | None, digits: int = 2) -> float | None:
    """How much larger `value` is than `base`, in percent, rounded; None when either is
    unknown or base is 0."""
    return round(100 * (value / base - 1), digits) if value is not None and base else None


def paired_ratios(base: Sequence[float | None], other: Sequence[float | None]) -> list[float]:
    """other / base - 1 for each round where both sides have a figure (the two lists are
    aligned by round): within a round the ratio is steadier than across rounds."""
    return [o / b - 1 for b, o in zip(base, other, strict=True) if b and o is not None]


def recovery_times(tries: Sequence[Try]) -> list[float]:
    """The recovery times of the tries that recovered (hangs left out)."""
    return [t.recovery for t in tries if t.recovery is not None and not t.hang]


@dataclass(frozen=True)
class ArmStats:
    """One arm's tries summarized, in the JSON keys every fault benchmark prints: `tries`;
    the median and p90 (`percentile`) of the recovery times, in s to the ms (None: no try
    recovered); the median and max of the lost steps (None: none counted); `hangs`; `failed`
    (`Try.failed`)."""

    tries: int
    median_s: float | None
    p90_s: float | None
    lost_steps_median: float | None
    lost_steps_max: int | None
    hangs: int
    failed: int

    @classmethod
    def of(cls, tries: Sequence[Try]) -> ArmStats:
        times = recovery_times(tries)
        lost = [t.lost_steps for t in tries if t.lost_steps is not None]
        return cls(tries=len(tries), median_s=median_of(times, 3),
                   p90_s=round(percentile(times, 0.9), 3) if times else None,
                   lost_steps_median=median_of(lost), lost_steps_max=max(lost) if lost else None,
                   hangs=sum(1 for t in tries if t.hang),
                   failed=sum(1 for t in tries if t.failed))

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------ output
def emit(result: dict) -> None:
    """Print `result` as one JSON line: a benchmark's last line, which the README quotes."""
    print(json.dumps(result), flush=True)
