"""A rank's local shards of a sharded model (FSDP2, HSDP): what they are, how to copy them
out and back, and how to move them onto a new generation's groups.

Sharded state is never gathered whole: each rank's part is the local tensors of its
DTensors (`to_local()`), plus its plain tensors (buffers, unsharded parameters) and the
optimizer state of both, in one fixed order (`LocalShards.tensors`). Ranks whose mesh
coordinates agree on every sharded dimension hold identical parts (HSDP's replica groups):
they share a *shard index* and can stand in for each other.

A new generation forms new process groups; the model's DTensors and FSDP2's cached groups
still name the old ones. `rebind` re-points the model's mesh at the new generation's groups
in place (same shape, same rank at each coordinate), so no parameter is re-created and the
optimizers keep their references.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class MeshShape:
    """What a generation needs to rebuild the model's mesh: its shape and dimension names."""

    device_type: str
    shape: tuple[int, ...]
    names: tuple[str, ...] | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class LocalShards:
    """The tracked model's and optimizers' state as this rank holds it, as a flat list.

    Order: parameters, buffers, then each optimizer's state per parameter in group order,
    keys sorted. Ranks of one shard index produce the same list of shapes."""

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                 extra: dict[str, Any]) -> None:
        self.model, self.optimizers, self.extra = model, optimizers, extra
        self.mesh = self._the_mesh()
        self.shape = MeshShape(self.mesh.device_type, tuple(self.mesh.mesh.shape),
                               tuple(self.mesh.mesh_dim_names) if self.mesh.mesh_dim_names
                               else None)
        # Mesh dimensions some parameter is sharded over; the others replicate.
        self.shard_dims = sorted({d for p in model.parameters() if isinstance(p, DTensor)
                                  for d, pl in enumerate(p.placements) if isinstance(pl, Shard)})

    def _the_mesh(self) -> DeviceMesh:
        """The one mesh the parameters live on. Equal meshes count as one (`fully_shard`
        without a mesh, as Accelerate calls it, makes a new default mesh per call); every
        one of their objects is kept in `self.copies`, for `rebind`."""
        meshes = {id(p.device_mesh): p.device_mesh for p in self.model.parameters()
                  if isinstance(p, DTensor)}
        distinct = []
        for mesh in meshes.values():
            if all(mesh != seen for seen in distinct):
                distinct.append(mesh)
        if len(distinct) != 1:
            raise TypeError(f"the parameters live on {len(distinct)} device meshes; in-place "
                            "recovery of sharded state handles one (FSDP2 or HSDP)")
        self.copies = list(meshes.values())
        return distinct[0]

    def unsupported(self, world_size: int) -> str | None:
        """Why this state cannot be snapshotted and recovered in place, or None."""
        if self.shape.size != world_size:
            return (f"the device mesh spans {self.shape.size} of the {world_size} ranks "
                    "(one mesh over every rank is handled)")
        if self.mesh.mesh.flatten().tolist() != list(range(world_size)):
            return "the device mesh orders its ranks its own way (init_device_mesh's is handled)"
        for name, p in self.model.named_parameters():
            if isinstance(p, DTensor):
                if p.device_mesh != self.mesh:
                    return f"parameter {name} is on a second device mesh"
                bad = [pl for pl in p.placements if not isinstance(pl, (Shard, Replicate))]
                if bad:
                    return f"parameter {name} has placement {bad[0]} (only Shard and Replicate)"
        params = {id(p) for p in self.model.parameters()}
        for i, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                if any(id(p) not in params for p in group["params"]):
                    return f"optimizer {i} updates a tensor that is not a tracked parameter"
                for key, value in group.items():
                    if key != "params" and not isinstance(value, (int, float, bool, str, type(None), tuple, list)):
                        return f"optimizer {i}'s {key!r} is a {type(value).__name__}"
        try:
            meta = self.meta()
            if json.loads(json.dumps(meta)) != _plain(meta):
                return ("state beside the tensors (an extra object's state_dict) does not "
                        "survive JSON unchanged: keep it to str keys and plain values")
        except (TypeError, ValueError) as exc:
            return f"state beside the tensors is not plain data: {exc}"
        return None

    def rank_independent(self) -> str | None:
        """None if every rank's shards have the same shapes (each sharded dimension divides
        evenly); else the first parameter that does not. A spare sharded as one rank can
        take any slot only then."""
        for name, p in self.model.named_parameters():
            if not isinstance(p, DTensor):
                continue
            for dim, pl in enumerate(p.placements):
                if isinstance(pl, Shard) and p.shape[pl.dim] % self.mesh.size(dim) != 0:
                    return (f"parameter {name}: dimension {pl.dim} ({p.shape[pl.dim]}) over "
                            f"{self.mesh.size(dim)} ranks")
        return None

    def shard_index(self, rank: int) -> int:
        """The shard a rank holds: its mesh coordinates on the sharded dimensions."""
        coords = []
        for dim in range(len(self.shape.shape)):
            stride = math.prod(self.shape.shape[dim + 1:])
            coords.append(rank // stride % self.shape.shape[dim])
        index = 0
        for dim in self.shard_dims:
            index = index * self.shape.shape[dim] + coords[dim]
        return index

    def tensors(self) -> list[torch.Tensor]:
        """This rank's tensors, detached local views (no copy)."""
        out = [_local(p).detach() for p in self.model.parameters()]
        out += [_local(b).detach() for b in self.model.buffers()]
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    out += [_local(state[k]).detach() for k in sorted(state)
                            if isinstance(state[k], torch.Tensor)]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def meta(self) -> dict[str, Any]:
        """The plain data beside the tensors: hyperparameters (a scheduler changes the
        learning rate) and the extra objects' state."""
        return {"groups": [[{k: v for k, v in g.items() if k != "params"}
                            for g in opt.param_groups] for opt in self.optimizers],
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()}}

    def load_meta(self, meta: dict[str, Any]) -> None:
        for opt, groups in zip(self.optimizers, meta["groups"], strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v
                              for k, v in saved.items()})
        for name, obj in self.extra.items():
            obj.load_state_dict(meta["extra"][name])

    def prime(self) -> None:
        """Create the optimizers' lazily made state (a fresh replacement has none), so that
        its tensor list matches a holder's. The values are overwritten by the state received."""
        for opt in self.optimizers:
            if all(opt.state.get(p) for g in opt.param_groups for p in g["params"]):
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            with torch.no_grad():
                opt.step()
            opt.zero_grad(set_to_none=True)

    def load(self, flat: torch.Tensor, layout: Any = None) -> None:
        """Copy a flat byte buffer into this rank's tensors: packed back to back (a shard
        received from a peer), or at `layout`'s aligned offsets (`snapshots.Layout`, a host
        copy's own buffer)."""
        tensors = self.tensors()
        sizes = [t.numel() * t.element_size() for t in tensors]
        if layout is not None and list(layout.sizes) != sizes:
            raise ValueError("the host copy was taken of another set of tensors")
        if layout is not None:
            offsets, end = list(layout.offsets), layout.total
        else:
            offsets = [0, *itertools.accumulate(sizes)][:-1]
            end = sum(sizes)
        if end != flat.numel():
            raise ValueError(f"the state received has {flat.numel()} bytes; this rank's "
                             f"shards have {end}")
        with torch.no_grad():
            for t, pos, n in zip(tensors, offsets, sizes, strict=True):
                chunk = flat[pos:pos + n]
                if pos % t.element_size():
                    chunk = chunk.clone()  # a dtype view needs an aligned offset
                t.copy_(chunk.view(t.dtype).view(t.shape))

    def deferrable(self, total: int) -> list[bool]:
        """Per tensor of `tensors()` (`total` of them): True if only an optimizer update
        changes it (parameters, optimizer state), so that its copy may wait until just
        before the next update; False for buffers, which a forward pass may change."""
        n_params = sum(1 for _ in self.model.parameters())
        n_buffers = sum(1 for _ in self.model.buffers())
        return [True] * n_params + [False] * n_buffers + [True] * (total - n_params - n_buffers)

    def unresettable(self) -> str | None:
        """Why a step aborted mid-flight cannot be undone in this process, or None: FSDP2
        resets its per-iteration state only through `FSDPModule.reset_iter_state` (torch
        2.13+; before it, an aborted forward leaves parameters unsharded and hooks queued
        that nothing public clears). Decided by what the model's root module has."""
        for module in self.model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is not None and not hasattr(module, "reset_iter_state"):
                return ("this torch's FSDP2 cannot reset a step aborted mid-flight "
                        "(FSDPModule.reset_iter_state came in torch 2.13): a fault restarts "
                        "every worker from the checkpoint")
        return None

    def reset_iteration(self) -> None:
        """Put FSDP2 back in its between-steps state after a step aborted mid-flight (its
        parameters unsharded, reductions pending): every group resharded, per-iteration
        trackers cleared, the failed step's gradients dropped. Its pending collectives
        belong to the aborted generation: their failures are the fault being recovered.

        The gradients of micro-batches whose reduction was deferred
        (`set_requires_gradient_sync(False)`) stay on the unsharded parameters, which
        `reset_iter_state` (torch 2.13) does not clear though its docstring says it
        discards them: a redone accumulated step would count them twice. Cleared here."""
        for module in self.model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is None or not state()._is_root:
                continue
            for fsdp_state in state()._state_ctx.all_states:
                for group in param_groups(fsdp_state):
                    result = group._all_gather_result
                    if result is not None and result.all_gather_work is not None:
                        group._all_gather_result = None  # never waited on: it failed
                    for param in group.fsdp_params:
                        param.unsharded_accumulated_grad = None
                        if (unsharded := getattr(param, "_unsharded_param", None)) is not None:
                            unsharded.grad = None
            module.reset_iter_state()

    def rebind(self, fresh: DeviceMesh) -> None:
        """Point the model's mesh (and every DTensor and FSDP2 group on it) at `fresh`, a
        mesh of the same shape on the new generation's groups. Collective-free."""
        if tuple(fresh.mesh.shape) != self.shape.shape:
            raise ValueError(f"new mesh {tuple(fresh.mesh.shape)} != {self.shape.shape}")
        for mesh in self.copies:
            mesh.__dict__.update(fresh.__dict__)
        for module in self.model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            for group in param_groups(state()) if state is not None else ():
                for info in (group.mesh_info, group.post_forward_mesh_info):
                    if info is not None:
                        info.__post_init__()  # re-reads the groups and this rank's place


def param_groups(fsdp_state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in torch 2.13+ (`_fsdp_param_groups`: a
    module may hold several), one or none before (`_fsdp_param_group`, torch 2.11 and 2.12;
    found by gpu_check.py's dry run under 2.11). Decided by what the state holds."""
    groups = getattr(fsdp_state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(fsdp_state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _plain(obj: Any) -> Any:
    """`obj` with tuples as lists: what a JSON round trip may change without harm
    (`load_meta` turns a hyperparameter that was a tuple back into one)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def new_mesh(shape: MeshShape) -> DeviceMesh:
    """The mesh of `shape` over the current default group (collective)."""
    return init_device_mesh(shape.device_type, shape.shape, mesh_dim_names=shape.names)
