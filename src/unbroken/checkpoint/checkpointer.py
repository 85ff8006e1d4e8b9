"""Synchronous, atomic DCP checkpoints: save into a temporary directory, commit by rename.

Layout under the checkpoint directory:
    step_000000040/         a committed checkpoint: DCP files plus manifest.json
    .tmp-step_000000050-a1/ a save in progress (or torn by a crash); never loaded

`save` and `load_latest` are collective over `group`, a process group of their own so
checkpoint traffic never queues behind (or deadlocks with) the training collectives. The
interface (`save(state, step)`, `load_latest(state)`) is what the async checkpointer keeps.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from unbroken.checkpoint.manifest import fsync_path, verify_manifest, write_manifest
from unbroken.checkpoint.safe_reader import (
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_metadata,
)
from unbroken.errors import CheckpointMismatch

_COMMITTED = re.compile(r"^step_(\d{9})$")
# DCP warns on every single-process save/load; a single process is a supported use here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def committed_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _COMMITTED.match(p.name))]
    return sorted(found, reverse=True)


def _tensor_leaves(state: Any, prefix: str = "") -> dict[str, torch.Size]:
    if isinstance(state, torch.Tensor):
        return {prefix: state.shape}
    if isinstance(state, dict):
        out: dict[str, torch.Size] = {}
        for key, value in state.items():
            out.update(_tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {}


def check_fits(state: dict[str, Any], checkpoint: Path) -> None:
    """Raise CheckpointMismatch naming the keys and shapes that differ."""
    metadata = load_metadata(checkpoint / ".metadata")
    saved = {k: v.size for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    ours = _tensor_leaves(state)
    missing = sorted(k for k in ours if k not in saved)
    unexpected = sorted(k for k in saved if k not in ours and k.split(".")[0] in state)
    shapes = sorted(f"{k}: checkpoint {tuple(saved[k])} vs model {tuple(ours[k])}"
                    for k in ours if k in saved and tuple(saved[k]) != tuple(ours[k]))
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"shapes differ for {', '.join(shapes[:5])}")
        if missing:
            parts.append(f"not in checkpoint: {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"not in model: {', '.join(unexpected[:5])}")
        raise CheckpointMismatch(f"checkpoint {checkpoint} does not fit the model: " + "; ".join(parts))


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        group: dist.ProcessGroup | None = None,
        keep: int = 3,
        attempt: int = 0,
        record: Callable[..., Any] | None = None,
        clean_stale: bool = True,
    ) -> None:
        """`clean_stale`: remove torn saves of earlier attempts (rank 0 only). A replacement
        joining a running job must not: the survivors may be saving right now."""
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = Path(directory)
        self.group = group
        self.keep = keep
        self.attempt = attempt
        self.record = record or (lambda *a, **k: None)
        self.tag = f"a{attempt}"  # names this writer's temporary directories
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.rank == 0 and clean_stale:
            for stale in self.directory.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)

    @property
    def rank(self) -> int:
        """This process's rank now: in-place recovery renumbers ranks between generations."""
        return dist.get_rank() if dist.is_initialized() else 0

    def use_group(self, group: dist.ProcessGroup | None, generation: int) -> None:
        """Checkpoint over a new generation's group; its saves get temporary dirs of their own."""
        self.group = group
        self.tag = f"a{self.attempt}g{generation}"

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write `state` as the checkpoint of `step`; returns once it is committed everywhere."""
        t0 = time.monotonic()
        name = f"step_{step:09d}"
        tmp = self.directory / f".tmp-{name}-{self.tag}"
        final = self.directory / name
        tmp.mkdir(parents=True, exist_ok=True)
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True),
                 process_group=self.group, no_dist=not dist.is_initialized())
        if self.rank == 0:
            write_manifest(tmp, step, {"attempt": self.attempt})
            if final.exists():  # the same step saved by an earlier attempt
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(self.directory)
            for torn in self.directory.glob(f".tmp-{name}-*"):  # a save a fault interrupted
                shutil.rmtree(torn, ignore_errors=True)
            self._retain()
        self._barrier()
        nbytes = sum(f.stat().st_size for f in final.iterdir()) if self.rank == 0 else None
        self.record("checkpoint_saved", step=step, path=str(final), bytes=nbytes,
                    duration=round(time.monotonic() - t0, 6))
        return final

    def _retain(self) -> None:
        for _, path in committed_checkpoints(self.directory)[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)

    def _choose(self) -> Path | None:
        """Rank 0 picks the newest intact checkpoint; every rank gets the same answer."""
        choice = torch.tensor([-1], dtype=torch.int64)
        if self.rank == 0:
            for step, path in committed_checkpoints(self.directory):
                reason = verify_manifest(path)
                if reason is None:
                    choice[0] = step
                    break
                self.record("checkpoint_invalid", step=step, path=str(path), reason=reason)
        if dist.is_initialized():
            dist.broadcast(choice, src=0, group=self.group)
        step = int(choice[0])
        return self.directory / f"step_{step:09d}" if step >= 0 else None

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest intact checkpoint into `state` in place; its step, or None if none."""
        t0 = time.monotonic()
        path = self._choose()
        if path is None:
            return None
        try:
            check_fits(state, path)
            dcp.load(state, storage_reader=SafeFileSystemReader(path),
                     process_group=self.group, no_dist=not dist.is_initialized())
        except UnsafeCheckpointError as exc:
            raise CheckpointMismatch(f"refusing to load {path}: {exc}") from None
        step = int(path.name.removeprefix("step_"))
        self.record("checkpoint_loaded", step=step, path=str(path),
                    duration=round(time.monotonic() - t0, 6))
        return step
