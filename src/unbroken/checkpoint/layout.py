"""Where checkpoints live in their directory, which count as committed, which to keep.

    step_000000040/         committed: DCP files plus manifest.json (the commit marker)
    .tmp-step_000000050-a1/ a save in progress, or torn by a crash; never loaded

A save is written into a temporary directory and renamed into place by rank 0 only after
every rank's files are durable and the manifest naming them is; the rename is the commit.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_COMMITTED = re.compile(r"^step_(\d{9})$")


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def temporary_dir(directory: Path, step: int, tag: str) -> Path:
    return directory / f".tmp-{step_name(step)}-{tag}"


def committed_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _COMMITTED.match(p.name))]
    return sorted(found, reverse=True)


def remove_torn(directory: Path, step: int | None = None) -> None:
    """Remove temporary directories: of one step, or all of them."""
    pattern = f".tmp-{step_name(step)}-*" if step is not None else ".tmp-step_*"
    for torn in directory.glob(pattern):
        shutil.rmtree(torn, ignore_errors=True)


def to_delete(steps: list[int], keep: int, keep_every: int | None) -> list[int]:
    """Retention: keep the newest `keep`, and every step that is a multiple of `keep_every`."""
    newest = sorted(steps, reverse=True)
    return [s for s in newest[keep:] if not (keep_every and s % keep_every == 0)]


def retain(directory: Path, keep: int, keep_every: int | None) -> list[int]:
    committed = dict(committed_checkpoints(directory))
    doomed = to_delete(list(committed), keep, keep_every)
    for step in doomed:
        shutil.rmtree(committed[step], ignore_errors=True)
    return doomed
