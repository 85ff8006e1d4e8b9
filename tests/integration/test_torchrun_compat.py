"""`unbroken run` as a drop-in for torchrun: the same command line, the same outcome.

Every row of CASES runs twice in one test, first under `python -m torch.distributed.run`
(the reference) and then under `unbroken run`, with the same launcher flags, the same
script, the same environment, each in its own directory under tmp_path (the cwd, so that
unbroken's default run dir `unbroken_runs/RUN_ID` lands there) and on its own free port.
The worker, tests/scripts/compat_worker.py, writes what it saw to OUT/rank<R>.json.

What is compared, and why:
- the exit code's class (Exit): a caller (a scheduler, a shell script, a Kubernetes Job)
  branches on it. torchrun exits 0, 1 when a worker failed, 2 for argparse's errors, and 1
  with a traceback when its own checks after parsing reject a value (BAD_INPUT: a bad
  `--nnodes`, a bad `-r`, `--no-python -m`); unbroken exits 2 there, with one line that
  names the flag, so for those rows torchrun's side is only "non-zero".
- the set of per-rank files: which ranks ran, and with `--no-python`, the shell marker.
- in each file, every value a worker can rely on: ranks and sizes (RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_*, ROLE_*), TORCHELASTIC_RESTART_COUNT,
  TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_USE_AGENT_STORE, OMP_NUM_THREADS,
  TORCH_NCCL_ASYNC_ERROR_HANDLING (2 under unbroken in place, on purpose: ON_PURPOSE),
  CUDA_VISIBLE_DEVICES, `is_torchelastic_launched()`, `__main__`'s module name, and the all-reduce result.
  Values that legitimately differ between two runs (MASTER_ADDR, MASTER_PORT,
  TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE's path) are compared by presence only;
  where a row fixes the run id, `expect` checks its value on both sides.
- where a row says so: which worker lines reach the console, on which stream, with which
  prefix (redirects, tee, --local-ranks-filter, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE);
  the log files below `<log_dir>/<run_id>_<random>/` (torchrun's layout; without
  --log-dir: somewhere under torchrun's temp dir, under unbroken's run dir); the
  root-cause report of a failed job, and the error file `@record` writes (its path,
  TORCHELASTIC_ERROR_FILE, is absolute under both: a script may change directory).

Every run is bounded (RUN_TIMEOUT); on a timeout the launchers' process groups are killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SCRIPTS, free_port, unbroken_cmd
from torchrun_cases import CASES, MESSAGE, Case, Exit

RUN_TIMEOUT = 120.0  # seconds for one launcher run (a row takes a few)


# Presence only: these differ between any two runs.
PRESENCE_ONLY = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


SCRIPT_PATHS = {"worker": str(SCRIPTS / "compat_worker.py"),
                "shell": str(SCRIPTS / "compat_worker.sh"), "module": "compat_pkg.worker"}


LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "unbroken": unbroken_cmd("run")}


# Different on purpose (docs/torchrun-migration.md): in place, a survivor must outlive a
# communicator error, so NCCL's handling aborts the communicators but keeps the process (2);
# without in-place recovery (--no-python, or PET_NO_PYTHON), torchrun's 1.
ON_PURPOSE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": lambda case: "1" if (
    "--no-python" in case.args or case.env.get("PET_NO_PYTHON") == "1") else "2"}


# Inherited from the test's own environment, these would change what a launcher does.
STRIPPED_PREFIXES = ("PET_", "TORCHELASTIC_", "UNBROKEN_")


STRIPPED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LOGLEVEL", "PYTHON_EXEC"}


@dataclass
class Outcome:
    launcher: str
    cmd: list[str]
    codes: list[int]
    stdout: str
    stderr: str
    home: Path  # the launcher's cwd
    out: Path  # where the workers write
    files: dict[str, dict]  # rank<R>.json -> its record

    def describe(self) -> str:
        return (f"[{self.launcher}] {' '.join(self.cmd)}\nexit codes {self.codes}\n"
                f"--- stdout (tail)\n{self.stdout[-3000:]}\n--- stderr (tail)\n{self.stderr[-4000:]}")


def _fill(text: str, subst: dict[str, str]) -> str:
    for key, value in subst.items():
        text = text.replace("{" + key + "}", value)
    return text


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in STRIPPED and not k.startswith(STRIPPED_PREFIXES)}


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


@dataclass
class Started:
    """One launcher's agents for one case, running."""
    launcher: str
    case: Case
    home: Path
    cmd: list[str]
    procs: list[subprocess.Popen]
    streams: list


def _start(launcher: str, case: Case, home: Path) -> Started:
    home.mkdir(parents=True)
    out, tmp = home / "out", home / "tmp"
    out.mkdir()
    tmp.mkdir()
    subst = {"port": str(free_port()), "log_dir": str(home / "logs"), "scripts": str(SCRIPTS)}
    cmd = [*LAUNCHERS[launcher], *(_fill(a, subst) for a in case.args),
           SCRIPT_PATHS[case.script], *case.script_args]
    env = _base_env()
    env.update(COMPAT_OUT=str(out), COMPAT_PYTHON=sys.executable, TMPDIR=str(tmp))
    env.update({k: _fill(v, subst) for k, v in case.env.items()})
    started = Started(launcher, case, home, cmd, [], [])
    for i in range(case.agents):
        so = open(home / f"agent{i}.stdout", "w+b")  # noqa: SIM115
        se = open(home / f"agent{i}.stderr", "w+b")  # noqa: SIM115
        started.streams += [so, se]
        started.procs.append(subprocess.Popen(cmd, cwd=home, env=env, stdout=so, stderr=se,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
    return started


def _wait(started: Started, deadline: float) -> Outcome:
    """Wait for a started case's agents (killing them all at `deadline`) and read what they
    left: exit codes, output, the workers' files."""
    launcher, case, home, procs = started.launcher, started.case, started.home, started.procs
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_groups(procs)
                raise AssertionError(f"[{launcher}] {case.name}: not done within "
                                     f"{RUN_TIMEOUT:.0f}s: {' '.join(started.cmd)}\n"
                                     f"{(home / 'agent0.stderr').read_text(errors='replace')[-3000:]}"
                                     ) from None
    finally:
        for s in started.streams:
            s.close()
    text = {name: "".join((home / f"agent{i}.{name}").read_text(errors="replace")
                          for i in range(case.agents)) for name in ("stdout", "stderr")}
    out = home / "out"
    files = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    return Outcome(launcher, started.cmd, [p.returncode for p in procs], text["stdout"],
                   text["stderr"], home, out, files)


def _check_exit(o: Outcome, case: Case) -> None:
    if case.exit is Exit.OK:
        assert o.codes == [0] * case.agents, o.describe()
    elif case.exit is Exit.WORKER_FAILURE:
        assert o.codes == [1] * case.agents, o.describe()
    elif case.exit is Exit.USAGE or o.launcher == "unbroken":
        assert o.codes == [2] * case.agents, o.describe()
    else:  # BAD_INPUT under torchrun: its checks after parsing raise
        assert all(c != 0 for c in o.codes), o.describe()
    if case.exit in (Exit.USAGE, Exit.BAD_INPUT) and o.launcher == "unbroken":
        lines = [line for line in o.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, f"bad input is told in one line\n{o.describe()}"
        assert any(flag in lines[0] for flag in case.bad_flag), (
            f"the line names one of {case.bad_flag}\n{o.describe()}")


def _check_files(o: Outcome, case: Case) -> None:
    names = [f"rank{r}.json" for r in range(case.ranks)]
    assert sorted(o.files) == sorted(names), f"rank files {sorted(o.files)}\n{o.describe()}"
    total = case.ranks * (case.ranks + 1) / 2
    for r in range(case.ranks):
        rec = o.files[f"rank{r}.json"]
        assert rec["RANK"] == str(r) and rec["WORLD_SIZE"] == str(case.ranks), (rec, o.describe())
        assert rec["sum"] == total, rec
        assert rec["is_torchelastic_launched"] is True, rec
        for key, value in case.expect.items():
            want = value.replace("{rank}", str(r)) if isinstance(value, str) else value
            assert rec.get(key) == want, f"rank {r}: {key}={rec.get(key)!r}, not {want!r}\n{rec}"
    if case.script == "shell" and case.ranks:
        markers = sorted(p.name for p in o.out.glob("shell-rank*.txt"))
        assert markers == [f"shell-rank{r}.txt" for r in range(case.ranks)], o.describe()
        for r in range(case.ranks):
            assert (o.out / f"shell-rank{r}.txt").read_text().startswith("shell "), r


def _check_console(o: Outcome, case: Case) -> None:
    for r in range(case.ranks):
        for stream, word in (("out", "stdout"), ("err", "stderr")):
            token, text = f"{stream}{r}", f"compat-{word} rank={r}"
            console = o.stdout if stream == "out" else o.stderr
            if token in case.console:
                line = case.prefix.replace("{rank}", str(r)) + text
                assert line in console.splitlines(), (
                    f"{line!r} on the launcher's {word}\n{o.describe()}")
            else:
                assert text not in o.stdout + o.stderr, f"{text!r} not on the console\n{o.describe()}"


def _log_files(o: Outcome, case: Case) -> tuple[Path, set[str]]:
    """The job's log directory, <run_id>_<random>, and the *.log/*.json files below it."""
    run_id = o.files["rank0.json"]["TORCHELASTIC_RUN_ID"] if o.files else None
    if any("{log_dir}" in a for a in case.args):
        base = o.home / "logs"
        entries = sorted(base.iterdir()) if base.is_dir() else []
        assert len(entries) == 1 and entries[0].is_dir(), (
            f"one job directory in --log-dir, got {entries}\n{o.describe()}")
        roots = entries
    else:  # torchrun: a temp dir (TMPDIR); unbroken: its run dir
        base = o.home / ("tmp" if o.launcher == "torchrun" else "unbroken_runs")
        roots = sorted({p.parent for p in base.rglob("attempt_0")
                        if p.is_dir() and p.parent.name.startswith(f"{run_id}_")})
        assert len(roots) == 1, (f"one {run_id}_*/attempt_0 under {base}, got {roots}\n"
                                 f"{o.describe()}")
    if run_id is not None:
        assert roots[0].name.startswith(f"{run_id}_"), (
            f"the job's log directory is <run_id>_<random>, got {roots[0].name} (run id {run_id})")
    files = {str(p.relative_to(roots[0])) for p in roots[0].rglob("*")
             if p.is_file() and p.suffix in (".log", ".json")}
    return roots[0], files


def _check_logs(o: Outcome, case: Case) -> None:
    root, layout = _log_files(o, case)
    assert layout == set(case.logs), f"log files below {root}: {sorted(layout)}"
    for rel in case.logs:
        m = re.fullmatch(r"attempt_0/(\d+)/(stdout|stderr)\.log", rel)
        if m:
            want = f"compat-{m.group(2)} rank={m.group(1)}"
            assert want in (root / rel).read_text(), f"{want!r} in {root / rel}"
    for rel, wanted in case.log_has.items():
        text = (root / rel).read_text()
        assert all(w in text for w in wanted), f"{wanted} in {root / rel}:\n{text}"
    for rel, unwanted in case.log_lacks.items():
        text = (root / rel).read_text()
        assert not any(w in text for w in unwanted), f"none of {unwanted} in {root / rel}:\n{text}"


def _check_root_cause(o: Outcome, case: Case) -> None:
    """torchrun's ChildFailedError report: the first failure's rank, exit code, error file
    and (with @record) the traceback, on stderr."""
    message = MESSAGE.format(rank=1)
    assert "Root Cause" in o.stderr, f"a root-cause report\n{o.describe()}"
    block = o.stderr[o.stderr.index("Root Cause"):]
    assert re.search(r"^\s*rank\s*:\s*1\b", block, re.M), f"rank 1 is the root cause\n{block}"
    # 1, or -6: torch's teardown of the raising process sometimes aborts after its error file
    # is written, under either launcher (docs/design-notes.md, "Known defects").
    assert re.search(r"^\s*exitcode\s*:\s*(1|-6)\b", block, re.M), block
    error_file = re.search(r"^\s*error_file\s*:\s*(\S+)", block, re.M)
    assert error_file, block
    assert message in o.stderr, f"the worker's exception is shown\n{o.describe()}"
    if "--record" in case.script_args:
        path = o.home / error_file.group(1)  # a relative path is the launcher's cwd's
        assert path.is_file(), f"@record wrote the error file {path}\n{block}"
        assert message in path.read_text(), path.read_text()
        assert message in block and "Traceback" in block, f"the traceback is reported\n{block}"
        given = o.files["rank1.json"]["TORCHELASTIC_ERROR_FILE"]
        assert os.path.isabs(given), (
            f"TORCHELASTIC_ERROR_FILE is absolute, as under torchrun (@record must find it after "
            f"the script changes directory), got {given!r}")


def _check(o: Outcome, case: Case) -> None:
    try:
        _check_one(o, case)
    except AssertionError as exc:
        raise AssertionError(f"[{o.launcher}] {case.name}: {exc}") from None


def _check_one(o: Outcome, case: Case) -> None:
    _check_exit(o, case)
    _check_files(o, case)
    if case.console is not None:
        _check_console(o, case)
    if case.logs is not None:
        _check_logs(o, case)
    if case.exit is Exit.WORKER_FAILURE:
        _check_root_cause(o, case)


def _compare(t: Outcome, u: Outcome, case: Case) -> None:
    """Both launchers' workers saw the same thing (presence only where runs differ)."""
    assert sorted(u.files) == sorted(t.files), "[unbroken] other rank files than torchrun's"
    for name, ref in t.files.items():
        got = u.files[name]
        for key in sorted(set(ref) | set(got)):
            if key in ON_PURPOSE:
                assert ref.get(key) == "1" and got.get(key) == ON_PURPOSE[key](case), (
                    f"[unbroken] {name}: {key}={got.get(key)!r}, torchrun {ref.get(key)!r}")
            elif key in PRESENCE_ONLY:
                assert (got.get(key) is None) == (ref.get(key) is None), (
                    f"[unbroken] {name}: {key} is set under torchrun ({ref.get(key)!r}), "
                    f"under unbroken {got.get(key)!r}")
            else:
                assert got.get(key) == ref.get(key), (
                    f"[unbroken] {name}: {key}={got.get(key)!r} under unbroken, {ref.get(key)!r} under torchrun")
    assert sorted(p.name for p in u.out.iterdir()) == sorted(p.name for p in t.out.iterdir()), (
        "[unbroken] other files in the output dir than torchrun's")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_same_outcome_as_torchrun(case: Case, tmp_path: Path) -> None:
    assert os.access(SCRIPTS / "compat_worker.sh", os.X_OK), "compat_worker.sh must be executable"
    # Both launchers run at once, each on its own port and in its own directory: the
    # comparison needs both outcomes, not one after the other.
    started = [_start("torchrun", case, tmp_path / "torchrun"),
               _start("unbroken", case, tmp_path / "unbroken")]
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        reference, ours = (_wait(s, deadline) for s in started)
    finally:
        for s in started:
            _kill_groups(s.procs)
    _check(reference, case)
    _check(ours, case)
    _compare(reference, ours, case)
