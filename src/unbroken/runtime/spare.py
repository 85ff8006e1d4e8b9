"""A hot spare: its warm-up in a sandbox, then its wait to be promoted into a failed slot.

Warm-up runs the real step a few times on a private one-process group (real kernels,
allocator and caches; nothing reaches the job), then discards it. The agent writes the slot into the spare's heartbeat page (shared memory: an idle spare
costs no system call and no store round trip); the spare also looks, once a second, whether
the job has finished without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from unbroken.errors import UserError
from unbroken.runtime.groups.world import is_fake_world
from unbroken.runtime.heartbeat import PHASE_SPARE_READY, HeartbeatWriter

if TYPE_CHECKING:
    from unbroken.runtime.sharded.shards import LocalShards

_POLL = 0.002  # seconds between looks at the heartbeat page
_JOB_CHECK = 1.0  # seconds between looks at the store


def await_promotion(heartbeat: HeartbeatWriter, finished: Callable[[], bool]) -> int | None:
    """The slot this spare was promoted into, or None if the job finished first.

    Stamps the heartbeat as `PHASE_SPARE_READY` meanwhile, so that the agent can offer it."""
    heartbeat.stamp(-1, PHASE_SPARE_READY)
    checked = time.monotonic()
    while (slot := heartbeat.promotion()) is None:
        time.sleep(_POLL)
        if time.monotonic() - checked > _JOB_CHECK:
            checked = time.monotonic()
            heartbeat.stamp(-1, PHASE_SPARE_READY)
            if finished():
                return None
    return slot


def warm_up(shadow_step: Callable[[int, Any], None], build: Callable[[], Any], steps: int,
            shards: LocalShards | None) -> dict[str, Any]:
    """Run `shadow_step(step, view)` `steps` times on `build()`'s view, in a world that
    reaches no one; return what the `spare_ready` event says about the state's size.

    Sharded: in the stand-in world of the real size, as rank 0, so that only shard-sized
    state is ever allocated (the caller has placed the position at rank 0). Replicated: on a
    private one-process gloo group (the caller has placed it at rank 0 of 1). The state is
    replaced by a peer's when the spare is promoted. Raises `UserError` for a sharded model
    whose shards differ in shape between ranks (no one spare can serve every slot)."""
    if shards is not None:
        uneven = shards.rank_independent()
        if uneven is not None:
            raise UserError(f"a hot spare cannot serve this sharded model: {uneven} does "
                            "not divide evenly, so each rank's shard has its own shape; "
                            "make the sharded dimensions divisible by the world size, "
                            "or run without --spares (replacements start per slot)")
        _shadow(shadow_step, build, steps)
        return {"sharded": True, "shard_bytes": shards.nbytes(),
                "largest_tensor_bytes": max((t.numel() * t.element_size()
                                             for t in shards.tensors()), default=0),
                "cpu": round(time.process_time(), 6)}
    if is_fake_world():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _shadow(shadow_step, build, steps)
    finally:
        dist.destroy_process_group()
    return {"cpu": round(time.process_time(), 6)}


def _shadow(shadow_step: Callable[[int, Any], None], build: Callable[[], Any],
            steps: int) -> None:
    view = build()
    for step in range(steps):
        shadow_step(step, view)
