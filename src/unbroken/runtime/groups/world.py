"""What kind of model and world a worker has, asked without importing DTensor.

`torch.distributed.tensor` costs about a second to import; a replicated (DDP) worker never
needs it. Nothing can be a DTensor before that module is imported, so the question is
answered from `sys.modules`; the sharded machinery (`shards.py`) imports it when it is used.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def is_sharded(model: torch.nn.Module) -> bool:
    """True if any parameter is a DTensor (FSDP2, HSDP, tensor parallel)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


def fake_world(rank: int, world_size: int) -> None:
    """A one-process stand-in for the real world (collectives do nothing), so that a joiner
    shards its model exactly as rank `rank` of `world_size` would: shard-sized memory, and
    no group to wait for. Replaced by the real group when the joiner joins."""
    from torch._C._distributed_c10d import FakeProcessGroup

    # Torch lists "fake" among its backends but registers its creator only when
    # torch.testing's fake_pg is imported (FSDP1 and DCP's state-dict helpers import it):
    # ask the creators' registry, not the list.
    if "FAKE" not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(
            "fake", lambda opts, backend_opts: FakeProcessGroup._create_internal(
                opts.group_rank, opts.group_size, backend_opts),
            extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


def is_fake_world() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"
