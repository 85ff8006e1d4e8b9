"""The launcher owns the process group, even when the script (or its framework) forms it.

Hugging Face Accelerate, Lightning and torchtitan call `init_process_group` themselves and
skip it when a group exists. Under `unbroken run`, the worker's bootstrap replaces that call
(`install`), so that the group a script forms is one the engine can abort and re-form:

- its sockets are recorded in this process's `AbortableGroups` (`process_group.this_process`),
  which the engine aborts when it leaves a generation;
- under NCCL the communicator is bound to the worker's device (`device_id`), which the
  abort needs;
- a joiner (a spare, or a replacement under in-place recovery) forms the stand-in world
  (`shards.fake_world`) instead: the real generation is planned by the leader, and the
  joiner enters it from the engine (`Engine.start`), not from the script's call.

Only the process's first group is formed this way; the engine's own later groups (a new
generation, the checkpoint's groups) and the stand-in world pass through untouched.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any

from unbroken.control.worker_env import Role, WorkerEnv
from unbroken.import_hooks import when_imported

_formed_here = False  # this process's first group was formed through `install`'s call
_first_done = False  # a group was formed in this process: later calls pass through


def formed_by_launcher() -> bool:
    """The default group was formed by the script's call, the launcher's way (`install`)."""
    return _formed_here


def install(env: WorkerEnv) -> None:
    """Make the script's `init_process_group` form the launcher's group (once torch.distributed
    is imported by the script: nothing is imported here)."""
    when_imported("torch.distributed", lambda dist: _replace(dist, env))


def _replace(dist: ModuleType, env: WorkerEnv) -> None:
    original = dist.init_process_group
    if getattr(original, "_unbroken", False):
        return  # installed already

    @functools.wraps(original)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        global _first_done
        if dist.is_initialized() or _first_done or backend == "fake":
            # A group exists (torch's own error), the engine's later groups, or the
            # stand-in world (`unbroken.init()`'s, for a joiner): untouched.
            _first_done = True
            return original(backend, *args, **kwargs)
        _first_done = True
        return _form(original, env, backend, args, kwargs)

    init_process_group._unbroken = True  # type: ignore[attr-defined]
    # Every binding of the original: the package's, the module's, and any module of torch
    # that imported the name (device_mesh forms the default group through it).
    for name, module in list(sys.modules.items()):
        if (name == "torch.distributed" or name.startswith("torch.distributed.")) \
                and getattr(module, "init_process_group", None) is original:
            module.init_process_group = init_process_group


def _form(original: Any, env: WorkerEnv, backend: Any, args: tuple, kwargs: dict) -> None:
    global _formed_here
    import torch

    from unbroken.control import nccl_env
    from unbroken.runtime.groups.process_group import nccl_backed, this_process
    from unbroken.runtime.groups.world import fake_world

    joiner = env.joining or env.role == Role.SPARE
    if env.in_place and joiner and env.world_size > 1:
        fake_world(0 if env.role == Role.SPARE else (env.slot if env.slot is not None
                                                      else env.rank), env.world_size)
        _formed_here = True
        return
    if env.in_place:  # the script may have changed os.environ since the launcher set it
        changes, lines = nccl_env.needed(os.environ, True, torch.__version__)
        os.environ.update(changes)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
    if nccl_backed(backend, torch.cuda.is_available()) and "device_id" not in kwargs:
        if torch.cuda.current_device() != env.local_rank:
            torch.cuda.set_device(env.local_rank)
        kwargs["device_id"] = torch.device("cuda", env.local_rank)
    groups = this_process()
    with groups.recording():
        original(backend, *args, **kwargs)
    groups.backend = str(sys.modules["torch.distributed"].get_backend())
    _formed_here = True
