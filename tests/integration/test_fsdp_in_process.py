"""FSDP2 in one process, on a world of one that communicates nothing (torch's fake
backend): what the sharded path does to FSDP2's own state, checked against FSDP2 itself.
In the integration tier because it forms a process group."""

from __future__ import annotations

import torch

from unbroken.runtime.sharded.shards import LocalShards


def _shards(model: torch.nn.Module) -> LocalShards:
    shards = object.__new__(LocalShards)  # only the model is read: no mesh, no group
    shards.model = model
    return shards


def test_a_reset_step_drops_the_gradients_of_its_deferred_micro_batches():
    """A micro-batch whose reduction was deferred (`set_requires_gradient_sync(False)`) leaves
    its gradient on the unsharded parameters; torch 2.13's `reset_iter_state` keeps it, so a
    redone accumulated step would count it twice. After `reset_iteration` the redone step's
    gradients are those of the step alone. FSDP2 on a world of one that communicates nothing
    (torch's fake backend)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from unbroken.runtime.groups.world import fake_world

    fake_world(0, 1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        fully_shard(model)
        x = torch.ones(2, 3)

        def gradients() -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            return [p.grad.full_tensor().clone() for p in model.parameters()]

        alone = gradients()
        model.zero_grad(set_to_none=True)
        model.set_requires_gradient_sync(False)
        model(x).sum().backward()  # the first micro-batch; then the step is aborted
        model.set_requires_gradient_sync(True)
        _shards(model).reset_iteration()
        assert all(torch.equal(a, b) for a, b in zip(alone, gradients(), strict=True))
    finally:
        dist.destroy_process_group()
