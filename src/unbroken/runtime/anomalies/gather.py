"""Every rank's vector, gathered in rank order: the one collective the detectors' executors
share (`anomaly_duty`, `replica_checks`, `straggler_watch`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current CUDA device
    under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather(vec: torch.Tensor) -> list[list[Any]]:
    """Every rank's vector (any dtype: the detectors' floats, the checksums' int64), in rank
    order (collective on the default group: the training group of the current generation),
    one host sync."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [vec.tolist()]
    vec = vec.to(collective_device())
    world = dist.get_world_size()
    out = torch.empty(world * vec.numel(), dtype=vec.dtype, device=vec.device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, vec)
    return out.view(world, -1).tolist()
