"""The user's DDP object, re-pointed at each new generation's group: their variable works on.

A user's loop holds `model = DDP(net)` and calls it every step. After a switch its reducer
belongs to an aborted group, and its buckets are in the order a survivor rebuilt after its
first step while a joiner's are in the initial order: their all-reduce would sum mismatched
gradients. So every member builds a fresh DDP of the same module, with the old one's
settings and communication hooks, on the new default group (the same collectives on every
member: parameter shapes and a broadcast), and the user's object takes the new one's
attributes in place (`rebind`): `model(...)`, `model.no_sync()` and `model.module` then reach
the new reducer; the old reducer's gradient hooks are removed first, so that the reducer of
an interrupted backward is never used again.

Why in place rather than a proxy the user must hold (`run.wrap(DDP(...))`): the two-line
change stays two lines, and code that tests `isinstance(model, DDP)` (clipping helpers,
frameworks) keeps working. `cannot_rebind` says, in one line, what this cannot rebuild.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def cannot_rebind(ddp: DDP) -> str | None:
    """Why `ddp` cannot be rebuilt on a new group with the same settings, or None."""
    if getattr(ddp, "mixed_precision", None) is not None:
        return "its mixed_precision option ties hooks to the object that was built"
    if getattr(ddp, "device_mesh", None) is not None:
        return "it was built on a device mesh, not on the default group"
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if default is not None and ddp.process_group is not default:
        return "it was built on a process group of the script's own, not on the default group"
    return None


def rebind(ddp: DDP) -> DDP:
    """Rebuild `ddp` on the current default group and move the new one into `ddp` (collective:
    every member of the generation, in the same order). Returns `ddp`."""
    ddp._remove_autograd_hooks()
    kept = {"broadcast_buffers": False} if not ddp.broadcast_buffers else {}
    fresh = DDP(ddp.module, device_ids=ddp.device_ids, output_device=ddp.output_device,
                dim=ddp.dim, find_unused_parameters=ddp.find_unused_parameters,
                bucket_cap_mb=ddp.bucket_bytes_cap / (1024 * 1024),
                gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                static_graph=ddp.static_graph,
                skip_all_reduce_unused_params=getattr(ddp, "skip_all_reduce_unused_params", False),
                **kept)
    for hook, state in getattr(ddp, "_comm_hooks", []):
        fresh.register_comm_hook(state, hook)
    hooks = {name: value for name, value in vars(ddp).items() if "_hooks" in name
             and name != "_comm_hooks" and isinstance(value, dict)}  # the user's module hooks
    vars(ddp).clear()
    vars(ddp).update(vars(fresh))
    vars(ddp).update(hooks)
    return ddp
