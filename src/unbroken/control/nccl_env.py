"""The environment an in-place worker's NCCL needs, declared once: the launcher sets it for
every worker (`launch/worker_spawn.launcher_defaults`), and the worker checks it again when
its first group is formed (a script may change `os.environ` before that:
`runtime/groups/script_group.py`). A user's different value is overridden, with one line naming the
variable, theirs and ours. Pure; reads no environment of its own
(docs/design-notes.md, "NCCL's asynchronous semantics"; shared/reviews' risks 2, 3 and 9).

What each setting prevents is torch killing or stalling a survivor that we recover in place:
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One variable an in-place worker's NCCL must have."""

    name: str
    value: str
    why: str
    since: tuple[int, int] = (0, 0)
    """The torch release (major, minor) from which it is needed."""


IN_PLACE = (
    Setting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2",
            "a communicator error aborts the communicators and never the process "
            "(torchrun's 1 and torch's default 3 tear the survivor down)"),
    Setting("TORCH_NCCL_DUMP_ON_TIMEOUT", "0",
            "torch's heartbeat monitor polls the job's store for an exception_dump key that "
            "nothing clears, and kills every later replacement ~8 min after it joins"),
    Setting("TORCH_NCCL_ENABLE_MONITORING", "0",
            "torch's heartbeat monitor aborts a process it finds stuck; our hang detection "
            "blames the culprit and replaces it alone"),
    Setting("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "250",
            "after an NCCL error torch's watchdog sleeps 4x this (60 s by default) holding a "
            "lock that tearing the group down waits on"),
    Setting("TORCH_DIST_USE_NCCL2", "0",
            "torch 2.15's `nccl` is ProcessGroupNCCL2, whose watchdog SIGABRTs the process on "
            "an abort, a timeout or an NCCL error: legacy NCCL until nccl2 is qualified on a GPU",
            since=(2, 15)),
)
"""The in-place settings, in the order they are said."""

NOT_IN_PLACE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
"""Without in-place recovery, torchrun's defaults (set only where the user set nothing)."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.15.0+cu128" -> (2, 15))."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def needed(env: Mapping[str, str], in_place: bool,
           torch_version: str) -> tuple[dict[str, str], list[str]]:
    """The variables to set over `env` (name -> value), and one line for each value of the
    user's it overrides."""
    if not in_place:
        return {k: v for k, v in NOT_IN_PLACE.items() if k not in env}, []
    release = torch_release(torch_version)
    changes, lines = {}, []
    for s in IN_PLACE:
        if release < s.since or env.get(s.name) == s.value:
            continue
        if s.name in env:
            lines.append(f"unbroken: {s.name}={env[s.name]} overridden with {s.value} for "
                         f"in-place recovery: {s.why}")
        changes[s.name] = s.value
    return changes, lines
