"""An exact checksum of a rank's training state, for comparing data-parallel replicas.

Replicas of a data-parallel job (every DDP rank; the ranks of one shard index under HSDP)
must hold bit-identical parameters and optimizer state after every step: they start equal,
receive the same all-reduced gradients and apply the same update. A replica whose state
differs has met silent data corruption (a flipped bit in memory, a faulty ALU, a bad copy).
`checksum(state_tensors(model, optimizers))` on every replica, gathered and compared
(`replicas.decide`), finds it.

The checksum is exact: each tensor's bits are read as integer words (int32 for a 4-byte
dtype, int16 for 2 bytes, int64 for 8, uint8 for 1 byte and for bool) and summed in int64.
Integer addition is associative, so the sum is bit-deterministic on CPU and GPU whatever
order the reduction runs in (a float sum is not, and would also miss bits that rounding
drops). A flip of bit b changes one word by +-2^b, which is never 0 mod 2^64, so every
single-bit flip changes the plain sum; the second, position-weighted sum (tensor i counts
i + 1 times) catches two tensors of equal size that were swapped.

What it catches: state that differs between replicas after a step. What it cannot catch:

- corruption before the gradient all-reduce (a bad gradient, a bad activation): the
  all-reduce hands it to every replica alike, so they still agree (the numerics checks, NaN
  and loss spikes, are the guard there);
- buffers: they are left out on purpose, since they may legitimately differ between DDP
  ranks (BatchNorm's running statistics, from each rank's own batch);
- pure FSDP (and any rank alone in its replica class): it has no replicas to compare with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer word each element size is read as."""

_MOD = 1 << 64
_HALF = 1 << 63


def wrap64(x: int) -> int:
    """`x` mod 2^64, as a signed int64 (in [-2^63, 2^63)): it fits an int64 tensor."""
    return (x + _HALF) % _MOD - _HALF


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (asked without importing DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(model: torch.nn.Module,
                  optimizers: Iterable[torch.optim.Optimizer] = ()) -> list[torch.Tensor]:
    """The tensors that replicas must hold bit-identical, detached, in a fixed order: every
    parameter of `model` (a DTensor's local view), then, for each optimizer, each param
    group, each parameter of the group, the tensor values of its state in sorted key order
    (AdamW's `step`, `exp_avg`, `exp_avg_sq`: the 0-dim step counter included). Buffers are
    left out (they may differ between DDP ranks), and so are non-tensor state values."""
    out = [local_tensor(p).detach() for p in model.parameters()]
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p, {})
                out += [local_tensor(state[k]).detach() for k in sorted(state)
                        if isinstance(state[k], torch.Tensor)]
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as a flat tensor of integer words (an element of 16 bytes, complex128, is
    read as two int64 words)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    size = flat.element_size()
    return flat.view(_WORDS.get(size, torch.int64))


def checksum(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(sum of every tensor's words, sum of (i + 1) x tensor i's word sum), each mod 2^64 as
    a signed int64 (`wrap64`): equal for bit-identical tensor lists, different after any
    single-bit flip (the first) and after two unequal tensors of one size are swapped (the
    second, except with negligible odds).

    The tensors are read where they lie: each one's word sum is computed on its device and
    the sums of a device are stacked there, so the only synchronisation is one read of that
    stack (one int64 per tensor) per device; the weighting is then exact integer arithmetic
    here. (A model on an accelerator usually has CPU tensors too: AdamW keeps its `step`
    counters on the CPU unless it is fused or capturable; their sums cost no transfer.)"""
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        index, sums = by_device.setdefault(t.device, ([], []))
        index.append(i)
        # Words of 4 bytes or less summed into int64 cannot overflow (under 2^32 words);
        # int64 words wrap mod 2^64 in torch's int64 sum, which is what is wanted here.
        sums.append(torch.sum(_words(t), dtype=torch.int64))
    plain = weighted = 0
    for index, sums in by_device.values():
        for i, s in zip(index, torch.stack(sums).tolist(), strict=True):
            plain += s
            weighted += (i + 1) * s
    return wrap64(plain), wrap64(weighted)
