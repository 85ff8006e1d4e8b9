"""Generation 0's process group: formed by `unbroken.init()`, unless the script already did.

Under `unbroken run` each attempt gets a fresh store, and the group is formed on it; under
`torchrun`, under a per-restart prefix of our own (`torchrun_rendezvous`). Joiners (spares,
replacements) form nothing here: they join a generation planned by the leader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unbroken.control.schema import torchrun_restart_prefix
from unbroken.control.worker_env import WorkerEnv
from unbroken.errors import UserError
from unbroken.runtime.groups.process_group import (
    AbortableGroups,
    CheckpointGroups,
    bound_device,
    checkpoint_groups,
    nccl_backed,
)
from unbroken.runtime.groups.script_group import formed_by_launcher
from unbroken.runtime.groups.world import fake_world, is_fake_world


@dataclass(frozen=True)
class FirstGroup:
    """What forming generation 0 left behind."""

    owned: bool
    """The runtime formed the default group (so `close()` destroys it)."""
    ckpt_groups: CheckpointGroups | None
    """The checkpoint's own groups, if there is a default group."""
    seconds: float
    """How long forming took."""
    formed_by_script: bool
    """The script formed the group before `init()`, not through the launcher's call (not
    under `unbroken run`): it cannot be aborted from the inside."""


def torchrun_rendezvous(env: WorkerEnv, timeout: float) -> dict[str, Any]:
    """Under torchrun, `init_process_group` arguments that rendezvous under a prefix of our
    own per restart.

    torchrun (torch 2.13) hands every restart the same agent store with no per-restart prefix
    (`TORCHELASTIC_USE_AGENT_STORE`), so a restarted worker can read the dead workers' gloo
    addresses and fail or hang in `init_process_group`. Under `unbroken run` each attempt
    gets a fresh store, and nothing needs doing.
    """
    if not env.agent_store or env.under_agent:
        return {}
    store = dist.TCPStore(env.master_addr, env.master_port, None, False,
                          timedelta(seconds=timeout))
    return {"store": dist.PrefixStore(torchrun_restart_prefix(env.attempt), store),
            "rank": env.rank, "world_size": env.world_size}


def form_first_group(env: WorkerEnv, backend: str, timeout: float, groups: AbortableGroups,
                     *, joining: bool, spare: bool, in_place: bool) -> FirstGroup:
    """Form generation 0's groups (recording their sockets in `groups`, for the abort).

    Raises `UserError` if a spare on NCCL has no GPU of its own."""
    t0 = time.monotonic()
    # A group the script formed through the launcher's call (`script_group`) is ours.
    formed_by_script = dist.is_initialized() and not formed_by_launcher()
    if nccl_backed(backend, torch.cuda.is_available()):
        if spare and env.local_rank >= torch.cuda.device_count():
            raise UserError(
                f"a hot spare needs a GPU of its own, and this node has "
                f"{torch.cuda.device_count()} for {env.local_world_size} worker(s) and the "
                f"spares before this one: run fewer --spares (GPUs - workers per node), "
                f"or put the spares on a --standby node")
        torch.cuda.set_device(env.local_rank)
    owned = False
    with groups.recording():
        if env.world_size > 1 and not dist.is_initialized() and not joining:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout),
                                    **torchrun_rendezvous(env, timeout), **bound_device(backend))
            groups.backend = backend
            owned = True
        # Checkpoint collectives get groups of their own, never the training one (a joiner
        # in the stand-in world forms them when it joins).
        ckpt = (checkpoint_groups(timeout, timeout)
                if dist.is_initialized() and not is_fake_world() else None)
    if in_place and joining and env.world_size > 1 and not dist.is_initialized():
        # A joiner shards its model (if the script does) exactly as its rank will, in a
        # stand-in world that communicates nothing; the real one replaces it at join.
        fake_world(0 if spare else (env.slot if env.slot is not None else env.rank),
                   env.world_size)
    return FirstGroup(owned, ckpt, time.monotonic() - t0, formed_by_script)
