"""Helpers for tests that launch real agents and workers.

Every launch runs under a timeout, and every test checks afterwards that no process of
its run is still alive (an agent, a worker, or a worker's child).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from unbroken.telemetry.events import parse_lines, read_events

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# A GPT small enough that 2 cores run a few workers at tens of steps per second.
TINY = ["--global-batch", "8", "--seq", "32", "--dim", "32", "--layers", "1", "--print-every", "1000"]


@dataclass
class Launched:
    code: int
    output: str
    run_dir: Path

    def events(self, name: str | None = None) -> list[dict]:
        evs = read_events(self.run_dir / "events.jsonl")
        return [e for e in evs if name is None or e["event"] == name]


def last_committed(result: Launched, attempt: int = 0) -> int:
    """The newest checkpoint an attempt reported committed (0: none). Async saves are
    deferred while the last is still being written, so not every multiple of
    --checkpoint-every is saved, and a fault may come before the first commit."""
    steps = [e["step"] for e in result.events("checkpoint_saved")
             if e["attempt"] == attempt and e["rank"] == 0]
    return max(steps, default=0)


def assert_resumed_from_the_last_checkpoint(result: Launched, before_step: int,
                                            attempt: int = 1) -> int:
    """`attempt` resumed from the newest checkpoint the attempt before it committed before
    the fault. (A worker stopped right after its commit may not have logged it: the resumed
    step can then be newer than the last `checkpoint_saved`, never older.)"""
    resumed = {e["step"] for e in result.events("resume") if e["attempt"] == attempt}
    assert len(resumed) == 1, resumed
    step = resumed.pop()
    committed = last_committed(result, attempt - 1)
    assert committed <= step <= before_step, (step, committed)
    if step:
        loaded = {e["step"] for e in result.events("checkpoint_loaded") if e["attempt"] == attempt}
        assert loaded == {step}, loaded
    return step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unbroken_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "unbroken", *args]


def start(run_dir: Path, *flags: str, script: Path | str = EXAMPLE, args: list[str] | None = None,
          port: int | None = None, cwd: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `unbroken run` in the background, from `cwd` (default the repo), in `env`
    (default ours); output goes to run_dir/../agent-N.out."""
    port_flags = ["--master-port", str(port)] if port is not None else ["--standalone"]
    cmd = unbroken_cmd("run", "--run-dir", str(run_dir), *port_flags, *flags, str(script), *(args or []))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = open(run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.out", "w+b")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd or REPO,
                            start_new_session=True, env=env)
    proc.output_file = out  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> Launched:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"unbroken run did not finish within {timeout}s") from None
    out = proc.output_file  # type: ignore[attr-defined]
    out.seek(0)
    text = out.read().decode(errors="replace")
    out.close()
    return Launched(proc.returncode, text, run_dir)


def assert_gave_up(result: Launched, restarts: int, error: str, faults: int) -> None:
    """The job spent its restart budget, exited 1 and showed the worker's error."""
    assert result.code == 1, result.output
    assert f"giving up after {restarts} restart(s)" in result.output
    assert error in result.output
    assert len(result.events("fault")) == faults


def assert_recovered_in_place(result: Launched, survivor: int, steps: int,
                              fault: tuple[str, int] | None = ("crash", 1)) -> None:
    """A framework job with slot 0 surviving and slot 1 replaced (or taken by a spare), in
    place: it finished; `fault` (kind, rank) was its one fault (None: not checked); no full
    restart; slot 0 kept its process `survivor` and committed each of `steps` once; slot 1's
    last switch brought it state from slot 0."""
    from unbroken.telemetry.summary import summarize

    assert result.code == 0, result.output
    if fault is not None:
        assert [(f["kind"], f["rank"]) for f in result.events("fault")] == [fault]
    assert not result.events("restart"), "fell back to a full restart"
    assert result.events("gen_up"), "no generation formed in place"
    done = {e["slot"]: e["pid"] for e in result.events("training_done")}
    assert done[0] == survivor, "the survivor changed process"
    assert [e["step"] for e in result.events("step") if e["slot"] == 0] == list(range(steps))
    joined = [e for e in result.events("gen_switch") if e["slot"] == 1]
    assert joined and joined[-1]["state_from"] == 0 and joined[-1]["received_bytes"] > 0
    assert summarize(result.run_dir)["steps"] == steps


def assert_bit_identical(a, b, where: str = "state") -> None:
    """Two nested states (dicts, lists, tensors, scalars) are equal, tensors bit for bit."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bit_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def launch(run_dir: Path, *flags: str, timeout: float = 240, **kw) -> Launched:
    return finish(start(run_dir, *flags, **kw), run_dir, timeout)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05,
             explain: Path | None = None):
    """Poll predicate until it is truthy; on timeout fail, with the run's recent events when
    `explain` names its run dir (so a failure in CI says what the job did instead)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    trace = f"\n{event_trace(explain)}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{trace}")


_ROUTINE = {"step", "checkpoint_deferred", "checkpoint_saved"}


def event_trace(run_dir: Path, last: int = 60) -> str:
    """The run's last non-routine events, one compact line each, for failure messages."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return "(no event log)"
    rows = [e for e in read_events(path) if e["event"] not in _ROUTINE][-last:]
    keep = ("node", "rank", "slot", "gen", "attempt", "kind", "reason", "detail", "source")
    return "\n".join(f"{e.get('t', 0):.2f} {e['event']} "
                     + " ".join(f"{k}={e[k]}" for k in keep if k in e) for e in rows)


_TAIL: dict[Path, tuple[int, int, list[dict]]] = {}
"""Each log's inode, bytes parsed and events so far: `wait_for` polls a log every 50 ms,
and parsing all of it each time cost the test process seconds of CPU per test."""


def _events_so_far(path: Path) -> list[dict]:
    """The log's events in time order, parsing only the whole lines appended since the last
    call (a torn line is skipped, as `read_events` does). A rotated log (`path.1` exists)
    is read whole by `read_events`, which knows rotation."""
    if path.with_name(path.name + ".1").exists():
        _TAIL.pop(path, None)
        return read_events(path)
    ino = path.stat().st_ino
    seen = _TAIL.get(path)
    offset, events = (seen[1], seen[2]) if seen is not None and seen[0] == ino else (0, [])
    with open(path, "rb") as fh:
        if fh.seek(0, os.SEEK_END) < offset:  # truncated or replaced: start again
            offset, events = 0, []
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    events += parse_lines(data[:end].splitlines())
    if end:
        events.sort(key=lambda e: e.get("t", 0.0))
    _TAIL[path] = (ino, offset + end, events)
    return events


def events_of(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in _events_so_far(path) if e["event"] == name] if path.exists() else []


def offered(events: list[dict]) -> list[str]:
    """The spares an agent offers the leader now, from its `spares_offered` events (the
    last one counts): a standby's spare is someone else's only once it is offered, not as
    soon as the spare says it is ready."""
    offers = [e["wids"] for e in events if e["event"] == "spares_offered"]
    return offers[-1] if offers else []


def events_in(run_dirs, name: str | None = None) -> list[dict]:
    """The events of several run dirs merged in time order (only `name`'s when given): the
    whole job's log when its nodes share no disk and each agent writes to a run dir of its
    own. A dir with no log yet adds nothing."""
    merged = [e for run_dir in run_dirs if (Path(run_dir) / "events.jsonl").exists()
              for e in read_events(Path(run_dir) / "events.jsonl")
              if name is None or e["event"] == name]
    return sorted(merged, key=lambda e: e.get("t", 0.0))


def processes_mentioning(marker: str) -> list[int]:
    """PIDs whose command line or environment mentions marker (our agents and workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in blob:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Etcd:
    endpoint: str  # HOST:PORT, on the address it was started for
    proc: subprocess.Popen
    log: Path

    def answers(self) -> bool:
        """Whether its v3 JSON gateway serves a read; AssertionError if etcd has exited."""
        request = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range",
                                         data=b'{"key": "Zm9v"}', method="POST")
        try:
            with urllib.request.urlopen(request, timeout=1) as response:
                return response.status == 200
        except OSError:
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited with {self.proc.returncode}:\n"
                                     f"{self.log.read_text(errors='replace')[-2000:]}") from None
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_etcd(listen_addr: str, data_dir: Path) -> Etcd:
    """A one-member etcd (installed by `make install`) serving clients on listen_addr and on
    loopback, at one free port, and answering reads when this returns (within 20 s). Its
    output goes to data_dir.log. The v3 JSON gateway the etcd backend speaks is on by
    default from etcd 3.4 (3.4's `--help` does not even list `--enable-grpc-gateway`)."""
    binary = shutil.which("etcd")
    if binary is None:
        raise AssertionError("etcd is not installed: run `make install` (it installs "
                             "Debian's etcd-server) or `apt-get install etcd-server`")
    client, peer = free_port(), free_port()
    name = f"etcd-{client}"
    clients = ",".join(f"http://{a}:{client}" for a in dict.fromkeys([listen_addr, "127.0.0.1"]))
    log = data_dir.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "--name", name, "--data-dir", str(data_dir),
             "--listen-client-urls", clients,
             "--advertise-client-urls", f"http://{listen_addr}:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"{name}=http://127.0.0.1:{peer}", "--log-level", "error"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    etcd = Etcd(f"{listen_addr}:{client}", proc, log)
    try:
        wait_for(etcd.answers, 20, "etcd to serve")
    except BaseException:
        etcd.stop()
        raise
    return etcd


@pytest.fixture
def etcd_endpoint(tmp_path):
    """A real etcd server on loopback for one test; its client endpoint, HOST:PORT.
    Stopped, and its data removed, when the test ends."""
    etcd = start_etcd("127.0.0.1", tmp_path / "etcd")
    try:
        yield etcd.endpoint
    finally:
        etcd.stop()


def _hosts_with_etcd(root: Path | None, etcd_dir: Path):
    """Three hosts on one bridge (tests/netns.py), with an etcd in the root namespace on the
    bridge address as `hosts.etcd`. Skipped where network namespaces cannot be made."""
    from netns import Hosts, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Hosts(root) as hosts:
        hosts.etcd = start_etcd(hosts.bridge_addr, etcd_dir)
        try:
            yield hosts
        finally:
            hosts.etcd.stop()


@pytest.fixture
def netns_hosts(tmp_path):
    """Three hosts on one bridge, with an etcd on the bridge address as `hosts.etcd`; the
    hosts share this machine's disk (no root: see tests/netns.py)."""
    yield from _hosts_with_etcd(None, tmp_path / "etcd")


@pytest.fixture
def isolated_hosts(tmp_path):
    """`netns_hosts` whose hosts share nothing: Hosts(root=tmp_path / "hosts"), so a command
    on host i sees, of that root, only node_dir(i) and the shared dirs it names."""
    yield from _hosts_with_etcd(tmp_path / "hosts", tmp_path / "etcd")


# ------------------------------------------------------------ agents on isolated hosts
MASTER_PORT = "29500"  # every host is a network namespace of its own: the port is free on each


def run_dir_on(hosts, i: int, run_dir: str = "run") -> Path:
    """Host i's agent's run dir (`--run-dir run`, in host i's node dir), as the test sees it."""
    return hosts.node_dir(i) / run_dir


def go_file(hosts) -> Path:
    """The file a multi-host test creates once it has seen what it waited for: a job whose
    steps sleep with `--sleep-until` it then runs out at full speed. It lies in a dir every
    host is given for that signal alone (`shared=[go.parent]`), never the job's data."""
    return hosts.shared_dir("pace") / "go"


def start_on(hosts, i: int, *flags: str, script: Path | str = EXAMPLE,
             args: list[str] | None = None, shared=(), env: dict[str, str] | None = None,
             run_dir: str = "run") -> subprocess.Popen:
    """`start` on host i of `hosts` (tests/netns.py): `unbroken run --run-dir RUN_DIR` from
    host i's own dir, seeing of the hosts' root only its node dir and the `shared` dirs. A
    second agent on the same host takes another `run_dir` (its output: agent-RUN_DIR.out)."""
    cmd = unbroken_cmd("run", "--run-dir", run_dir, *flags, str(script), *(args or []))
    output = "agent.out" if run_dir == "run" else f"agent-{run_dir}.out"
    return hosts.agent(i, cmd, shared=shared, env=env, output=output)


def finish_on(hosts, i: int, proc: subprocess.Popen, timeout: float = 240,
              run_dir: str = "run") -> Launched:
    """`finish` for an agent `start_on` started on host i: its output, its own run dir."""
    return finish(proc, run_dir_on(hosts, i, run_dir), timeout)


# Tests write nothing into the work tree: every run dir, checkpoint and log goes to a
# temporary directory. Checked for the whole session: what `git status` shows after it
# (untracked or ignored) that it did not show before, caches aside, fails the session.
_CACHES = ("__pycache__/", ".pytest_cache/", ".ruff_cache/", ".grimp_cache/",
           ".import_linter_cache/", ".coverage-data/", ".egg-info/", ".venv/")


def _untracked() -> set[str] | None:
    """What `git status` lists as untracked or ignored in the work tree; None outside git."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line[3:] for line in out.stdout.splitlines()
            if line[:2] in ("??", "!!") and not any(c in line for c in _CACHES)}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # pytest-xdist: the controller checks
        session.config._untracked_before = _untracked()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_untracked_before", None)
    after = _untracked()
    if before is None or after is None:
        return
    if new := sorted(after - before):
        sys.stderr.write("\nthe tests wrote into the work tree (use tmp_path): "
                         + ", ".join(new[:20]) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
