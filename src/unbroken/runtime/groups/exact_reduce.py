"""A DDP communication hook whose result does not depend on how gradients are bucketed.

DDP reduces gradients bucket by bucket, and a ring all-reduce sums each element in an order
set by where it falls in its bucket. A DDP built in a new generation starts with a different
bucket layout than one that has run for a while (it re-buckets after its first step), so the
same step can differ in the last bits after a recovery. This hook gathers every rank's bucket
and sums in rank order, so each element is always ((g0 + g1) + g2) + ... / world: with it, a
run with failures and replacements ends bit-identical to a failure-free one. Each rank
receives world - 1 buckets (one broadcast per rank), about world/2 times what a ring
all-reduce moves, and holds two extra buckets; use it when exactness is worth that.

    ddp = DDP(model); ddp.register_comm_hook(None, unbroken.exact_allreduce)

(No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.)
"""


import torch
import torch.distributed as dist

from unbroken.runtime import step_probe


def exact_allreduce(process_group: dist.ProcessGroup | None,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ranks, summing in rank order (a DDP comm hook).

    Each rank's bucket is broadcast in turn and added to the running sum, so the memory is
    two extra buckets whatever the world size (an all-gather would hold one per rank).
    Marks the step probe (`runtime/step_probe.py`) first: the straggler detector's timer."""
    step_probe.mark()
    buffer = bucket.buffer()
    world = dist.get_world_size(process_group)
    me = dist.get_rank(process_group)
    total = torch.empty_like(buffer)
    part = torch.empty_like(buffer)
    for rank in range(world):
        if rank == me:
            part.copy_(buffer)
        src = rank if process_group is None else dist.get_global_rank(process_group, rank)
        dist.broadcast(part, src=src, group=process_group)  # raises if a peer died
        if rank == 0:
            total.copy_(part)
        else:
            total += part
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(total.div_(world))
    return done
