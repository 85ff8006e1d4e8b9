"""A DDP communication hook whose result does not depend on how gradients are bucketed.

DDP reduces gradients bucket by bucket, and a ring all-reduce sums each element in an order
set by where it falls in its bucket. A DDP built in a new generation starts with a different
bucket layout than one that has run for a while (it re-buckets after its first step), so the
same step can differ in the last bits after a recovery. This hook gathers every rank's bucket
and sums in rank order, so each element is always ((g0 + g1) + g2) + ... / world: with it, a
run with failures and replacements ends bit-identical to a failure-free one. It moves about
twice the bytes of a ring all-reduce; use it when exactness is worth that.

    ddp = DDP(model); ddp.register_comm_hook(None, unbroken.exact_allreduce)

(No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.)
"""


import torch
import torch.distributed as dist


def exact_allreduce(process_group: dist.ProcessGroup | None,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ranks, summing in rank order (a DDP comm hook)."""
    buffer = bucket.buffer()
    world = dist.get_world_size(process_group)
    parts = [torch.empty_like(buffer) for _ in range(world)]
    work = dist.all_gather(parts, buffer, group=process_group, async_op=True)

    def reduce(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # raises if the gather failed (a peer died): never sum a partial gather
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.div_(world)

    return work.get_future().then(reduce)
