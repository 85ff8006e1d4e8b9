"""Loading: the newest checkpoint that verifies, into the live state, tensors only.

Rank 0 checks manifests newest first (every file's size and checksum) and reports each one it
skips; all ranks then load the same one through DCP, which reshards to the current world
size. Where some intact checkpoint is marked verified (its replicas agreed), newer ones marked
unverified (their replicas disagreed: silent data corruption) are passed over too (`choose`).
A checkpoint that does not fit the model is refused with the names and shapes that differ,
before anything is overwritten.
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
from unbroken.checkpoint.manifest import manifest_verified, verify_manifest
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


UNVERIFIED = "unverified: its replicas disagreed (silent data corruption)"


def choose(directory: Path, rank: int, group: dist.ProcessGroup | None,
           record: ev.Emit) -> Path | None:
    """Rank 0 picks the checkpoint to load; every rank gets the same answer (collective).

    The newest intact one (its files as its manifest says), unless some intact checkpoint
    is marked verified (`"verified": true` in its manifest: the data-parallel replicas'
    checksums agreed at its step). Then it is the newest intact one not marked unverified
    (`false`: they disagreed, silent data corruption), and each newer one marked unverified
    that it passes over is reported (`checkpoint_invalid`, reason `UNVERIFIED`). When none
    is marked verified (no replica checks ran, manifests older than the mark, or every
    verified one is damaged) an unverified one is loaded as any other: it may be all there is.
    Each checkpoint found damaged is reported (`checkpoint_invalid`, the reason); passed-over
    unverified ones are not checked.
    """
    choice = torch.tensor([-1], dtype=torch.int64)
    if rank == 0:
        step = _pick(committed_checkpoints(directory), record)
        if step is not None:
            choice[0] = step
    if dist.is_initialized():
        dist.broadcast(choice, group=group, group_src=0)
    step = int(choice[0])
    return directory / step_name(step) if step >= 0 else None


def _pick(checkpoints: list[tuple[int, Path]], record: ev.Emit) -> int | None:
    """`choose`'s rule over `checkpoints` (newest first). Verifies a checkpoint's files only
    when they decide the answer, each at most once: with no mark, or all marked verified,
    as few as before marks existed."""
    marks = {step: manifest_verified(path) for step, path in checkpoints}
    checked: dict[int, bool] = {}

    def intact(step: int, path: Path) -> bool:
        if step not in checked:
            reason = verify_manifest(path)
            if reason is not None:
                record(ev.CheckpointInvalid(step=step, path=str(path), reason=reason))
            checked[step] = reason is None
        return checked[step]

    if True in marks.values():
        candidate = next((s for s, p in checkpoints if marks[s] is not False and intact(s, p)),
                         None)
        # An unmarked candidate stands only if an older checkpoint is verified and intact.
        if candidate is not None and (marks[candidate] or any(
                intact(s, p) for s, p in checkpoints if s < candidate and marks[s])):
            for s, p in checkpoints:
                if s > candidate and marks[s] is False:
                    record(ev.CheckpointInvalid(step=s, path=str(p), reason=UNVERIFIED))
            return candidate
    # No intact checkpoint is marked verified: the newest intact one, as without marks.
    return next((s for s, p in checkpoints if intact(s, p)), None)


INTERNAL_EXTRAS = "extra__unbroken_"
"""The runtime's own tracked extras (the anomaly detectors' state): a checkpoint saved before
a detector was turned on lacks them, and is loaded without them (they keep their fresh
state)."""


def _without_missing_internal(state: dict[str, Any], path: Path) -> None:
    saved = load_metadata(path / ".metadata").state_dict_metadata
    for key in [k for k in state if k.startswith(INTERNAL_EXTRAS)]:
        if not any(m == key or m.startswith(f"{key}.") for m in saved):
            del state[key]


def load_into(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """Load checkpoint `path` into `state` in place (tensors only); the runtime's own extras
    that `path` lacks are left out of `state`."""
    try:
        _without_missing_internal(state, path)
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
