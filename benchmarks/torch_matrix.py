"""The torch versions we claim, installed the way a user installs them, with a smoke run each.

pyproject.toml claims `torch>=2.13,<2.16`. For each version asked for (by default the oldest
claimed, 2.13.0, and the newest release, 2.15.0) this script:

1. makes a venv at `<root>/<version>` (reused when it is there; `--fresh` makes it anew) and
   upgrades its pip;
2. installs `torch==<version>` FIRST, alone, and prints its `torch.__version__`;
3. installs this checkout into it, `pip install -e ".[dev]"`, as a user who has torch does;
4. prints `torch.__version__` again, and fails loudly unless installing the project KEPT the
   torch that was there: the same version string (local label included: 2.13.0+cpu must not
   become 2.13.0) and no `Uninstalling torch-` in pip's output;
5. runs a smoke subset of the test suite with that venv's python: in-place recovery, FSDP2 in
   place, a checkpoint round trip, torchrun parser parity. Tests are chosen by name with
   `pytest tests -k` (not by path: the files may move between tests/ subfolders); every name
   must select at least one test, or the version fails. `-k` matches substrings, so a test
   whose name extends one of these runs too (`..._sets_its_flag_and_the_command_line_wins`),
   and the parametrized parity tests count one case per torchrun option (~90 cases in all).

Editable, not a wheel: the smoke tests are meant to exercise this checkout as it is, and
an editable install resolves the same dependencies (the question "is torch kept?" has the
same answer), without copying src/ into each venv where it would go stale between runs.

Contract: each version line says `installed` (torch.__version__ after step 2), `kept torch`,
and the passed/failed counts; the last line printed is one JSON object
`{version: {installed, kept_torch, passed, failed, seconds, error}}` (`error` is null or a
one-line reason). Exit status 0 only when every version installed, kept its torch and passed
every smoke test.

pip's constraints: every pip in a matrix venv runs with PIP_CONSTRAINT=/dev/null, so a
machine-wide constraints file (one here caps torch<=2.14.1) neither blocks a newer torch nor
makes the project's install swap the torch that is there for an older one (under that file
`pip install -e .` in a venv with torch 2.15.0 would install 2.14.1: checked with --dry-run).
An empty PIP_CONSTRAINT does not lift the cap (pip 23.2 and 26.3 here); /dev/null does.
Other pip settings (index, --find-links) come from pip's own configuration.

Not for CI: a CUDA build of torch (what the index serves for 2.15.0) is ~5 GB of wheels and
minutes to install per version; run it by hand when the claimed range changes:

    .venv/bin/python benchmarks/torch_matrix.py                     # 2.13.0 and 2.15.0
    .venv/bin/python benchmarks/torch_matrix.py --versions 2.14.1 --fresh
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What each smoke test stands for; selected by function name wherever it lives under tests/.
SMOKE: dict[str, str] = {
    "test_sigkill_at_a_random_step_survivors_keep_their_processes": "in-place recovery",
    "test_fsdp_rank_killed_a_spare_takes_its_shard_from_the_buddy_in_place": "FSDP2 in place",
    "test_save_load_roundtrip_and_retention": "checkpoint round trip",
    "test_every_torchrun_option_is_accepted": "torchrun parser parity",
    "test_every_pet_variable_sets_its_flag": "torchrun parser parity (PET_ variables)",
    "test_no_unbroken_option_shadows_a_torchrun_abbreviation": "torchrun parser parity (abbreviations)",
}


class MatrixError(Exception):
    """A version could not be set up or checked; the message is one line."""


@dataclass(frozen=True)
class MatrixConfig:
    """What to run. `versions` are exact torch releases (`torch==v`); each gets a venv at
    `root/v`, made with `python -m venv` from `python`. `tests` are pytest function names."""

    versions: tuple[str, ...] = ("2.13.0", "2.15.0")
    root: Path = Path("/tmp/unbroken-torch-matrix")
    python: str = sys.executable
    fresh: bool = False
    tests: tuple[str, ...] = tuple(SMOKE)
    extras: str = "dev"
    install_timeout_s: float = 1800.0
    test_timeout_s: float = 1200.0


@dataclass
class VersionResult:
    """One version's outcome. `installed` is torch.__version__ after torch was installed
    (None if that failed); `kept_torch` whether installing the project left it as it was."""

    installed: str | None = None
    kept_torch: bool | None = None
    passed: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None
    failed_tests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.kept_torch is True and self.failed == 0


def _pip_env(venv: Path) -> dict[str, str]:
    """The environment for anything run in `venv`: its bin first, no machine-wide pip
    constraints, nothing of the venv this script runs from."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PIP_CONSTRAINT"] = "/dev/null"
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout: float, what: str) -> str:
    """Run `cmd` from the repo root with its output in `log`; return that output.
    Raises MatrixError (naming the log) when it fails or outlives `timeout`."""
    print(f"  $ {' '.join(cmd)}   (log: {log})", flush=True)
    with log.open("w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise MatrixError(f"{what} took over {timeout:.0f}s; see {log}") from None
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
        raise MatrixError(f"{what} failed (exit {proc.returncode}): {last.strip()} [{log}]")
    return text


def _torch_version(venv: Path, env: dict[str, str]) -> str:
    """torch.__version__ as the venv's python imports it (not its metadata: it must import)."""
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, env=env, cwd="/", check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MatrixError(f"torch does not import in {venv}: {last}")
    return proc.stdout.strip()


def _make_venv(cfg: MatrixConfig, venv: Path, env: dict[str, str]) -> None:
    """Make (or, with cfg.fresh, remake) the venv and bring its pip up to date."""
    if cfg.fresh and venv.exists():
        shutil.rmtree(venv)
    if not (venv / "bin" / "python").exists():
        subprocess.run([cfg.python, "-m", "venv", str(venv)], check=True)
    (venv / "logs").mkdir(exist_ok=True)
    _run_logged([str(venv / "bin" / "python"), "-m", "pip", "install", "--upgrade", "pip"],
                venv / "logs" / "pip-upgrade.log", env, cfg.install_timeout_s, "upgrading pip")


def _count(junit: Path, names: tuple[str, ...], result: VersionResult) -> None:
    """Fill passed/failed from pytest's JUnit XML; a name that selected no test is an error."""
    seen = dict.fromkeys(names, 0)
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        base = name.split("[", 1)[0]
        if base in seen:
            seen[base] += 1
        if case.find("skipped") is not None:
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed += 1
            result.failed_tests.append(f"{case.get('classname', '')}::{name}")
        else:
            result.passed += 1
    missing = [n for n, count in seen.items() if count == 0]
    if missing:
        raise MatrixError(f"no test is named {', '.join(missing)} (renamed?)")


def run_version(cfg: MatrixConfig, version: str) -> VersionResult:
    """Install torch==version, then the project, check torch was kept, run the smoke tests.
    Never raises for a problem of the version: it is reported in the result's `error`."""
    result = VersionResult()
    start = time.monotonic()
    venv = cfg.root / version
    env = _pip_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    try:
        cfg.root.mkdir(parents=True, exist_ok=True)
        _make_venv(cfg, venv, env)
        logs = venv / "logs"
        _run_logged([*pip, f"torch=={version}"], logs / "pip-torch.log", env,
                    cfg.install_timeout_s, f"installing torch=={version}")
        result.installed = before = _torch_version(venv, env)
        print(f"  torch before the project: {before}", flush=True)
        if before.split("+", 1)[0] != version:
            raise MatrixError(f"asked for torch=={version}, the venv has {before}")
        text = _run_logged([*pip, "-e", f"{REPO}[{cfg.extras}]"], logs / "pip-project.log", env,
                           cfg.install_timeout_s, "installing the project")
        after = _torch_version(venv, env)
        print(f"  torch after the project:  {after}", flush=True)
        result.kept_torch = after == before and "Uninstalling torch-" not in text
        if not result.kept_torch:
            raise MatrixError(f"installing the project replaced torch {before} with {after}")
        junit = logs / "smoke.xml"
        expr = " or ".join(cfg.tests)
        cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--durations=8", "tests", "-k", expr, f"--junitxml={junit}"]
        print(f"  $ {' '.join(cmd[:-3])} -k '{expr}'", flush=True)
        junit.unlink(missing_ok=True)
        with (logs / "pytest.log").open("w") as out:
            try:
                proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=cfg.test_timeout_s,
                                      check=False, stdout=out, stderr=subprocess.STDOUT)
            except subprocess.TimeoutExpired:
                raise MatrixError(f"the smoke tests took over {cfg.test_timeout_s:.0f}s") from None
        if not junit.exists():
            raise MatrixError(f"pytest wrote no report (exit {proc.returncode}); see {logs / 'pytest.log'}")
        _count(junit, cfg.tests, result)
        if proc.returncode not in (0, 1):  # 1: some tests failed, counted above
            raise MatrixError(f"pytest exited {proc.returncode}; see {logs / 'pytest.log'}")
    except (MatrixError, subprocess.CalledProcessError, OSError, ET.ParseError) as e:
        result.error = str(e)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def _line(version: str, r: VersionResult) -> str:
    kept = {True: "yes", False: "NO", None: "-"}[r.kept_torch]
    line = (f"torch {version}: installed {r.installed or '-'}, kept torch: {kept}, "
            f"{r.passed} passed, {r.failed} failed, {r.seconds:.0f} s")
    if r.failed_tests:
        line += f"; failed: {', '.join(r.failed_tests)}"
    if r.error:
        line += f"; ERROR: {r.error}"
    return line


def main(argv: list[str] | None = None) -> int:
    default = MatrixConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="+", default=list(default.versions),
                    help="exact torch releases (default: %(default)s)")
    ap.add_argument("--root", type=Path, default=default.root, help="venvs go in ROOT/VERSION")
    ap.add_argument("--python", default=default.python, help="the interpreter to make venvs from")
    ap.add_argument("--fresh", action="store_true", help="remake each venv instead of reusing it")
    ap.add_argument("-k", dest="tests", nargs="+", default=list(default.tests),
                    help="test function names to run (default: the smoke set)")
    a = ap.parse_args(argv)
    cfg = MatrixConfig(versions=tuple(a.versions), root=a.root, python=a.python, fresh=a.fresh,
                       tests=tuple(a.tests))
    results: dict[str, VersionResult] = {}
    for version in cfg.versions:
        print(f"== torch {version} in {cfg.root / version}", flush=True)
        results[version] = r = run_version(cfg, version)
        if r.kept_torch is False:
            print(f"torch_matrix: {version}: FAILED: {r.error}", file=sys.stderr, flush=True)
    print()
    for version, r in results.items():
        print(_line(version, r))
    summary = {v: {k: x for k, x in asdict(r).items() if k != "failed_tests"}
               for v, r in results.items()}
    print(json.dumps(summary))
    return 0 if all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
