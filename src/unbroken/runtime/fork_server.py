"""A fork server per node: one process that pays for `import torch` once and forks every
worker, spare and replacement its agent asks for, in milliseconds.

The sequence (docs/design-notes.md, "The fork server"): the agent starts the server
(`python -m unbroken.worker --fork-server`, in its own session, a child of the agent) and
makes itself the child subreaper; the server imports torch, the runtime and, between
requests, the modules the node's workers imported (`warm_imports`, its safety rule), then
freezes its objects for the garbage collector (`gc.freeze`), and listens on the node's
socket (`control/fork_requests.py`). For each request it checks that a fork is safe, forks
an intermediate child, which forks the worker and exits at once: the worker is reparented
to the agent, which reaps it and gets its exit status as a torchrun worker's. The worker
makes itself what a fresh `python -m unbroken.worker ARGV` would be (`fork_child.become`:
its session, environment, files, signals, umask, priority, RNGs, command line), runs the
worker's entry point, and exits with the status `python` would.

What the server may never do, checked before every fork (`unsafe`): run a thread it did not
start with (a thread holding a lock at a fork leaves that lock held for ever in the child),
initialise CUDA (`libcuda` mapped, or a `/dev/nvidia*` file open: a forked CUDA context is
unusable), or have a child of its own. An unsafe server refuses the request with the reason;
the agent starts that worker cold and says so. The server runs no tensor op and compiles
nothing; a module it preimports runs only its import.
"""

from __future__ import annotations

import gc
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from unbroken.control.codec import decode, encode
from unbroken.control.fork_requests import (
    SOCKET_VARIABLE,
    ForkReply,
    ForkRequest,
)
from unbroken.control.worker_env import WorkerEnv
from unbroken.kinship import die_with
from unbroken.runtime.fork_child import Birth, become, set_title
from unbroken.runtime.warm_imports import Preimporter, modules_path
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EVENTS_FILE, EventLog


def serve(child_main: Callable[[], None]) -> None:
    """Run the node's fork server until its agent closes the connection (or dies: the
    kernel then kills the server). `child_main` is what each child runs: the worker's entry
    point, with `sys.argv[1:]` its arguments."""
    birth = Birth.now()  # what a fresh interpreter has: each child gets it back
    die_with(int(os.environ.get("UNBROKEN_AGENT_PID") or 0))
    path = os.environ[SOCKET_VARIABLE]
    _import_the_runtime()
    threads = _tasks()  # what native libraries started at import (OpenBLAS's pool): accounted
    env = WorkerEnv.from_environ()
    pre = Preimporter(modules_path(env.run_dir, env.node_rank)) if env.run_dir else None
    log = EventLog(os.path.join(env.run_dir, EVENTS_FILE) if env.run_dir else None,
                   source="fork_server", node=env.node_rank)
    set_title(b"unbroken fork server")
    gc.freeze()  # objects made so far are never touched by a collection: pages stay shared
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        listener.bind(path)  # 0600: only the agent's user may ask for a fork
    finally:
        os.umask(old)
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()
    reported: tuple[int, ...] = (0, 0, 0, 0, 0)
    with conn, conn.makefile("rb") as requests:
        while True:
            if not _wait_for_request(conn, pre):
                if pre is not None and pre.caught_up() and pre.tally() != reported:
                    reported = pre.tally()  # caught up with the list: said once per change
                    log.emit(ev.WarmInterpreterImports(
                        pid=os.getpid(), listed=pre.listed, modules=pre.added, failed=pre.failed,
                        refused=pre.refused, dropped=pre.dropped or None,
                        duration=round(pre.seconds, 6)))
                continue
            line = requests.readline()
            if not line:
                return  # the agent is done with us
            request = decode(ForkRequest, line.decode())
            why = unsafe(threads)
            reply = ForkReply(error=why) if why else _fork(request, conn, child_main, birth, log)
            conn.sendall(encode(reply).encode() + b"\n")


def _wait_for_request(conn: socket.socket, pre: Preimporter | None) -> bool:
    """True once a request is readable; meanwhile import one listed module at a time (no
    thread: an import racing a fork could leave an import lock held in the child), on CPU
    that training leaves idle (`_idle`)."""
    busy = pre is not None and pre.pending > 0
    ready, _, _ = select.select([conn], [], [], 0 if busy else 1.0)
    if ready:
        return True
    if pre is not None:
        if busy:
            with _idle():
                pre.step()
        else:
            pre.refresh()
    return False


@contextmanager
def _idle() -> Iterator[None]:
    """Run the block under SCHED_IDLE, then back to the policy we had: the server's imports
    never slow the node's training (where we may raise the policy back: as root)."""
    if os.geteuid() != 0:
        yield
        return
    try:
        policy = os.sched_getscheduler(0)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, os.sched_param(0))


def _import_the_runtime() -> None:
    """What every worker imports first: paid once, here."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  - imported by the first optimizer built: ~1 s
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import unbroken.runtime.run  # noqa: F401


def unsafe(threads: set[int]) -> str | None:
    """Why forking now could hand the child a broken process, or None."""
    extra = _tasks() - threads
    if extra or threading.active_count() > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return (f"the fork server runs {len(extra)} thread(s) it did not start with "
                f"({', '.join(names) or 'native'}): a fork could inherit a held lock")
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        if any("libcuda.so" in line for line in maps):
            return "the fork server has libcuda mapped (a preimport initialised CUDA)"
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            return f"the fork server holds {target} open (a preimport initialised CUDA)"
    return None


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _fork(request: ForkRequest, conn: socket.socket, child_main: Callable[[], None],
          birth: Birth, log: EventLog) -> ForkReply:
    """Fork the worker of `request` through an intermediate child; its pid."""
    r, w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:  # the intermediate: fork the worker, say its pid, exit
        os.close(r)
        try:
            worker = os.fork()
            if worker == 0:
                os.close(w)
                become(request, conn, child_main, birth, log)  # never returns
            os.write(w, str(worker).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as said:
        pid = said.read()
    os.waitpid(intermediate, 0)
    return ForkReply(pid=int(pid)) if pid else ForkReply(error="the fork failed")
