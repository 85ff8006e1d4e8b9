"""The run's event log: one JSON object per line, appended by agents and workers alike.

Every writer opens the file with O_APPEND and writes each line with a single `write`, so
lines from many processes interleave whole. Each event is a dataclass of
`unbroken.telemetry.schema`, encoded by `schema.encode` and read back by `schema.decode`;
each record carries the schema's version in `v`. docs/events.md is generated from them.

Two promises on top of that:

- Never fatal. A write that fails (disk full, quota, I/O error, a closed descriptor) drops
  that one event and counts it in `EventLog.dropped`; the first drop is said on stderr, once,
  and `close` reports the count (an `events_dropped` event, if it can still be written, and
  one stderr line). Training never stops for its telemetry.
- Bounded. Past `max_bytes` (`UNBROKEN_EVENTS_MAX_BYTES`, default 256 MiB) the writer that
  notices renames `events.jsonl` to `events.jsonl.1` (shifting `.1` to `.2` ... up to `.keep`;
  the oldest is deleted) under an flock on `events.jsonl.lock`, and reopens. Every other
  writer sees at its next check that the path now names another file, and reopens too (until
  then its lines land, whole, in the renamed file). A writer checks after each `CHECK_BYTES`
  (or an eighth of `max_bytes`, if less) of its own writes or `CHECK_SECONDS`, whichever comes
  first: no `stat` per event, so the log may pass the bound by what its writers append
  between two checks.

`read_events` reads the rotated files and the live one as one log.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import functools
import json
import os
import re
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from unbroken.polling import PollTimeout, poll_until
from unbroken.telemetry.event_names import Event, current
from unbroken.telemetry.schema import SCHEMA_VERSION, VERSION_KEY, EventBody, encode

EVENTS_FILE = "events.jsonl"
MAX_BYTES_ENV = "UNBROKEN_EVENTS_MAX_BYTES"
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_KEEP = 4  # rotated files kept: events.jsonl.1 ... events.jsonl.4
CHECK_BYTES = 2**20  # a writer checks the log's size after this many bytes of its own writes
CHECK_SECONDS = 1.0  # ... or this long after its last check
LOCK_SUFFIX = ".lock"  # events.jsonl.lock: held (flock) around a rotation
READ_LOCK_WAIT = 2.0  # seconds a reader waits for a rotation to end
READ_TRIES = 10  # without the lock, a reader lists the files again at most this often

_SIZE = re.compile(r"(\d+)\s*([kmg]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


@functools.cache
def max_bytes_from_env() -> int:
    """`UNBROKEN_EVENTS_MAX_BYTES` (bytes, or with a K, M or G suffix: binary units), read
    once per process; unset: `DEFAULT_MAX_BYTES`. A value that is not a positive size falls
    back to the default, said in one stderr line (the log is telemetry: never fatal)."""
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    match = _SIZE.fullmatch(raw)
    value = int(match[1]) * _UNITS[match[2].lower()] if match else 0
    if value <= 0:
        _say(f"unbroken: {MAX_BYTES_ENV}={raw!r} is not a positive size (bytes, or with K, M "
             f"or G); the event log rotates at the default, {DEFAULT_MAX_BYTES // 2**20} MiB")
        return DEFAULT_MAX_BYTES
    return value


def _say(line: str) -> None:
    """One line on stderr; a stderr that cannot be written (itself on a full disk) loses it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


_LOGS: weakref.WeakSet[EventLog] = weakref.WeakSet()  # the process's open logs


def _after_fork_in_child() -> None:
    """A fork taken while another thread emitted would leave the child a held lock."""
    for log in list(_LOGS):
        log._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _report_at_exit() -> None:
    """A writer that exits without closing its log still reports what it dropped."""
    for log in list(_LOGS):
        if log.dropped:
            log.close(final=True)


def rotated(path: str | os.PathLike[str], n: int) -> Path:
    """The n-th rotated file of a log: `events.jsonl.n` (1: the newest)."""
    path = Path(path)
    return path.with_name(f"{path.name}.{n}")


class EventLog:
    """Appends events with a fixed set of context fields (source, node, rank, attempt).

    Contract: `emit` never raises for the file's sake and always returns the record; a record
    that could not be written whole is counted in `dropped`. After `close`, `emit` writes
    nothing (it still returns the record). Safe to share between the threads of a process.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, max_bytes: int | None = None,
                 keep: int = DEFAULT_KEEP, **context: Any) -> None:
        """`path` None: a log that writes nothing. `max_bytes` None: `max_bytes_from_env()`."""
        self.path = Path(path) if path else None
        self.context = context
        self.max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
        self.keep = keep
        if self.max_bytes <= 0 or keep < 1:
            raise ValueError(f"EventLog: max_bytes ({self.max_bytes}) and keep ({keep}) "
                             f"must be positive")
        self.dropped = 0  # events not written (whole) since this log was opened
        self._fd: int | None = None
        self._lock = threading.RLock()
        self._check_bytes = min(CHECK_BYTES, max(1, self.max_bytes // 8))
        self._since_check = 0
        self._check_at = time.monotonic() + CHECK_SECONDS
        self._torn = False  # the last write was short: start the next with a newline
        self._said = False  # the first drop was said on stderr
        self._said_rotation = False
        self._closed = False
        self._context_json: tuple[dict[str, Any], str] | None = None  # for `emit_encoded`
        self.shared = False
        """Several owners write to it (the worker's watch, then its `Run`): their `close()`
        leaves it open, and what it dropped is reported at the process's exit."""
        self.observers: list[Any] = []
        """Each is called with every record `emit` makes (the agent's node metrics and its
        copy of the node's events), on the emitting thread; it must not block."""
        _LOGS.add(self)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._reopen()
            except OSError as exc:  # retried at each check; meanwhile events are dropped
                self._drop_notice(exc)

    def emit(self, event: EventBody | Event, **fields: Any) -> dict[str, Any]:
        """Append one event: an instance of its `schema` class. `emit(Event.NAME, **fields)`
        is the older form, kept for callers not yet converted: its fields are not checked."""
        if isinstance(event, EventBody):
            if fields:
                raise TypeError("emit: an event instance takes no keyword fields")
            event, fields = event.EVENT, encode(event)
        record = {"t": round(time.time(), 6), "event": event, VERSION_KEY: SCHEMA_VERSION,
                  **self.context, **fields}
        for observe in self.observers:
            observe(record)
        if self.path is None:
            return record
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self._closed:
                self._write(line)
        return record

    def emit_encoded(self, event: Event, fields: str) -> None:
        """Append one event whose fields are already JSON, without braces (`"a":1,"b":[2]`):
        for a hot path that cannot afford `emit`'s encoding (a watched script's step: about
        5 µs here against 15-25). The caller keeps to the event's schema."""
        if self.path is None:
            return
        context = self.context
        if self._context_json is None or self._context_json[0] != context:
            encoded = json.dumps(context, separators=(",", ":"), default=str)[1:-1]
            self._context_json = (dict(context), encoded + "," if encoded else "")
        line = (f'{{"t":{time.time():.6f},"event":"{event}","{VERSION_KEY}":{SCHEMA_VERSION},'
                f'{self._context_json[1]}{fields}}}\n')
        with self._lock:
            if not self._closed:
                self._write(line)

    def close(self, final: bool = False) -> None:
        """Report the dropped events (an `events_dropped` event, if it can be written, and
        one stderr line) and close the file. Safe to call twice; never raises. A log
        `shared` by several owners in the process is closed only at exit (`final`)."""
        with self._lock:
            if self._closed or self.path is None or (self.shared and not final):
                return
            if self.dropped:
                record = {"t": round(time.time(), 6), "event": Event.EVENTS_DROPPED,
                          VERSION_KEY: SCHEMA_VERSION, **self.context, "dropped": self.dropped}
                lost = self.dropped
                self._write(json.dumps(record, separators=(",", ":"), default=str) + "\n",
                            check=False)
                _say(f"unbroken: {lost} event(s) could not be written to {self.path} "
                     f"(disk full?)")
            self._closed = True
            fd, self._fd = self._fd, None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError as exc:  # e.g. a network file system's late write error
                    if exc.errno != errno.EBADF:  # closed under us: its drops are counted
                        _say(f"unbroken: event log {self.path}: closing it failed: {exc.strerror}")

    def abandon(self) -> None:
        """In a forked child that is not this log's writer (a worker the fork server forked):
        close the inherited descriptor, write nothing and report nothing, ever."""
        self._closed = True
        fd, self._fd = self._fd, None
        _LOGS.discard(self)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass  # not open in this process: nothing to give back

    # ------------------------------------------------------------------ under self._lock
    def _write(self, line: str, check: bool = True) -> None:
        data = (("\n" if self._torn else "") + line).encode()
        if self._fd is None:
            self._dropped(OSError(errno.EBADF, "not open"))
        else:
            try:
                written = os.write(self._fd, data)
            except OSError as exc:
                self._dropped(exc)
            else:
                self._since_check += written
                # A short write (the disk filled mid-line) leaves a torn line: the next write
                # ends it first, so that the torn line spoils no other (readers skip it).
                self._torn = written < len(data)
                if self._torn:
                    self._dropped(OSError(errno.ENOSPC, "a line was cut short (disk full?)"))
        if check and (self._since_check >= self._check_bytes
                      or time.monotonic() >= self._check_at):
            self._check()

    def _dropped(self, exc: OSError) -> None:
        self.dropped += 1
        self._drop_notice(exc)

    def _drop_notice(self, exc: OSError) -> None:
        if not self._said:
            self._said = True
            _say(f"unbroken: event log {self.path}: {exc.strerror or exc}; dropping events "
                 f"and counting them")

    def _check(self) -> None:
        """Rotate the log if it has grown past the bound; reopen it if another writer did."""
        self._since_check = 0
        self._check_at = time.monotonic() + CHECK_SECONDS
        try:
            if self._fd is None:
                self._reopen()
                return
            mine = os.fstat(self._fd)
            if mine.st_size >= self.max_bytes:
                self._rotate(mine)
            elif not self._current(mine):
                self._reopen()
        except OSError as exc:  # the log keeps its file and grows: said once
            if not self._said_rotation:
                self._said_rotation = True
                _say(f"unbroken: event log {self.path}: cannot check or rotate it: {exc}")

    def _current(self, mine: os.stat_result) -> bool:
        """Whether the log's path still names the file this writer appends to."""
        try:
            now = os.stat(self.path)  # type: ignore[arg-type]
        except FileNotFoundError:
            return False
        return _identity(now) == _identity(mine)

    def _rotate(self, mine: os.stat_result) -> None:
        """Under the lock file: if the path is still this writer's file and still too big,
        shift the rotated files up one (deleting the oldest) and rename it to `.1`; either
        way, reopen the path (another writer may have rotated first). Never waits for the
        lock: its holder may be a stopped process (a hang being diagnosed); the rotation is
        tried again at the next check."""
        assert self.path is not None
        lock = os.open(self.path.with_name(self.path.name + LOCK_SUFFIX),
                       os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another writer is rotating, or a reader listing
                if not self._current(mine):
                    self._reopen()
                else:
                    self._since_check = self._check_bytes  # try again at the next event
                return
            if self._current(mine) and os.stat(self.path).st_size >= self.max_bytes:
                for n in sorted(_rotated_numbers(self.path), reverse=True):
                    if n >= self.keep:  # beyond `keep` once shifted (or left by a larger keep)
                        os.unlink(rotated(self.path, n))
                    else:
                        os.replace(rotated(self.path, n), rotated(self.path, n + 1))
                os.replace(self.path, rotated(self.path, 1))
            self._reopen()
        finally:
            os.close(lock)  # releases the flock

    def _reopen(self) -> None:
        """Open the path (creating it); the old descriptor is closed once the new one is open,
        so a failure leaves this writer appending where it did."""
        assert self.path is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        old, self._fd = self._fd, fd
        if old is not None:
            try:
                os.close(old)
            except OSError:
                pass  # a descriptor closed under us: nothing of ours was pending on it


def event_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The files of a run's event log that exist, oldest first: `events.jsonl.N`, ...,
    `events.jsonl.1`, `events.jsonl`."""
    return _log_files(Path(run_dir) / EVENTS_FILE)


def _rotated_numbers(path: Path, names: list[str] | None = None) -> list[int]:
    """The n of each `path.n` in the directory (or in `names`, a listing of it)."""
    suffix = re.compile(re.escape(path.name) + r"\.([1-9][0-9]*)")
    names = os.listdir(path.parent) if names is None else names
    return [int(m[1]) for name in names if (m := suffix.fullmatch(name))]


def _log_files(path: Path) -> list[Path]:
    try:
        names = os.listdir(path.parent)
    except FileNotFoundError:
        return []
    files = [rotated(path, n) for n in sorted(_rotated_numbers(path, names), reverse=True)]
    return files + [path] if path.name in names else files


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a log, its rotated files included (`path.N` ... `path.1`, `path`), in
    time order; torn lines (a killed writer, a full disk) are skipped.

    Consistent while writers rotate: no line is read twice or missed for a rename (see
    `_open_log`). FileNotFoundError when there is no log at all."""
    path = Path(path)
    handles = _open_log(path)
    if not handles:
        raise FileNotFoundError(errno.ENOENT, "no event log", str(path))
    events = []
    for fh in handles:
        with fh:
            events += parse_lines(fh)
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


def parse_lines(lines: Any) -> list[dict[str, Any]]:
    """The events among a log's lines (text or bytes); torn lines (a killed writer, a full
    disk) and lines that are not objects are skipped. An event renamed since the log was
    written comes under its name now (`event_names.RENAMED`)."""
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            if isinstance(name := event.get("event"), str):
                event["event"] = current(name)  # a renamed event under its name now
            events.append(event)
    return events


def _open_log(path: Path) -> list[Any]:
    """The log's files, open, oldest first, as one rotation left them. Listed and opened
    under a shared flock of the rotation lock (writers never wait for it: they rotate later);
    without it (no rotation yet, or a holder past READ_LOCK_WAIT: a stopped writer), checked
    instead: after all are opened, each name still names the file opened under it, and no
    file was added (READ_TRIES times at most, then read as they are)."""
    lock_path = path.with_name(path.name + LOCK_SUFFIX)
    tries = 0
    while True:
        lock = _shared_lock(lock_path)
        try:
            handles, opened = [], {}
            for file in _log_files(path):
                try:
                    fh = open(file, encoding="utf-8", errors="replace")  # noqa: SIM115
                except FileNotFoundError:
                    continue  # rotated out since the listing: the listing below differs
                handles.append(fh)
                opened[file.name] = _identity(os.fstat(fh.fileno()))
        finally:
            if lock is not None:
                os.close(lock)
        tries += 1
        if lock is not None or tries == READ_TRIES or _identities(path) == opened:
            return handles
        for fh in handles:  # a rotation happened meanwhile
            fh.close()


def _shared_lock(lock_path: Path) -> int | None:
    """An fd holding a shared flock of the lock file; None if there is no lock file, or it
    stays held (exclusively) for READ_LOCK_WAIT seconds."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None

    def locked() -> int | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            return None

    try:
        return poll_until(locked, READ_LOCK_WAIT, 0.002, what="a shared lock of the event log")
    except PollTimeout:
        os.close(fd)
        return None


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _identities(path: Path) -> dict[str, tuple[int, int]]:
    """Each file of the log, by name: the file it names now."""
    found = {}
    for file in _log_files(path):
        try:
            found[file.name] = _identity(os.stat(file))
        except FileNotFoundError:
            continue
    return found
