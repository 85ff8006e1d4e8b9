"""What a worker imported, so that the node's fork server imports it in advance.

The fork server (`fork_server.py`) imports torch before any worker is asked for, but a plain
script may spend as long again importing its own libraries (transformers, ...). So one
worker of each node at a time (the holder of a lock beside the file) records the modules it
has imported (`ImportRecorder`, a daemon thread that looks every second, backing off to
every 30 s while nothing changes) in `RUN_DIR/node_K/modules.json`, and the node's fork
server, between forks, imports the modules listed there that it has not (`Preimporter`),
in the order the worker first imported them.

The safety rule, applied by the writer and again by the reader (the file is only data):
only modules of installed packages and of the standard library are listed and imported,
that is modules whose file lies in the interpreter's stdlib or site-packages directories
(or built into the interpreter). Never `__main__`, the script's own modules or anything else
on a path of the user's: importing those could run the user's code, with its side effects,
in a process that is not yet a worker. A name that is not a dotted identifier is ignored;
nothing else in the file is ever executed or evaluated.

A second rule, for what is imported ahead: a module that reads a rank's or a job's variable
at import (`worker_env.JOB_VARIABLES`: RANK, WORLD_SIZE, MASTER_ADDR, ...) would keep what
it saw in the server, where none is set. So each listed name is first imported in a
throwaway fork of the server under `environ_reads` (`probe`), and imported in the server
only if nothing read one: each worker imports the others itself, with its own rank. (A
module cannot be taken out again once imported: forgetting it and the modules that imported
it broke packages whose imports depend on their order, torchmetrics under Lightning.)
Reads from C (`getenv(3)`) are not seen.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.machinery
import importlib.util
import json
import os
import select
import signal
import site
import sys
import sysconfig
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from unbroken.control.worker_env import JOB_VARIABLES, node_dir

MODULES_FILE = "modules.json"
"""The node's list of modules its local-rank-0 worker imported, in `RUN_DIR/node_K/`."""

_MAX_NAMES = 50_000  # a list longer than any real interpreter's sys.modules is not read past this
_MAX_BYTES = 8 << 20


def modules_path(run_dir: str | os.PathLike[str], node_rank: int) -> Path:
    return node_dir(run_dir, node_rank) / MODULES_FILE


# Modules whose import is an action, not a definition: never imported ahead of time.
_ACTIONS = frozenset({"antigravity", "this", "__main__", "__hello__", "__phello__"})


def valid_name(name: object) -> bool:
    """A dotted identifier (`a`, `a.b_c`): all a warm interpreter takes from the file.
    A `__main__` module (`unittest.__main__` runs tests) and the stdlib's jokes are not."""
    if not (isinstance(name, str) and 0 < len(name) <= 512):
        return False
    parts = name.split(".")
    return (all(part.isidentifier() for part in parts) and "__main__" not in parts
            and parts[0] not in _ACTIONS)


def _installed_roots() -> tuple[str, ...]:
    """The stdlib and site-packages directories of this interpreter (and of the one a
    virtual environment was made from), each ending with a separator."""
    dirs: set[str] = set()
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix,
                                          "installed_base": prefix,
                                          "installed_platbase": prefix})
        dirs.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    try:
        dirs.update(site.getsitepackages())
        if site.ENABLE_USER_SITE:
            dirs.add(site.getusersitepackages())
    except AttributeError:
        pass  # an embedded or patched `site` without these
    roots = set()
    for d in dirs:
        for form in (os.path.abspath(d), os.path.realpath(d)):
            roots.add(os.path.join(form, ""))
    return tuple(sorted(roots))


class InstalledPaths:
    """Whether a file belongs to an installed package or the standard library."""

    def __init__(self, exclude: Iterable[str] = ()) -> None:
        self.roots = _installed_roots()
        self.exclude = tuple(os.path.join(os.path.abspath(d), "") for d in exclude)

    def contains(self, path: str) -> bool:
        p = os.path.abspath(path)
        if any(p.startswith(x) for x in self.exclude):
            return False
        return any(p.startswith(r) for r in self.roots)

    def module(self, module: ModuleType | None) -> bool:
        """A module (an entry of sys.modules) from an installed package or the stdlib.
        Built-in and synthetic modules (no file) are left out: they come with their parents."""
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            return self.contains(file)
        locations = getattr(module, "__path__", None)  # a namespace package: every portion
        try:
            locations = [p for p in locations if isinstance(p, str)] if locations else []
        except TypeError:
            return False
        return bool(locations) and all(self.contains(p) for p in locations)

    def spec(self, spec: importlib.machinery.ModuleSpec) -> bool:
        """What importing `spec` would load is installed code (checked before importing)."""
        if spec.origin in ("built-in", "frozen"):
            return True
        if spec.origin and spec.has_location:
            return self.contains(spec.origin)
        locations = list(spec.submodule_search_locations or [])
        return bool(locations) and all(self.contains(p) for p in locations)


class ImportRecorder:
    """Writes the worker's installed modules to `path` whenever sys.modules has grown."""

    def __init__(self, path: Path, script_dir: str | None = None, interval: float = 1.0,
                 max_interval: float = 30.0) -> None:
        self.path = path
        self.paths = InstalledPaths([script_dir] if script_dir else [])
        self.interval, self.max_interval = interval, max_interval
        self._verdicts: dict[str, bool] = {}
        self._seen = -1
        self._written: list[str] | None = None
        self._lock: int | None = None  # the fd whose flock makes this worker the node's writer

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="unbroken-import-recorder", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        interval = self.interval
        while True:
            time.sleep(interval)
            try:
                changed = self.record()
            except Exception:  # noqa: BLE001 - never disturb the worker: stop recording
                return
            interval = self.interval if changed else min(2 * interval, self.max_interval)

    def names(self) -> list[str]:
        """sys.modules' installed modules, in the order they were first imported."""
        names = []
        for name, module in sys.modules.copy().items():  # copy(): atomic under the GIL
            keep = self._verdicts.get(name)
            if keep is None:
                keep = (valid_name(name) and name not in ("__main__", "__mp_main__")
                        and module is not None and self.paths.module(module))
                self._verdicts[name] = keep
            if keep:
                names.append(name)
        return names

    def _hold(self) -> bool:
        """Whether this worker writes the node's list: the one that holds the lock does
        (until it dies, when the next look of another worker takes over)."""
        if self._lock is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(f"{self.path.name}.lock"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._lock = fd
        return True

    def record(self) -> bool:
        """Rewrite the list if sys.modules grew (or the file went away); True if written."""
        if not self._hold():
            return False
        if len(sys.modules) == self._seen and self.path.exists():
            return False
        self._seen = len(sys.modules)
        names = self.names()
        if names == self._written and self.path.exists():
            return False
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "t": round(time.time(), 6), "modules": names}, fh)
        os.replace(tmp, self.path)
        self._written = names
        return True


class _RecordingEnviron(os._Environ):  # type: ignore[name-defined]
    """`os.environ`'s class while `environ_reads` is active: a lookup of a watched key
    (`[]`, `get`, `in`, `os.getenv`: all go through `__getitem__`) notes the modules whose
    top-level code is running, innermost first."""

    sink: dict[str, list[str]] | None = None
    watched: frozenset[str] = frozenset()

    def __getitem__(self, key: str) -> str:
        sink = _RecordingEnviron.sink
        if sink is not None and key in _RecordingEnviron.watched:
            frame, importing = sys._getframe(1), []
            while frame is not None:
                if frame.f_code.co_name == "<module>":
                    importing.append(str(frame.f_globals.get("__name__")))
                frame = frame.f_back
            sink.setdefault(key, []).extend(m for m in importing if m not in sink[key])
        return super().__getitem__(key)


@contextmanager
def environ_reads(watched: Iterable[str] = JOB_VARIABLES) -> Iterator[dict[str, list[str]]]:
    """While the block runs, note each lookup of a `watched` variable in `os.environ`:
    variable -> the modules whose import was running (the reader, then its importers).
    Not reentrant; one thread (the fork server imports on its main thread only)."""
    env, reads = os.environ, {}
    previous = type(env)
    _RecordingEnviron.sink, _RecordingEnviron.watched = reads, frozenset(watched)
    env.__class__ = _RecordingEnviron
    try:
        yield reads
    finally:
        env.__class__ = previous
        _RecordingEnviron.sink = None


PROBE_BOUND = 60.0
"""Seconds a probe's import may take; past it the probe is killed and the module skipped."""


def probe(name: str, bound: float = PROBE_BOUND) -> dict[str, Any] | None:
    """Import `name` in a throwaway fork of this process, under `environ_reads`, with its
    output discarded: `{"reads": {variable: [modules]}}` (the job variables its import
    read; empty: none) or `{"error": "..."}`; None if the child died or passed `bound`
    (then it is killed). This process imports nothing."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: import, say what was read, exit without any teardown
        try:
            os.close(r)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with environ_reads() as reads:
                        importlib.import_module(name)
                said: dict[str, Any] = {"reads": reads}
            except BaseException as exc:  # noqa: BLE001 - a SystemExit at import included
                said = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            os.write(w, json.dumps(said).encode())
        finally:
            os._exit(0)
    os.close(w)
    data, deadline, done = b"", time.monotonic() + bound, False
    try:
        while not done:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                break
            chunk = os.read(r, 1 << 16)
            data, done = data + chunk, not chunk
    finally:
        os.close(r)
        if not done:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        said = json.loads(data) if done else None
    except ValueError:
        return None
    return said if isinstance(said, dict) else None


class Preimporter:
    """A warm interpreter's side: import the listed modules, one at a time, between looks
    at stdin.

    Each import is checked first (`find_spec` without running anything: the module must be
    installed code) and guarded: a module that fails to import is counted and skipped.
    Import-time warnings are silenced: the worker that recorded the list has shown them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.paths = InstalledPaths()
        self._stamp: tuple[int, int, int] | None = None
        self._queue: deque[str] = deque()
        self._listed: set[str] = set()
        self._baseline = len(sys.modules)  # torch and the runtime, imported before
        self.failed: list[str] = []  # raised while importing
        self.refused: list[str] = []  # not installed code where this interpreter looked for it
        self.dropped: dict[str, list[str]] = {}  # its import read a job's variable: -> them
        self.seconds = 0.0

    def refresh(self) -> bool:
        """Queue the names listed since the last look; True if the file changed."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        if st.st_size > _MAX_BYTES:
            return True
        try:
            names = json.loads(self.path.read_text(encoding="utf-8"))["modules"]
        except (OSError, ValueError, KeyError, TypeError):
            return True  # torn or foreign: looked at again when it changes
        if not isinstance(names, list):
            return True
        for name in names[:_MAX_NAMES]:
            if valid_name(name) and name not in self._listed:
                self._listed.add(name)
                self._queue.append(name)
        return True

    @property
    def pending(self) -> int:
        """Names still queued (some may have come in with an earlier import since)."""
        return len(self._queue)

    def missing(self) -> int:
        """Queued names not imported yet."""
        return sum(1 for name in self._queue if name not in sys.modules)

    @property
    def added(self) -> int:
        """Modules in sys.modules that the pre-imports brought in (their own imports too)."""
        return len(sys.modules) - self._baseline

    @property
    def listed(self) -> int:
        """Distinct valid names read from the list so far."""
        return len(self._listed)

    def caught_up(self) -> bool:
        """Every name the list holds now has been dealt with (imported, dropped, failed or
        refused): the file is looked at again first, so a report made on True covers the
        list as it is at this moment, not as it was at the last look."""
        if self._queue:
            return False
        self.refresh()
        return not self._queue

    def tally(self) -> tuple[int, int, int, int, int]:
        """What a report says, counted: names listed, modules added, dropped, failed,
        refused."""
        return (self.listed, self.added, len(self.dropped), len(self.failed),
                len(self.refused))

    def step(self) -> None:
        """Import the next listed module not imported yet (already imported ones are skipped
        without cost: most come in with an earlier one)."""
        while self._queue:
            name = self._queue.popleft()
            if name in sys.modules:
                continue
            t0 = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._load(name)
            self.seconds += time.monotonic() - t0
            return

    def _load(self, name: str) -> bool:
        if name in sys.modules:
            return True
        if name in self.dropped or name in self.failed or name in self.refused:
            return False  # a parent already given up on, for each of its listed children
        parent = name.rpartition(".")[0]
        if parent and not self._load(parent):
            return False
        try:
            spec = importlib.util.find_spec(name)
        except (Exception, SystemExit):  # noqa: BLE001
            self.failed.append(name)
            return False
        if spec is None or not self.paths.spec(spec):
            self.refused.append(name)
            return False
        said = probe(name)  # first in a throwaway fork: what its import reads
        if said is None or "error" in said:
            self.failed.append(name)
            return False
        if said["reads"]:  # never imported here: each worker imports it with its own rank
            self.dropped[name] = sorted(said["reads"])
            return False
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):  # noqa: BLE001 - skipped: the worker imports it again
            self.failed.append(name)
            return False
        return True
