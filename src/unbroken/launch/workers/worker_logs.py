"""Where the workers' output goes: torchrun's `--log-dir`, `--redirects`, `--tee`,
`--local-ranks-filter`, `--duplicate-std*-filters`, and `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`.

The layout is torchrun's, so that tools reading torchrun's logs read ours:

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stdout.log|stderr.log|error.json
    <log_dir>/<run_id>_<random>/attempt_<n>/filtered_stdout.log|filtered_stderr.log

A redirected stream goes to its file only; a tee'd stream goes to its file and, line by line
with a prefix (default `[<role><local_rank>]:`), to the agent's own stdout/stderr. As in
torchrun, a rank left out by `--local-ranks-filter` is not shown on the console (its tee'd
output still reaches its file). `LogSpec` is the parsed configuration (pure:
`launch/log_spec.py`); `AttemptLogs` makes one attempt's directories; `Tailer` copies tee'd files to the console.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from unbroken.launch.log_spec import LogSpec, Std


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
