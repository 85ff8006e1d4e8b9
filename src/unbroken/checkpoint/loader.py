"""Loading: the newest checkpoint that verifies, into the live state, tensors only.

Rank 0 checks manifests newest first (every file's size and SHA-256) and reports each one it
skips; all ranks then load the same one through DCP, which reshards to the current world
size. A checkpoint that does not fit the model is refused with the names and shapes that
differ, before anything is overwritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from unbroken.checkpoint.layout import committed_checkpoints, step_name
from unbroken.checkpoint.manifest import verify_manifest
from unbroken.checkpoint.safe_reader import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_metadata,
)
from unbroken.errors import CheckpointMismatch, first_line
from unbroken.telemetry import schema as ev


def dcp_failures(exc: CheckpointException) -> dict[int, BaseException]:
    """rank -> exception inside DCP's CheckpointException (which is a BaseException)."""
    found = {}
    for rank, failure in exc.failures.items():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            found[rank] = inner
    return found


def describe_dcp_failure(exc: CheckpointException) -> str:
    ranks = [f"rank {r}: {first_line(i)}" for r, i in dcp_failures(exc).items()]
    return "; ".join(ranks[:3]) or "DCP failed"


def _tensor_leaves(state: Any, prefix: str = "") -> dict[str, torch.Size]:
    if isinstance(state, torch.Tensor):
        return {prefix: state.shape}  # a DTensor's is the global shape, as saved
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


def choose(directory: Path, rank: int, group: dist.ProcessGroup | None,
           record: ev.Emit) -> Path | None:
    """Rank 0 picks the newest intact checkpoint; every rank gets the same answer."""
    choice = torch.tensor([-1], dtype=torch.int64)
    if rank == 0:
        for step, path in committed_checkpoints(directory):
            reason = verify_manifest(path)
            if reason is None:
                choice[0] = step
                break
            record(ev.CheckpointInvalid(step=step, path=str(path), reason=reason))
    if dist.is_initialized():
        dist.broadcast(choice, group=group, group_src=0)
    step = int(choice[0])
    return directory / step_name(step) if step >= 0 else None


def load_into(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    try:
        check_fits(state, path)
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                 process_group=group, no_dist=not dist.is_initialized())
    except UnsafeCheckpointError as exc:
        raise CheckpointMismatch(f"refusing to load {path}: {exc}") from None
    except CheckpointException as exc:  # raised on some rank inside DCP: on every rank now
        for inner in dcp_failures(exc).values():
            if isinstance(inner, UnsafeCheckpointError):
                raise CheckpointMismatch(f"refusing to load {path}: {inner}") from None
        raise
