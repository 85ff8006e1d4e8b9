"""Where the workers' output goes: torchrun's `--log-dir`, `--redirects`, `--tee`,
`--local-ranks-filter`, `--duplicate-std*-filters`, and `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`.

The layout is torchrun's, so that tools reading torchrun's logs read ours:

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stdout.log|stderr.log|error.json
    <log_dir>/<run_id>_<random>/attempt_<n>/filtered_stdout.log|filtered_stderr.log

A redirected stream goes to its file only; a tee'd stream goes to its file and, line by line
with a prefix (default `[<role><local_rank>]:`), to the agent's own stdout/stderr. As in
torchrun, a rank left out by `--local-ranks-filter` is not shown on the console (its tee'd
output still reaches its file). `LogSpec` is the parsed configuration (pure); `AttemptLogs`
makes one attempt's directories; `Tailer` copies tee'd files to the console.
"""

from __future__ import annotations

import os
import socket
import string
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from enum import IntFlag
from pathlib import Path
from typing import TextIO

from unbroken.errors import UserError

PREFIX_TEMPLATE_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


class Std(IntFlag):
    """Which streams: 0 none, 1 stdout, 2 stderr, 3 both (torchrun's `Std`)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


StdSpec = Std | dict[int, Std]


def parse_std(flag: str, text: str) -> StdSpec:
    """`3`, or a per-local-rank map such as `0:1,1:2` (ranks not named get 0)."""
    text = text.strip()

    def one(value: str) -> Std:
        if value not in ("0", "1", "2", "3"):
            raise UserError(f"{flag} takes 0-3 or a map such as 0:1,1:2, got {text!r}")
        return Std(int(value))

    if ":" not in text:
        return one(text)
    out: dict[int, Std] = {}
    for part in text.split(","):
        rank, sep, value = part.partition(":")
        if not sep or not rank.strip().isdigit():
            raise UserError(f"{flag} takes 0-3 or a map such as 0:1,1:2, got {text!r}")
        out[int(rank)] = one(value.strip())
    return out


def _of(spec: StdSpec, local_rank: int) -> Std:
    return spec if isinstance(spec, Std) else spec.get(local_rank, Std.NONE)


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        ranks = frozenset(int(x) for x in text.split(","))
    except ValueError:
        raise UserError("--local-ranks-filter must be a comma-separated list of integers, e.g. "
                        f"0,1,2; got {text!r}") from None
    return ranks


@dataclass(frozen=True)
class LogSpec:
    log_dir: str | None = None
    """torchrun's `--log-dir`; None: RUN_DIR/logs once anything is written there."""
    redirects: StdSpec = Std.NONE
    """Streams that go to files only."""
    tee: StdSpec = Std.NONE
    """Streams that go to files and to the console."""
    local_ranks_filter: frozenset[int] | None = None
    """Local ranks shown on the console (None: all)."""
    prefix_template: str | None = None
    """`--log-line-prefix-template`, else `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`:
    `${role_name}`, `${rank}`, `${local_rank}`, `${hostname}` (this host's short name)."""
    duplicate_stdout: tuple[str, ...] = ()
    """Lines containing one of these also go to the attempt's filtered_stdout.log."""
    duplicate_stderr: tuple[str, ...] = ()
    role: str = "default"
    """torchrun's `--role`: ROLE_NAME, and the default prefix."""

    def redirected(self, local_rank: int) -> Std:
        """The streams written to files (tee'd ones are too, and tailed from there)."""
        return _of(self.redirects, local_rank) | _of(self.tee, local_rank)

    def teed(self, local_rank: int) -> Std:
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return Std.NONE
        return _of(self.tee, local_rank)

    def hidden(self, local_rank: int) -> bool:
        """Left out of the console by `--local-ranks-filter`."""
        return self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter

    @property
    def uses_dir(self) -> bool:
        """torchrun's layout is made (a --log-dir given, or something goes to a file)."""
        return (self.log_dir is not None or self.redirects != Std.NONE or self.tee != Std.NONE
                or bool(self.duplicate_stdout or self.duplicate_stderr))

    def prefix(self, rank: int, local_rank: int) -> str:
        if self.prefix_template:
            return string.Template(self.prefix_template).safe_substitute(
                role_name=self.role, rank=rank, local_rank=local_rank,
                hostname=socket.gethostname())
        return f"[{self.role}{local_rank}]:"


@dataclass
class Tail:
    """One file the tailer copies: its console stream (None: the filtered copy only), the
    prefix of each line, and the attempt's filtered file with the strings that select lines."""

    path: str
    prefix: str
    console: TextIO | None
    filtered: str | None = None
    filters: tuple[str, ...] = ()
    offset: int = 0
    partial: bytes = b""


@dataclass
class WorkerStreams:
    """Where one worker's stdout and stderr go: a file path, or None for the console."""

    stdout: str | None = None
    stderr: str | None = None
    error_file: str | None = None
    """torchrun's error.json for this rank (TORCHELASTIC_ERROR_FILE); None: unbroken's own."""
    tail: list[Tail] = field(default_factory=list)
    """What the tailer copies to the console or the filtered files."""


class AttemptLogs:
    """One agent's log directory: `<log_dir>/<run_id>_<random>/`, an `attempt_<n>/` per attempt."""

    def __init__(self, spec: LogSpec, run_id: str, default_dir: Path) -> None:
        self.spec = spec
        self._root = (Path(spec.log_dir) if spec.log_dir else default_dir).resolve()
        self._run_dir: Path | None = None
        self._run_id = run_id

    def streams(self, attempt: int, rank: int, local_rank: int) -> WorkerStreams:
        spec = self.spec
        hidden = spec.hidden(local_rank)
        if not spec.uses_dir:
            devnull = os.devnull if hidden else None
            return WorkerStreams(stdout=devnull, stderr=devnull)
        if self._run_dir is None:
            self._root.mkdir(parents=True, exist_ok=True)
            self._run_dir = Path(tempfile.mkdtemp(prefix=f"{self._run_id}_", dir=self._root))
        attempt_dir = self._run_dir / f"attempt_{attempt}"
        rank_dir = attempt_dir / str(local_rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        out = WorkerStreams(error_file=str(rank_dir / "error.json"))
        redirected, teed = spec.redirected(local_rank), spec.teed(local_rank)
        for std, name, console, filters in (
                (Std.OUT, "stdout", sys.stdout, spec.duplicate_stdout),
                (Std.ERR, "stderr", sys.stderr, spec.duplicate_stderr)):
            path = str(rank_dir / f"{name}.log") if redirected & std else (
                os.devnull if hidden else None)
            setattr(out, name, path)
            filtered = str(attempt_dir / f"filtered_{name}.log") if filters else None
            if redirected & std and (teed & std or filtered):
                out.tail.append(Tail(path, spec.prefix(rank, local_rank),
                                     console if teed & std else None, filtered, filters))
        return out


class Tailer:
    """Copies tee'd worker logs to the console, line by line with their prefix, and lines
    matching a duplicate filter to the attempt's filtered log. One thread for the agent."""

    def __init__(self, interval: float = 0.1) -> None:
        self._tails: dict[str, Tail] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self._thread: threading.Thread | None = None

    def follow(self, streams: WorkerStreams) -> None:
        """Copy these files from now on; a file already followed (an in-place replacement
        writes its predecessor's) goes on from where it was."""
        with self._lock:
            for tail in streams.tail:
                self._tails.setdefault(tail.path, tail)
        if streams.tail and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="log-tailer")
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.drain()

    def drain(self, final: bool = False) -> None:
        """Copy what the files gained since the last look (`final`: a last partial line too)."""
        with self._lock:
            for tail in self._tails.values():
                try:
                    with open(tail.path, "rb") as f:
                        f.seek(tail.offset)
                        data = f.read()
                except FileNotFoundError:
                    continue  # not written yet (a worker that has not started)
                tail.offset += len(data)
                lines = (tail.partial + data).split(b"\n")
                tail.partial = lines.pop()
                if final and tail.partial:
                    lines.append(tail.partial)
                    tail.partial = b""
                _emit([ln.decode(errors="replace") for ln in lines], tail)

    def retire(self) -> None:
        """An attempt ended: copy what its files still hold, then stop following them."""
        self.drain(final=True)
        with self._lock:
            self._tails.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.drain(final=True)


def _emit(lines: list[str], tail: Tail) -> None:
    if not lines:
        return
    if tail.console is not None:
        tail.console.write("".join(f"{tail.prefix}{ln}\n" for ln in lines))
        tail.console.flush()
    if tail.filtered:
        dup = [ln for ln in lines if any(f in ln for f in tail.filters)]
        if dup:
            with open(tail.filtered, "a") as f:
                f.write("".join(f"{tail.prefix}{ln}\n" for ln in dup))
