"""One try of a step of the user's own loop: what `with run.try_step():` is.

The block holds the step's forward, backward and update as the user wrote them. What holds:
- **The commit** is the return of the last tracked optimizer's `step()` in the block (its
  post-hook, after the fence of `runtime/generations/fence.py` in its pre-hook). From the
  first tracked optimizer's update to that return the rank is *torn*: a fault then leaves it
  without committed state, which a peer sends. Tracked LR schedulers are stepped by the
  runtime at the commit, once per committed step, and a call of the user's `step()` on them is
  then a no-op (`guard_scheduler`): so that a step's state (model, optimizer, scheduler) is
  whole at its commit, whoever steps the scheduler and however often.
- **A fault in the block before the commit**: `__exit__` hands it to the engine (`fail`: a
  peer's fault is recovered in place, anything the engine cannot help propagates), swallows
  it, and the loop yields the same step and batch again. A `with` body cannot run twice, so
  code after the block runs once per try; anything that talks to peers belongs inside.
- **A fault after the commit** (the user's own all-reduce of the loss after the update) is
  recovered in place as committed: the next step comes.
- **A block that ends with no update** (a GradScaler skipped it): the step commits without
  one and is never redone.
- **An anomaly verdict** (numerical checks, `AnomalyConfig`) is taken before the first update;
  anything but commit ends the block (`StepSettled`) and the loop goes on as the engine said.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

from unbroken.errors import UserError
from unbroken.runtime.engine import Engine, Verdict
from unbroken.runtime.tracked import TrackedState


class StepSettled(BaseException):  # noqa: N818  (not an error: a control transfer)
    """The engine settled the step before its update (an anomaly's verdict): the block ends.
    A BaseException, so that a user's `except Exception` around the update lets it through."""


def guard_scheduler(scheduler: Any) -> Any:
    """Make `scheduler.step()` a no-op unless the returned function calls it. The instance's
    class becomes a subclass whose `step` checks the guard (an instance attribute would be in
    its `state_dict`, and so in checkpoints). Returns the runtime's own step."""
    if (guarded := getattr(type(scheduler), "_unbroken_runtime_step", None)) is not None:
        return guarded  # a second loop over the same scheduler
    cls, allowed = type(scheduler), [False]

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if allowed[0]:
            return cls.step(self, *args, **kwargs)
        return None  # the runtime stepped it at the commit

    def runtime_step() -> None:
        allowed[0] = True
        try:
            scheduler.step()
        finally:
            allowed[0] = False

    scheduler.__class__ = type(cls.__name__, (cls,), {
        "step": step, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "_unbroken_runtime_step": staticmethod(runtime_step)})
    return runtime_step


def stepped_per_update(obj: Any) -> bool:
    """A tracked object the runtime steps at each commit: an LR scheduler, or a wrapper of
    one that steps it (Accelerate's `AcceleratedScheduler`); not `ReduceLROnPlateau`, whose
    step needs a metric."""
    schedulers = (obj, getattr(obj, "scheduler", None))
    return any(isinstance(s, torch.optim.lr_scheduler.LRScheduler) for s in schedulers) \
        and not any(isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) for s in schedulers)


class StepBlock:
    """The tries of the steps of one `run.steps(total, data=...)` loop. `open(step)` arms it
    for a try; `run.try_step()` is its context; `close()` says how the try ended."""

    def __init__(self, engine: Engine, tracked: TrackedState, metrics: dict[str, float]) -> None:
        """Hooks every tracked optimizer (after the fence's pre-hook, registered by `track`)
        and guards every tracked LR scheduler."""
        self.engine, self.tracked, self.metrics = engine, tracked, metrics
        self.step: int | None = None  # the step of the open try (None: none open)
        self.used = False  # a `with run.try_step()` block ran in this try
        self.committed = False
        self.handled = False
        """The engine handled this try (a fault recovered, an anomaly's verdict): the loop
        goes on to `begin()`, with nothing more to commit."""
        self._stepped: set[int] = set()
        self._checked = False
        self._inside = False
        self._schedulers = [guard_scheduler(obj) for obj in tracked.extra.values()
                            if stepped_per_update(obj)]
        self._hooks = [hook for optimizer in tracked.optimizers for hook in (
            optimizer.register_step_pre_hook(self._before_update),
            optimizer.register_step_post_hook(self._after_update))]

    def detach(self) -> None:
        """The loop ended: its hooks leave the optimizers."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def open(self, step: int, metrics: dict[str, float]) -> None:
        """A try of `step` begins (the loop is about to yield it)."""
        self.step, self.metrics = step, metrics
        self.used = self.committed = self.handled = self._checked = False
        self._stepped = set()

    def close(self) -> None:
        """The try ended (the loop's body returned)."""
        self.step = None

    def commit(self) -> None:
        """Commit the open try's step now (its update done, or none made)."""
        if self.committed or self.step is None:
            return
        for step in self._schedulers:
            step()
        self.tracked.whole = True
        self.committed = True
        self.engine.commit(self.step, self.metrics, settle=False)

    # ------------------------------------------------------------------ the context
    def __enter__(self) -> StepBlock:
        if self.step is None:
            raise UserError("run.try_step() belongs inside the loop `for step, batch in "
                            "run.steps(total, data=loader):`, once per step")
        if self._inside or self.used:
            raise UserError("run.try_step(): one block per step (it holds the whole step)")
        self.used = self._inside = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._inside = False
        if exc is None:
            self.commit()  # no update made (a GradScaler skipped it): committed without one
            return False
        if isinstance(exc, StepSettled):
            self.handled = True
            return True
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not a fault
        self.engine.fail(self.step, exc)  # raises what recovery cannot help
        self.handled = True
        return True

    # ------------------------------------------------------------------ the hooks
    def _before_update(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """A tracked optimizer's update begins (the fence has passed): the anomaly check
        before the first, then the rank is torn until the commit."""
        if not self._inside or self.committed:
            return
        if not self._checked:
            self._checked = True
            if self.engine.check(self.step, self.metrics) is not Verdict.COMMIT:
                raise StepSettled()
        self.tracked.tear()

    def _after_update(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """A tracked optimizer's update returned: the step commits with the last one."""
        if not self._inside or self.committed:
            return
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self.tracked.optimizers):
            self.commit()
