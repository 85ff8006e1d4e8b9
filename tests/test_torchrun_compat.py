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

import argparse
import enum
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import SCRIPTS, free_port, unbroken_cmd

from unbroken.cli import _build_parser


class Exit(enum.Enum):
    OK = "0"
    WORKER_FAILURE = "worker failure"  # 1 from both
    USAGE = "usage"  # 2 from both: argparse rejected the command line
    BAD_INPUT = "bad input"  # torchrun: non-zero (1, a traceback); unbroken: 2, one line


@dataclass
class Case:
    name: str
    args: tuple[str, ...]  # launcher flags; {port}, {log_dir}, {scripts} are filled in
    script: str = "worker"  # worker: compat_worker.py; shell: compat_worker.sh; module: -m
    script_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # launcher env, placeholders filled
    exit: Exit = Exit.OK
    ranks: int = 2  # rank files expected, rank0.json ... (0: no worker may run)
    agents: int = 1  # launchers started at once, on one port
    expect: dict[str, object] = field(default_factory=dict)  # in every rank file; {rank}
    console: tuple[str, ...] | None = None  # worker lines on the console: out0, err1, ...
    prefix: str = ""  # what the shown lines start with; {rank} is filled in
    logs: tuple[str, ...] | None = None  # *.log and *.json files below <run_id>_*/
    log_has: dict[str, tuple[str, ...]] = field(default_factory=dict)
    log_lacks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bad_flag: tuple[str, ...] = ()  # USAGE/BAD_INPUT: unbroken's one line names one of these
    note: str = ""


STANDALONE = ("--standalone", "--nproc-per-node", "2")
C10D = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}")
ALL_LINES = ("out0", "err0", "out1", "err1")
ALL_LOGS = ("attempt_0/0/stdout.log", "attempt_0/0/stderr.log",
            "attempt_0/1/stdout.log", "attempt_0/1/stderr.log")
PREFIX_TEMPLATE = "[${role_name}-${rank}]:"
MESSAGE = "compat worker failure on rank {rank}"  # as tests/scripts/compat_worker.py raises

CASES = [
    # -- flags: rendezvous and sizes
    Case("standalone", STANDALONE, console=ALL_LINES),
    Case("nproc_underscore", ("--standalone", "--nproc_per_node", "2")),
    Case("static_master_addr_port",
         ("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
          "--master-port", "{port}", "--nproc-per-node", "2"), script_args=("--init", "tcp")),
    Case("c10d_rdzv_id", (*C10D, "--rdzv-id", "compat-job", "--nproc-per-node", "2"),
         expect={"TORCHELASTIC_RUN_ID": "compat-job", "GROUP_WORLD_SIZE": "1"}),
    Case("static_backend_endpoint",
         ("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:{port}", "--node_rank", "0",
          "--nproc-per-node", "2"), script_args=("--init", "tcp")),
    Case("role", (*STANDALONE, "--role", "trainer", "--tee", "3"),
         expect={"ROLE_NAME": "trainer"}, console=ALL_LINES, prefix="[trainer{rank}]:"),
    Case("monitor_interval", (*STANDALONE, "--monitor-interval", "0.5")),
    Case("start_method_fork", (*STANDALONE, "--start-method", "fork")),
    Case("shutdown_timeout", (*STANDALONE, "--shutdown-timeout", "5")),
    Case("signals_to_handle", (*STANDALONE, "--signals-to-handle", "SIGTERM,SIGINT")),
    Case("rdzv_conf", (*C10D, "--rdzv-id", "conf", "--nproc-per-node", "2",
                       "--rdzv-conf", "join_timeout=60,last_call_timeout=1")),
    Case("local_addr", (*C10D, "--rdzv-id", "addr", "--nproc-per-node", "2",
                        "--local-addr", "127.0.0.1")),
    Case("event_log_handler", (*STANDALONE, "--event-log-handler", "null")),
    Case("virtual_local_rank", (*STANDALONE, "--virtual-local-rank"),
         expect={"LOCAL_RANK": "0"}),
    # -- restarts and failures
    Case("max_restarts_recovers", (*STANDALONE, "--max-restarts", "1"),
         script_args=("--fail-first",),
         expect={"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}),
    Case("failing_script", STANDALONE, script_args=("--raise-on-rank", "1"),
         exit=Exit.WORKER_FAILURE),
    Case("failing_script_record", STANDALONE, script_args=("--raise-on-rank", "1", "--record"),
         exit=Exit.WORKER_FAILURE),
    Case("failing_script_record_log_dir", (*STANDALONE, "--log-dir", "{log_dir}"),
         script_args=("--raise-on-rank", "1", "--record"), exit=Exit.WORKER_FAILURE,
         logs=("attempt_0/1/error.json",),
         log_has={"attempt_0/1/error.json": (MESSAGE.replace("{rank}", "1"),)},
         note="@record's error file in torchrun's layout: attempt_0/<local_rank>/error.json"),
    # -- what is run
    Case("module", ("--standalone", "--nproc-per-node", "2", "-m"), script="module",
         env={"PYTHONPATH": "{scripts}"}, expect={"main_module": "compat_pkg.worker"}),
    Case("no_python", (*STANDALONE, "--no-python"), script="shell"),
    Case("no_python_module_refused", (*STANDALONE, "--no-python", "-m"), script="shell",
         exit=Exit.BAD_INPUT, ranks=0, bad_flag=("--no-python", "-m", "--module"),
         note="torchrun raises ValueError after parsing (exit 1); compared as non-zero"),
    Case("run_path", (*STANDALONE, "--run-path"), expect={"main_module": None}),
    # -- logs: redirects, tee, filters, prefix template
    Case("redirects_3_log_dir", (*STANDALONE, "--redirects", "3", "--log-dir", "{log_dir}"),
         console=(), logs=ALL_LOGS),
    Case("redirects_1_default_dir", (*STANDALONE, "--redirects", "1"),
         console=("err0", "err1"), logs=("attempt_0/0/stdout.log", "attempt_0/1/stdout.log"),
         note="no --log-dir: torchrun logs under a temp dir, unbroken under its run dir"),
    Case("redirects_map", (*STANDALONE, "-r", "0:1,1:2", "--log-dir", "{log_dir}"),
         console=("err0", "out1"), logs=("attempt_0/0/stdout.log", "attempt_0/1/stderr.log")),
    Case("tee_3", (*STANDALONE, "--tee", "3", "--log-dir", "{log_dir}"),
         console=ALL_LINES, prefix="[default{rank}]:", logs=ALL_LOGS),
    Case("tee_prefix_template", (*STANDALONE, "-t", "3", "--log-dir", "{log_dir}"),
         env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": PREFIX_TEMPLATE},
         console=ALL_LINES, prefix="[default-{rank}]:", logs=ALL_LOGS),
    Case("local_ranks_filter", (*STANDALONE, "--tee", "3", "--local-ranks-filter", "0",
                                "--log-dir", "{log_dir}"),
         console=("out0", "err0"), prefix="[default{rank}]:", logs=ALL_LOGS),
    Case("duplicate_filters", (*STANDALONE, "--tee", "3", "--duplicate-stdout-filters", "compat",
                               "--duplicate-stderr-filters", "rank=1", "--log-dir", "{log_dir}"),
         console=ALL_LINES, prefix="[default{rank}]:",
         logs=(*ALL_LOGS, "attempt_0/filtered_stdout.log", "attempt_0/filtered_stderr.log"),
         log_has={"attempt_0/filtered_stdout.log": ("compat-stdout rank=0", "compat-stdout rank=1"),
                  "attempt_0/filtered_stderr.log": ("compat-stderr rank=1",)},
         log_lacks={"attempt_0/filtered_stderr.log": ("compat-stderr rank=0",)}),
    # -- PET_* configuration
    Case("pet_kubeflow", (),
         env={"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1", "PET_NODE_RANK": "0",
              "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "{port}",
              # what a PyTorchJob pod also holds; the launcher must override it per worker
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}", "WORLD_SIZE": "2",
              "RANK": "0", "PYTHONUNBUFFERED": "0"},
         note="TrainJob's PET_ set (a PyTorchJob without an elastic policy writes the same "
              "PET_NNODES/NPROC_PER_NODE/NODE_RANK), and the plain variables a PyTorchJob "
              "pod also holds"),
    Case("pet_no_python", STANDALONE, script="shell", env={"PET_NO_PYTHON": "1"}),
    Case("pet_elastic_one_agent", ("--rdzv-conf", "last_call_timeout=1"),
         env={"PET_NNODES": "1:2", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
              "PET_RDZV_ENDPOINT": "127.0.0.1:{port}", "PET_RDZV_ID": "pet-elastic"},
         expect={"TORCHELASTIC_RUN_ID": "pet-elastic", "GROUP_WORLD_SIZE": "1"}),
    Case("pet_flag_wins", (*STANDALONE, "--role", "trainer"),
         env={"PET_NPROC_PER_NODE": "1", "PET_ROLE": "from-pet"},
         expect={"ROLE_NAME": "trainer", "LOCAL_WORLD_SIZE": "2"}),
    # -- elastic ranges
    Case("elastic_two_agents",
         ("--nnodes", "1:2", "--nproc-per-node", "1", *C10D, "--rdzv-id", "two",
          "--rdzv-conf", "last_call_timeout=3"), agents=2,
         expect={"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "{rank}", "LOCAL_RANK": "0",
                 "TORCHELASTIC_RUN_ID": "two"}),
    Case("elastic_one_agent",
         ("--nnodes", "1:2", "--nproc-per-node", "2", *C10D, "--rdzv-id", "one",
          "--rdzv-conf", "last_call_timeout=1"),
         expect={"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}),
    # -- bad input
    Case("unknown_flag", (*STANDALONE, "--no-such-flag"), exit=Exit.USAGE, ranks=0,
         bad_flag=("--no-such-flag",)),
    Case("nnodes_reversed", ("--nnodes", "3:1"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("--nnodes",), note="torchrun: AssertionError (exit 1)"),
    Case("nnodes_zero", ("--nnodes", "0:2"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("--nnodes",), note="torchrun: AssertionError (exit 1)"),
    Case("nnodes_not_numbers", ("--nnodes", "a:b"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("--nnodes",), note="torchrun: ValueError (exit 1)"),
    Case("redirects_bad_map", (*STANDALONE, "-r", "0:9"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("-r", "--redirects"), note="torchrun: ValueError (exit 1)"),
]

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


def _run(launcher: str, case: Case, home: Path) -> Outcome:
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
    procs, streams = [], []
    try:
        for i in range(case.agents):
            so = open(home / f"agent{i}.stdout", "w+b")  # noqa: SIM115
            se = open(home / f"agent{i}.stderr", "w+b")  # noqa: SIM115
            streams += [so, se]
            procs.append(subprocess.Popen(cmd, cwd=home, env=env, stdout=so, stderr=se,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_groups(procs)
                raise AssertionError(f"[{launcher}] {case.name}: not done within "
                                     f"{RUN_TIMEOUT:.0f}s: {' '.join(cmd)}\n"
                                     f"{(home / 'agent0.stderr').read_text(errors='replace')[-3000:]}"
                                     ) from None
    finally:
        for s in streams:
            s.close()
    text = {name: "".join((home / f"agent{i}.{name}").read_text(errors="replace")
                          for i in range(case.agents)) for name in ("stdout", "stderr")}
    files = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    return Outcome(launcher, cmd, [p.returncode for p in procs], text["stdout"], text["stderr"],
                   home, out, files)


# -- what one launcher's outcome must show


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
    assert re.search(r"^\s*exitcode\s*:\s*1\b", block, re.M), block
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
    reference = _run("torchrun", case, tmp_path / "torchrun")
    _check(reference, case)
    ours = _run("unbroken", case, tmp_path / "unbroken")
    _check(ours, case)
    _compare(reference, ours, case)


def test_the_table_covers_the_issue() -> None:
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)
    flags = {a for c in CASES for a in c.args}
    for flag in ("--standalone", "--nproc_per_node", "--max-restarts", "-m", "--no-python",
                 "--run-path", "--redirects", "-r", "--tee", "-t", "--log-dir",
                 "--local-ranks-filter", "--role", "--virtual-local-rank", "--nnodes"):
        assert flag in flags, flag
    assert any(c.agents == 2 for c in CASES)
    assert any(k.startswith("PET_") for c in CASES for k in c.env)


# -- torchrun's own parser: every flag a newer torch adds shows up here as a failure


def _torch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _unbroken_run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


# A sensible value per torchrun flag (dest); a flag a newer torch adds falls back below.
SAMPLE = {"nnodes": "1:2", "nproc_per_node": "2", "rdzv_backend": "c10d",
          "rdzv_endpoint": "127.0.0.1:29400", "rdzv_id": "job7",
          "rdzv_conf": "join_timeout=60,last_call_timeout=1", "max_restarts": "2",
          "monitor_interval": "0.5", "event_log_handler": "null", "role": "trainer",
          "log_dir": "logs", "redirects": "0:1,1:2", "tee": "3", "local_ranks_filter": "0,1",
          "duplicate_stdout_filters": "loss,step", "duplicate_stderr_filters": "error",
          "node_rank": "0", "master_addr": "127.0.0.1", "master_port": "29501",
          "local_addr": "127.0.0.1", "signals_to_handle": "SIGTERM,SIGUSR1",
          "shutdown_timeout": "5", "logs_specs": "default"}


def _sample(action: argparse.Action) -> list[str]:
    if not _takes_value(action):
        return []
    if action.dest in SAMPLE:
        return [SAMPLE[action.dest]]
    if action.choices:
        return [next((c for c in action.choices if c != action.default), action.default)]
    if action.type is int:
        return ["1"]
    if action.type is float:
        return ["0.5"]
    if isinstance(action.default, str) and action.default:
        return [action.default]
    return ["x"]


def _torch_options() -> list[tuple[str, argparse.Action]]:
    return [(opt, a) for a in _torch_parser()._actions if not isinstance(a, argparse._HelpAction)
            for opt in a.option_strings]


@pytest.fixture
def no_pet(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("option,action",
                         [pytest.param(opt, a, id=opt) for opt, a in _torch_options()])
def test_every_torchrun_option_is_accepted(option: str, action: argparse.Action, no_pet, capsys):
    run = _unbroken_run_parser()
    ours = run._option_string_actions.get(option)
    assert ours is not None, f"`unbroken run` has no {option} (torchrun has it)"
    assert _takes_value(ours) == _takes_value(action), (
        f"{option} takes a value under {'torchrun' if _takes_value(action) else 'unbroken'} only")
    argv = ["run", option, *_sample(action), "train.py", "--lr", "1"]
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`unbroken {' '.join(argv)}` was refused: {capsys.readouterr().err}")
    assert args.script == "train.py" and args.script_args == ["--lr", "1"], vars(args)


def test_no_unbroken_option_shadows_a_torchrun_abbreviation() -> None:
    """argparse lets torchrun read `--redirect 3` as `--redirects 3`; an unbroken option of
    that name with another arity (a boolean --redirect) would read `3` as the script."""
    torch_opts = dict(_torch_options())
    for option, ours in _unbroken_run_parser()._option_string_actions.items():
        if option in torch_opts or not option.startswith("--"):
            continue
        meant = {id(a): a for t, a in torch_opts.items() if t.startswith(option)}
        if len(meant) == 1:
            (theirs,) = meant.values()
            assert _takes_value(ours) == _takes_value(theirs), (
                f"unbroken's {option} takes {'a' if _takes_value(ours) else 'no'} value; "
                f"torchrun reads {option} as {max(theirs.option_strings, key=len)}")


@pytest.mark.parametrize("option,action",
                         [pytest.param(a.option_strings[0], a, id=a.option_strings[0])
                          for a in _torch_parser()._actions
                          if type(a).__name__ in ("env", "check_env")])
def test_every_pet_variable_sets_its_flag(option: str, action: argparse.Action, no_pet):
    """torchrun reads PET_<DEST> as the default of every flag of its `env`/`check_env`
    actions; unbroken reads the same variable to the same effect."""
    value = _sample(action)
    by_flag = vars(_build_parser().parse_args(["run", option, *value, "train.py"]))
    no_pet.setenv(f"PET_{action.dest.upper()}", value[0] if value else "1")
    by_env = vars(_build_parser().parse_args(["run", "train.py"]))
    assert by_env == by_flag, f"PET_{action.dest.upper()} differs from {option}"
