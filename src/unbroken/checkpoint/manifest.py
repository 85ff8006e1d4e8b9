"""A checkpoint's manifest: every file with its size and CRC-32, written last.

A checkpoint directory is only ever renamed into place after its manifest is durable, so a
directory without a valid manifest, or whose files disagree with it, is torn or corrupt.
CRC-32 detects torn and corrupted files, and is computed as the data files are written; it
is not a defence against someone who can write the checkpoint (they could rewrite the
manifest too): that is what the safe reader is for.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
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
    """Write the manifest of `files` (name -> bytes, sha256), durably.

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
