"""The framework releases we claim, each installed as a user would, with the framework tests.

Protection is decided by behaviour (`integrations/hf_seams.py`, `update_order.py`,
`lightning_seams._LIVE`), so a release the matrix never saw is still protected if it behaves. The
range we *declare* (pyproject.toml's `hf` and `lightning` extras, the README) is exactly the
matrix's green cells.

Each cell is a framework version with a companion (transformers with the newest and the
oldest Accelerate it allows; Lightning alone). For each cell this script:

1. makes a venv at `<root>/<cell>` whose own site-packages come first and, after them, this
   checkout's `.venv` *without the frameworks and what they import optionally* (`HIDDEN`:
   a folder of links to every other entry of the `.venv`'s site-packages, added by a `.pth`
   line, `site.addsitedir`), so torch 2.13.0, the project (editable) and the test tools are
   the `.venv`'s, and the frameworks, their hub, tokenizers and kernels are what the cell's
   own install brings, as on a user's machine (the `.venv`'s `kernels` 0.19 broke
   transformers 5.0's import: not the user's case);
2. `pip install`s the cell's versions there (pip sees the `.venv`'s torch as installed and
   keeps it) with what they need (the hub, tokenizers, safetensors: the versions pip picks
   for that release) and checks what `importlib.metadata` then gives;
3. runs the cell's tests with that venv's python (its workers too: `sys.executable`), in a
   clone of the checkout's HEAD made for the run (its `src` first on PYTHONPATH: an edit of
   the working tree during a run of half an hour changes nothing), for
   transformers the seams, the update order and the canary (unit: the golden trace is
   compared on the pinned release, the order on every one), a Trainer job killed and
   recovered in place bit-identical (under `--on-fault wait` and with torchrun's flags
   alone), and one killed before its spare was ready; for Lightning its in-place test.

The last line printed is one JSON object `{cell: {installed, passed, failed, seconds,
error}}`. Exit status 0 only when every cell is green. Not for CI (each cell installs from
the package index and runs real jobs: about 2 minutes a cell here); run it when a release
comes out or the claimed range changes:

    .venv/bin/python benchmarks/framework_matrix.py                         # every cell
    .venv/bin/python benchmarks/framework_matrix.py --cells transformers-5.25.0+accelerate-1.16.0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
import venv
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HF_TESTS = [
    "tests/unit/test_hf_integration.py", "tests/unit/test_update_order.py",
    "tests/unit/test_trainer_canary.py",
    "tests/integration/test_hf_trainer.py::"
    "test_a_trainer_job_recovers_in_place_and_ends_bit_identical_to_a_fault_free_run",
    "tests/integration/test_hf_trainer.py::"
    "test_a_trainer_job_killed_before_its_spare_is_ready_waits_and_ends_bit_identical",
    "tests/integration/test_trl.py::test_an_sft_trainer_job_recovers_in_place",
]
LIGHTNING_TESTS = [
    "tests/integration/test_lightning.py::"
    "test_a_lightning_fit_recovers_in_place_and_ends_bit_identical_to_a_fault_free_run",
]
PYTORCH_LIGHTNING_TESTS = [
    "tests/integration/test_lightning.py::"
    "test_the_standalone_pytorch_lightning_package_recovers_in_place_bit_identical",
]

# transformers releases: the oldest wished for, the last 4.x, the first 5.x, the pinned
# one's predecessor and the pinned (newest) one; each with Accelerate's newest and the
# oldest that release allows (its own `accelerate>=` requirement), and TRL unpinned: pip
# picks the newest TRL that declares it runs with that transformers (TRL's test then runs).
TRANSFORMERS = ["4.46.3", "4.57.6", "5.0.0", "5.24.0", "5.25.0"]
ACCELERATE_NEWEST = "1.16.0"
ACCELERATE_OLDEST = {"4.46.3": "0.26.0", "4.57.6": "0.26.0", "5.0.0": "1.1.0",
                     "5.24.0": "1.1.0", "5.25.0": "1.1.0"}
LIGHTNING = ["2.4.0", "2.5.0", "2.6.6"]
PYTORCH_LIGHTNING = ["2.4.0", "2.6.6"]
"""The standalone package, each beside `lightning` of the same release (the test compares
with a fault-free run on `lightning`)."""


HIDDEN = ("transformers", "accelerate", "kernels", "huggingface_hub", "tokenizers",
          "datasets", "trl", "safetensors", "lightning", "pytorch_lightning",
          "lightning_fabric", "lightning_utilities", "torchmetrics", "deepspeed", "peft",
          "hf_xet")
"""Packages of the `.venv` a cell does not see (each as installed: its modules and its
dist-info): the cell's pip install brings what its release needs."""


def _hidden(entry: str) -> bool:
    """`entry` of a site-packages folder is one of `HIDDEN`'s (a package or its dist-info)."""
    return entry.split("-")[0].lower() in HIDDEN


@dataclass
class Cell:
    name: str
    pins: list[str]
    tests: list[str]


@dataclass
class Outcome:
    installed: dict[str, str]
    passed: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None


def cells() -> list[Cell]:
    out = []
    for version in TRANSFORMERS:
        for accelerate in dict.fromkeys([ACCELERATE_NEWEST, ACCELERATE_OLDEST[version]]):
            out.append(Cell(f"transformers-{version}+accelerate-{accelerate}",
                            [f"transformers=={version}", f"accelerate=={accelerate}", "trl"],
                            HF_TESTS))
    for version in LIGHTNING:
        out.append(Cell(f"lightning-{version}", [f"lightning=={version}"], LIGHTNING_TESTS))
    for version in PYTORCH_LIGHTNING:
        out.append(Cell(f"pytorch_lightning-{version}",
                        [f"lightning=={version}", f"pytorch-lightning=={version}"],
                        PYTORCH_LIGHTNING_TESTS))
    return out


def make_venv(path: Path) -> Path:
    """A venv whose site-packages come first and the checkout's .venv after; its python."""
    python = path / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(path)
        own = Path(subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True).strip())
        base = Path(sysconfig.get_paths(vars={"base": str(REPO / ".venv"),
                                               "platbase": str(REPO / ".venv")})["purelib"])
        shared = path / "shared-site"
        shared.mkdir()
        for entry in base.iterdir():
            if not _hidden(entry.name):
                (shared / entry.name).symlink_to(entry)
        (own / "zz_unbroken_venv.pth").write_text(f"import site; site.addsitedir({str(shared)!r})\n")
    return python


def installed(python: Path, names: list[str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    return json.loads(subprocess.check_output([str(python), "-c", code, *names], text=True))


def snapshot(root: Path) -> Path:
    """A clone of this checkout's HEAD under `root` (made once per commit): what the cells
    test."""
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                   text=True).strip()
    clone = root / f"checkout-{head}"
    if not clone.exists():
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", head], cwd=clone, check=True)
    return clone


def run_cell(cell: Cell, root: Path, checkout: Path) -> Outcome:
    t0 = time.monotonic()
    python = make_venv(root / cell.name)
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *cell.pins],
                         capture_output=True, text=True, env=env)
    names = [p.split("==")[0] for p in cell.pins] + ["torch"]
    if pip.returncode != 0:
        return Outcome({}, error=f"pip: {pip.stderr.strip().splitlines()[-1:]}",
                       seconds=round(time.monotonic() - t0, 1))
    got = installed(python, names)
    want = {p.split("==")[0]: p.split("==")[1] for p in cell.pins if "==" in p}
    if any(got[n] != v for n, v in want.items()) or not got["torch"].startswith("2.13"):
        return Outcome(got, error=f"installed {got}, not {want} on torch 2.13",
                       seconds=round(time.monotonic() - t0, 1))
    test_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(checkout / "src"), os.environ.get("PYTHONPATH")]))}
    outcome = Outcome(got)
    # The unit tests first: a release without the seams trains unprotected, and its jobs
    # are not run (they would only show that it restarts, as under torchrun).
    for tier in ("unit", "integration"):
        tests = [t for t in cell.tests if t.startswith(f"tests/{tier}/")]
        if not tests or outcome.error is not None:
            continue
        report = root / f"{cell.name}-{tier}.xml"
        test = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *tests], cwd=checkout,
                              capture_output=True, text=True, env=test_env)
        if report.exists():
            suite = ET.parse(report).getroot().find("testsuite")
            bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            outcome.passed += int(suite.get("tests", 0)) - bad - int(suite.get("skipped", 0))
            outcome.failed += bad
        if test.returncode != 0:
            tail = [ln for ln in test.stdout.splitlines()
                    if ln.startswith(("FAILED", "ERROR", "E "))]
            outcome.error = f"{tier}: " + ("; ".join(tail[:3])
                                           or test.stdout.strip().splitlines()[-1:][0])
    outcome.seconds = round(time.monotonic() - t0, 1)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/unbroken-framework-matrix"),
                        help="where the cells' venvs go (reused when there)")
    parser.add_argument("--cells", nargs="*", help="cell names (default: every cell)")
    args = parser.parse_args()
    chosen = [c for c in cells() if not args.cells or c.name in args.cells]
    if args.cells and len(chosen) != len(args.cells):
        known = ", ".join(c.name for c in cells())
        parser.error(f"unknown cell among {args.cells}; the cells are: {known}")
    args.root.mkdir(parents=True, exist_ok=True)
    checkout = snapshot(args.root)
    print(f"testing {checkout.name}", flush=True)
    results = {}
    for cell in chosen:
        outcome = run_cell(cell, args.root, checkout)
        results[cell.name] = asdict(outcome)
        state = "green" if outcome.error is None and outcome.failed == 0 else "RED"
        print(f"{cell.name:48} {state:5} passed {outcome.passed} failed {outcome.failed} "
              f"{outcome.seconds:7.1f}s {outcome.error or ''}", flush=True)
    print(json.dumps(results))
    return 0 if all(r["error"] is None and r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
