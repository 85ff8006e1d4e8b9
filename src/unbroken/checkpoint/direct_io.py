"""Checkpoint data files written around the page cache, checksummed as they are written.

A background save through the page cache competes with training for what a busy host has
least of: hundreds of MB of dirty pages that the kernel's writeback threads must flush on
CPUs the training loop wants, and a writer throttled until they do. On the 2-core
development machine, 515 MB written and fsynced through the page cache took 0.25-1.3 s while
a training loop ran beside it, and 0.2 s with O_DIRECT. So data files are written with
O_DIRECT from page-aligned chunks, two of them, so that copying and checksumming one
overlaps the disk writing the other. Where O_DIRECT is refused (tmpfs, some network
filesystems) the same stream writes through the page cache. Either way the file is fsynced
when closed, and its CRC-32 and size are known without reading it back.

Writing still costs a training loop beside it some time even with O_DIRECT: on the
development VM the virtual disk took 3-48 ms of step time per 515 MB written (three runs of
`benchmarks/write_interference.py`), in two of them more than the copying and checksumming
together. So the writes can be paced (`rate`): the checkpointer spreads them over about one
training step, so that they cost each step a little rather than one step a lot.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from torch.distributed.checkpoint.filesystem import FileSystem

CHUNK = 16 << 20  # bytes per write; a multiple of any logical block size
_ALIGN = 4096
_PIECE = 1 << 20  # checksummed and copied at a time: fits in a core's L2 cache


class ChecksummedFile(io.RawIOBase):
    """A write-only, append-only file: CRC-32 and size of all that was written; fsynced on close."""

    def __init__(self, path: str | os.PathLike[str], direct: bool = True,
                 rate: float | None = None) -> None:
        """`rate`: at most this many bytes per second reach the disk (None: as fast as it goes)."""
        super().__init__()
        self.rate = rate
        self.size = 0  # bytes written so far (what tell() reports)
        self.crc32 = 0
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        self._arrays: dict[int, np.ndarray] = {}
        for _ in range(2):
            chunk = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
            self._arrays[id(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            self._free.put(chunk)
        self._full: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._chunk: mmap.mmap | None = self._free.get()
        self._fill = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
                self.direct = False
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o644)
        self._disk = threading.Thread(target=self._drain, name="unbroken-direct-write", daemon=True)
        self._disk.start()

    # ------------------------------------------------------------------ the disk thread
    def _drain(self) -> None:
        started, sent = time.monotonic(), 0
        while (item := self._full.get()) is not None:
            chunk, length = item
            try:
                if self.rate:  # paced: the device's cost spread over the time we were given
                    time.sleep(max(0.0, started + sent / self.rate - time.monotonic()))
                if self._error is None:
                    self._write_all(memoryview(chunk)[:length])
                    sent += length
            except BaseException as exc:  # noqa: BLE001 -- raised in the writing thread
                self._error = exc
            finally:
                self._free.put(chunk)

    def _write_all(self, view: memoryview) -> None:
        while view:
            written = os.write(self._fd, view)
            if written < len(view) and self.direct:
                # The rest would start at an unaligned offset (EINVAL): say what it means.
                raise OSError(errno.ENOSPC, "short write: no space left on device?")
            view = view[written:]

    # ------------------------------------------------------------------ the stream
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        if self._error is not None:
            raise self._error
        src = np.frombuffer(data, dtype=np.uint8)
        total, done = len(src), 0
        while done < total:
            take = min(total - done, CHUNK - self._fill, _PIECE)
            piece = src[done:done + take]
            # Checksum, then copy, a piece small enough to stay in the CPU's cache: memory
            # traffic is what a background save takes from a training loop on the same host.
            # numpy copies without holding the GIL.
            self.crc32 = zlib.crc32(piece, self.crc32)
            self._arrays[id(self._chunk)][self._fill:self._fill + take] = piece
            self._fill += take
            done += take
            if self._fill == CHUNK:
                self._hand_over(CHUNK)
        self.size += total
        return total

    def _hand_over(self, length: int) -> None:
        if self._error is not None:  # stop copying a multi-GB tensor into a failed file
            raise self._error
        self._full.put((self._chunk, length))
        self._chunk = self._free.get()
        self._fill = 0

    def flush(self) -> None:
        pass  # data goes to disk in whole chunks, and all of it on close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            tail = self._fill
            if tail:
                padded = -(-tail // _ALIGN) * _ALIGN if self.direct else tail
                self._full.put((self._chunk, padded))
                self._chunk = None
            self._full.put(None)
            self._disk.join()
            if self._error is not None:
                raise self._error
            if self.direct and tail:
                os.ftruncate(self._fd, self.size)  # drop the padding of the last block
            os.fsync(self._fd)
        finally:
            try:
                os.close(self._fd)
            finally:
                super().close()


class ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, writing `.distcp` data files through ChecksummedFile and
    remembering each one's size and CRC-32."""

    def __init__(self, direct: bool = True, rate: float | None = None) -> None:
        super().__init__()
        self.direct = direct
        self.rate = rate
        self.written: dict[str, dict[str, int | str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = ChecksummedFile(path, self.direct, self.rate)
        try:
            yield stream
        except BaseException:
            stream.close()
            raise
        stream.close()
        with self._lock:
            self.written[Path(path).name] = {"bytes": stream.size, "crc32": f"{stream.crc32:08x}"}
