"""Phase two of a checkpoint: write the staged copy in DCP format and commit it, in the
background.

Every rank writes its own shard files through DCP over the checkpoint group (around the page
cache, checksummed as written, fsynced: see `direct_io.py`), and tells the others whether it
succeeded. Only when every rank did does rank 0 write the manifest (each file's size and
CRC-32), fsync it, and rename the temporary directory into place. A rank whose write fails (a full disk) still takes part in the exchange, so no
peer waits on it; a rank that dies breaks the group, so its peers fail at once. Either way
nothing is committed and the previous checkpoint stays the latest.

Before it commits, rank 0 looks (one stat per file) for every file the manifest will list, in
the directory it is about to rename, with the size its rank reported. A checkpoint_dir that is
each node's own disk at the same path (a pod's emptyDir) would otherwise "commit" checkpoints
holding only rank 0's node's files, found out only at the restart that needs one. A file it
cannot see is looked for again for about 1.5 s (a shared filesystem slow to show another
client's files); then nothing is committed (`CheckpointDirNotShared`), and every rank removes
its own view of the temporary directory, since on node-local storage no other rank can.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from unbroken.checkpoint.direct_io import ChecksummingFileSystem
from unbroken.checkpoint.layout import remove_torn, retain
from unbroken.checkpoint.loader import describe_dcp_failure
from unbroken.checkpoint.manifest import (
    Unseen,
    file_digest,
    fsync_path,
    still_unseen,
    unseen_files,
    write_manifest,
)
from unbroken.errors import first_line, is_peer_error


class CheckpointWriteError(RuntimeError):
    """Some rank could not write its part of a checkpoint; nothing was committed."""


class CheckpointDirNotShared(CheckpointWriteError):
    """Rank 0 cannot see, in the directory it would commit, files other ranks wrote there:
    checkpoint_dir is not storage that every node shares. Nothing was committed."""

    def __init__(self, directory: str, unseen: list[Unseen], files: int) -> None:
        self.directory = directory  # checkpoint_dir, as rank 0 resolves it
        self.unseen = unseen  # other ranks' files rank 0 cannot see as they were written
        self.files = files  # how many files the other ranks wrote
        examples = ", ".join(u.describe() for u in unseen[:1])
        super().__init__(f"checkpoint_dir {directory} is not shared: rank 0 cannot see "
                         f"{len(unseen)} of the {files} file{'s' if files != 1 else ''} "
                         f"other ranks wrote (e.g. {examples})")

    def line(self) -> str:
        """What the user is told, once: the cause and the fix."""
        return (f"unbroken: {self}; checkpoint_dir must be storage every node can see "
                f"(a shared filesystem or volume); no checkpoint is committed")


# Seconds to wait before each further look for files rank 0 cannot see yet: a shared
# filesystem may show another client's new files late; node-local storage never will.
_LOOK_AGAIN = (0.1, 0.4, 1.0)
# What rank 0 broadcasts after trying to commit.
_FAILED, _COMMITTED, _NOT_SHARED = 0, 1, 2


def check_visible(tmp: Path, reports: list[dict[str, Any]], directory: str,
                  look_again: tuple[float, ...] = _LOOK_AGAIN) -> None:
    """Raise unless every file in `reports` (rank r's at index r) is in `tmp` as reported:
    CheckpointDirNotShared when other ranks' files are not, CheckpointWriteError when only
    rank 0's own are (something changed them after they were written)."""
    unseen = unseen_files(tmp, reports)
    for delay in look_again:
        if not unseen:
            return
        time.sleep(delay)
        unseen = still_unseen(tmp, unseen)
    others = [u for u in unseen if u.rank != 0]
    if others:
        files = sum(len(r.get("files") or {}) for r in reports[1:])
        raise CheckpointDirNotShared(directory, others, files)
    if unseen:
        raise CheckpointWriteError(f"rank 0 cannot find its own file as written: {unseen[0].describe()}")


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, with data files written by ChecksummingFileSystem: around the
    page cache where the filesystem allows, fsynced, and checksummed as they are written."""

    def __init__(self, path: Path, rate: float | None) -> None:
        super().__init__(path, sync_files=False, thread_count=1)  # our files fsync on close
        self.fs = ChecksummingFileSystem(rate=rate)

    @property
    def written(self) -> dict[str, dict[str, Any]]:
        return self.fs.written


def exchange_json(payload: dict[str, Any], group: dist.ProcessGroup | None) -> list[dict[str, Any]]:
    """Every rank's `payload` (JSON), on every rank. JSON, so nothing received is executed."""
    data = json.dumps(payload).encode()
    if group is None or not dist.is_initialized():
        return [payload]
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(everyone, mine, group=group)
    return [json.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(everyone, sizes, strict=True)]


@dataclass
class Committed:
    path: Path
    bytes: int | None  # the checkpoint's total size, known on rank 0
    deleted: list[int]  # older steps removed by retention (rank 0)
    committed_at: float | None = None  # monotonic, on rank 0: before retention's deletes
    retention_error: str | None = None  # committed, but older checkpoints could not go


def persist(
    state: dict[str, Any],
    step: int,
    tmp: Path,
    final: Path,
    group: dist.ProcessGroup | None,
    rank: int,
    keep: int,
    keep_every: int | None,
    manifest_extra: dict[str, Any],
    before_commit: Callable[[], None] = lambda: None,
    write_rate: float | None = None,
) -> Committed:
    """Write `state` into `tmp` (which exists), and commit it as `final` once every rank's
    files are durable.

    `write_rate`: bytes per second at most for the data files (None: unpaced). Collective
    over `group`. Raises CheckpointWriteError (or the group's error, if a peer
    died) when nothing was committed.
    """
    distributed = dist.is_initialized() and group is not None
    local: dict[str, Any] = {"ok": True, "files": {}}
    try:
        writer = _RecordingWriter(tmp, write_rate)
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
        local["files"] = writer.written
        before_commit()  # fault injection: the files are written, nothing is committed
    except CheckpointException as exc:  # some rank failed inside DCP; every rank has this
        local = {"ok": False, "error": describe_dcp_failure(exc)}
    except Exception as exc:  # noqa: BLE001 -- reported to every rank, then raised below
        if is_peer_error(exc):
            raise  # the group broke (a peer died): no exchange is possible
        local = {"ok": False, "error": f"rank {rank}: {first_line(exc)}"}
    reports = exchange_json(local, group if distributed else None)
    failed = list(dict.fromkeys(r["error"] for r in reports if not r["ok"]))  # DCP's: alike
    outcome = torch.tensor([_FAILED], dtype=torch.int64)
    result = Committed(final, None, [])
    error = "; ".join(failed[:3])
    not_shared = None
    if rank == 0:
        try:
            if not failed:
                check_visible(tmp, reports, os.path.abspath(final.parent))
                result = _commit(tmp, final, step, reports, keep, keep_every, manifest_extra)
                outcome[0] = _COMMITTED
        except CheckpointDirNotShared as exc:
            not_shared, error, outcome[0] = exc, str(exc), _NOT_SHARED
        except Exception as exc:  # noqa: BLE001 -- e.g. no space left for the manifest
            error = f"rank 0 could not commit: {first_line(exc)}"
        if outcome[0] != _COMMITTED:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back for the next try
    if distributed:
        dist.broadcast(outcome, group=group, group_src=0)
    if outcome[0] != _COMMITTED:
        if rank != 0:  # rank 0 has decided: never committed. On node-local storage only
            shutil.rmtree(tmp, ignore_errors=True)  # this rank can remove its files
        if not_shared is not None:
            raise not_shared
        if outcome[0] == _NOT_SHARED:
            error = ("rank 0 could not commit: checkpoint_dir is not shared (rank 0 cannot "
                     "see the files other ranks wrote)")
        raise CheckpointWriteError(error or "rank 0 could not commit")
    return result


def _commit(tmp: Path, final: Path, step: int, reports: list[dict[str, Any]], keep: int,
            keep_every: int | None, extra: dict[str, Any]) -> Committed:
    files = {name: info for report in reports for name, info in report["files"].items()}
    metadata = tmp / ".metadata"
    fsync_path(metadata)
    files[".metadata"] = {"bytes": metadata.stat().st_size, "crc32": file_digest(metadata)}
    write_manifest(tmp, step, files, extra)
    replaced = None
    if final.exists():  # the same step saved by an earlier attempt: set aside, then swap
        replaced = final.with_name(f"{tmp.name}-replaced")
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_path(final.parent)
    committed = Committed(final, sum(i["bytes"] for i in files.values()), [], time.monotonic())
    try:  # committed now, whatever happens below
        if replaced is not None:
            shutil.rmtree(replaced)
        remove_torn(final.parent)  # saves a fault interrupted: only one is ever in flight
        committed.deleted = retain(final.parent, keep, keep_every)
    except OSError as exc:
        committed.retention_error = first_line(exc)
    return committed
