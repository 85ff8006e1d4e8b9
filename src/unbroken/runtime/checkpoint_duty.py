"""What the worker checkpoints and when: the tracked state, at committed steps.

The engine calls these at step boundaries; `Checkpointer` (checkpoint/) does the staging,
the persisting and the commit. Without a checkpoint_dir every call is a no-op, except an
explicit save, which is the user's mistake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from unbroken.errors import UserError
from unbroken.runtime.groups.process_group import CheckpointGroups
from unbroken.runtime.tracked import TrackedState

if TYPE_CHECKING:  # they import DCP (and DTensor): a job without checkpoints never needs it
    from unbroken.checkpoint.checkpointer import Checkpointer
    from unbroken.checkpoint.staging import HostImage


class CheckpointDuty:
    """The engine's checkpoints, over an optional `Checkpointer`."""

    def __init__(self, checkpointer: Checkpointer | None) -> None:
        self.checkpointer = checkpointer
        self.verified: tuple[int, bool | None] = (-1, None)
        """The step of the last `after_commit` and its replica check (None: not checked)."""

    def protect(self, tracked: TrackedState) -> None:
        """Hold back optimizer updates until the staged copy of their tensors is taken."""
        if self.checkpointer is not None:
            self.checkpointer.protect(tracked.model, tracked.optimizers)

    def save(self, tracked: TrackedState, step: int, step_time: float | None,
             image: HostImage | None = None, verified: bool | None = None) -> bool:
        """Start a save of committed step `step` (collective); False if it was deferred.
        `image`: a host copy of the state at `step` to persist from (released either way).
        `verified`: the replicas' checksums agreed at `step` (None: not checked)."""
        if self.checkpointer is None:
            raise UserError("no checkpoint_dir was given to unbroken.init()")
        try:
            state = tracked.state_dict(step)
        except BaseException:
            if image is not None:
                image.release()
            raise
        return self.checkpointer.start(state, step, step_time, image, verified=verified)

    def due(self, step: int) -> bool:
        """A save is due after committed step `step` (the same answer on every rank)."""
        return self.checkpointer is not None and self.checkpointer.due(step)

    def copies(self, step: int, last_step: int) -> bool:
        """A copy of committed step `step` is taken: a save is due, or it is the final one."""
        return self.due(step) or (self.checkpointer is not None and step == last_step)

    @property
    def interval(self) -> int | None:
        """Steps between saves, as the ranks last agreed; None without checkpoints."""
        ck = self.checkpointer
        return ck.schedule.interval if ck is not None and ck.schedule.enabled else None

    def after_commit(self, tracked: TrackedState, step: int, step_time: float | None,
                     image: HostImage | None = None, verified: bool | None = None) -> None:
        """After committed step `step`: a save if the schedule says one is due, persisted
        from `image` where it holds the tensors (the round of this step's host copy), and
        marked `verified` (the replica check of this step: None, not checked)."""
        self.verified = (step, verified)
        if self.due(step):
            self.save(tracked, step, step_time, image, verified)
        elif image is not None:
            image.release()

    def roll_back(self, tracked: TrackedState, host_copy: Any, start: int) -> tuple[int | None, str]:
        """Restore the newest copy of the state (collective): the host copy (`host_copy`: a
        sharded job's own rounds, with `rollback()`; None: the newest save's staged copy),
        else the newest checkpoint in storage. The step restored and where from ("host",
        "storage"); (None, "") when there is neither (nothing changes)."""
        step = host_copy.rollback() if host_copy is not None else self.rollback_in_memory(tracked)
        if step is not None:
            return step, "host"
        step = self.load_newest(tracked, start)
        return step, "storage" if step is not None else ""

    def rollback_in_memory(self, tracked: TrackedState) -> int | None:
        """Restore the newest save's staged copy, if every rank holds one of the same step
        (collective on the checkpoint's control group): no storage read. Its step, or None
        (and nothing changes)."""
        if self.checkpointer is None:
            return None
        kept = self.checkpointer.host_copy()
        if not self.checkpointer.agree_step(kept[0] if kept is not None else -1):
            return None
        state = self.checkpointer.fill_left_out(kept[1])
        # The model's load copies into its parameters; an optimizer's keeps the tensors it
        # is given when their dtype and device match (a CPU job's), and the staged copy's are
        # the next save's buffers: they must not become the live state.
        return tracked.restore({k: v if k == "model" else _cloned(v) for k, v in state.items()})

    def finish(self, tracked: TrackedState, step: int) -> None:
        """The final state, committed before the worker reports done (bounded by the
        checkpoint timeout), marked as the replica check of `step` found it."""
        if self.checkpointer is not None:
            checked, verified = self.verified
            self.checkpointer.finish(tracked.state_dict(step), step,
                                     verified=verified if checked == step else None)

    def load_newest(self, tracked: TrackedState, step: int) -> int | None:
        """Load the newest intact checkpoint into the tracked state (collective); its step,
        or None (and nothing changes) if there is none. A save in flight ends first."""
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()
        built: list[dict[str, Any]] = []  # the state dict, built only if there is one to load

        def build() -> dict[str, Any]:
            built.append(tracked.state_dict(step))
            return built[0]

        if self.checkpointer.load_latest(build) is None:
            return None
        return tracked.restore(built[0])

    def rejoin(self, groups: CheckpointGroups | None, gen: int, step: int) -> None:
        """In a new generation: save over its groups, on a schedule its members agree
        (collective)."""
        if self.checkpointer is not None:
            self.checkpointer.use_groups(groups and groups.writes, groups and groups.control, gen)
            self.checkpointer.rejoin(step)


def _cloned(obj: Any) -> Any:
    """`obj` with each tensor in it cloned (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cloned(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_cloned(v) for v in obj)
    return obj
