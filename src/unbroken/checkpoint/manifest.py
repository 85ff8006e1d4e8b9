"""A checkpoint's manifest: every file with its size and CRC-32, written last.

A checkpoint directory is only ever renamed into place after its manifest is durable, so a
directory without a valid manifest, or whose files disagree with it, is torn or corrupt.
CRC-32 detects torn and corrupted files, and is computed as the data files are written; it
is not a defence against someone who can write the checkpoint (they could rewrite the
manifest too): that is what the safe reader is for.

Besides the files, a manifest records the attempt that wrote it and, where the replicas'
checksums were compared at its step, `"verified": true` (they agreed) or `false` (they did
not: silent data corruption); without the key (not checked, or written before the key
existed) nothing is known either way (`manifest_verified`).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """CRC-32 of a file, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, step: int, files: dict[str, dict[str, Any]],
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the manifest of `files` (name -> bytes, crc32), durably; `extra`'s keys
    (`attempt`, `verified`) go in beside them.

    Every rank has already fsynced the files it wrote; this is the commit marker's content.
    """
    manifest = {"format": "unbroken-dcp/2", "step": step, "files": files, **(extra or {})}
    tmp = directory / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    fsync_path(tmp)
    os.replace(tmp, directory / MANIFEST)
    fsync_path(directory)
    return manifest


def describe_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file in `directory` except the manifest."""
    return {p.name: {"bytes": p.stat().st_size, "crc32": file_digest(p)}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


@dataclass(frozen=True)
class Unseen:
    """A file a rank reported writing that is not in the directory as reported."""

    rank: int
    name: str
    bytes: int  # the size the rank reported
    seen: int | None  # the size found there; None: no such file (or it cannot be stat'ed)

    def describe(self) -> str:
        found = "" if self.seen is None else f" ({self.seen} of its {self.bytes} bytes)"
        return f"rank {self.rank}'s {self.name}{found}"


def _look(directory: Path, rank: int, name: str, size: int) -> Unseen | None:
    try:
        seen = os.stat(directory / name).st_size
    except OSError:  # not there (another node's disk), or not reachable from here
        return Unseen(rank, name, size, None)
    return None if seen == size else Unseen(rank, name, size, seen)


def unseen_files(directory: Path, reports: Sequence[Mapping[str, Any]]) -> list[Unseen]:
    """The files the ranks reported writing into `directory` that are not there as reported.

    `reports[r]` is rank r's report, `{"files": {name: {"bytes": size, ...}}}` (names are
    relative to `directory`; a report without "files" lists none). A file is unseen when
    `directory / name` cannot be stat'ed (it is not there, as when each node has a disk of
    its own at that path) or its size is not the reported `bytes`. Returns them in rank
    order, then in each report's order; empty when every file is there as reported.

    One stat per file; no data is read; never raises for a file that is not there. Pure but
    for those stats: it changes nothing, so it may be called again to look once more.
    """
    unseen = []
    for rank, report in enumerate(reports):
        for name, info in (report.get("files") or {}).items():
            if (miss := _look(directory, rank, name, info["bytes"])) is not None:
                unseen.append(miss)
    return unseen


def still_unseen(directory: Path, unseen: Sequence[Unseen]) -> list[Unseen]:
    """Of `unseen` (from `unseen_files`), those still not there as reported: a second look."""
    return [miss for u in unseen if (miss := _look(directory, u.rank, u.name, u.bytes)) is not None]


def verify_manifest(directory: Path) -> str | None:
    """None if the checkpoint is intact, else the reason it is not."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest (an unfinished save)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest: {exc}"
    if ".metadata" not in files:
        return "manifest lists no .metadata"
    for name, info in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"missing file {name}"
        if size != info.get("bytes"):
            return f"{name} has {size} bytes, manifest says {info.get('bytes')} (truncated?)"
        # Manifests of format unbroken-dcp/1 hold SHA-256.
        ok = (file_digest(path) == info["crc32"] if "crc32" in info
              else _sha256(path) == info.get("sha256"))
        if not ok:
            return f"{name} does not match its checksum (corrupt)"
    return None


def manifest_verified(directory: Path) -> bool | None:
    """The checkpoint's `verified` mark: True if the data-parallel replicas agreed at its
    step, False if they did not (silent data corruption), None if its manifest has no mark
    (not checked, or written before marks existed) or cannot be read (`verify_manifest`
    says why). Reads only the manifest."""
    try:
        mark = json.loads((directory / MANIFEST).read_text()).get("verified")
    except (OSError, ValueError, AttributeError):
        return None
    return mark if isinstance(mark, bool) else None
