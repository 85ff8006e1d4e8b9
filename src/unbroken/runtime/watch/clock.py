"""Where a script's step ends, decided from the calls the hooks see (pure: no clock, no I/O).

The rules (docs/goodput.md, "Scripts that report no steps"):

- a step ends when an optimizer that has already stepped in it steps again (two optimizers,
  a GAN's, step once each per step), or at the next `backward()` after its last optimizer
  step, whichever comes first; it ended at its last optimizer update;
- an iteration whose update a GradScaler skipped (inf or NaN gradients: no optimizer step)
  ends at the scaler's `update()`, counted as a step without an update;
- the next step begins where the last one ended; the process's first step begins at its
  first `backward()` (what came before it, imports, the process group, the model, is set-up).

Gradient accumulation (several `backward()`s before one update) is one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ended:
    """A step the clock closed: `step` counts from 1 in this process."""

    step: int
    began: float
    ended: float
    updated: bool
    loss: float | None


@dataclass
class StepClock:
    """Feed it each hooked call with its time; a call that closes a step returns it."""

    steps: int = 0
    began: float | None = None
    """When the open step began; None before the process's first `backward()`."""
    updated_at: float | None = None
    """The open step's last optimizer update."""
    stepped: set[int] = field(default_factory=set)
    """The optimizers (by id) that stepped in the open step."""
    backwards: int = 0
    loss: float | None = None

    def backward(self, now: float, loss: float | None) -> Ended | None:
        """`backward()` is called (before it runs)."""
        done = self._close(True) if self.stepped else None
        if self.began is None:
            self.began = now
        self.backwards += 1
        self.loss = loss
        return done

    def before_update(self, optimizer: int) -> Ended | None:
        """`optimizer.step()` is called (torch's global pre-hook)."""
        return self._close(True) if optimizer in self.stepped else None

    def after_update(self, optimizer: int, now: float) -> None:
        """`optimizer.step()` returned (torch's global post-hook)."""
        if self.began is None:  # an update with no backward seen (gradients set by hand)
            self.began = now
        self.stepped.add(optimizer)
        self.updated_at = now

    def scaler_update(self, now: float) -> Ended | None:
        """A GradScaler's `update()` returned: if no optimizer stepped since the last
        `backward()`, the scaler skipped this step's update."""
        if self.stepped or not self.backwards:
            return None
        self.updated_at = now
        return self._close(False)

    def finish(self) -> Ended | None:
        """The process is ending: the open step, if it updated."""
        return self._close(True) if self.stepped else None

    def _close(self, updated: bool) -> Ended:
        self.steps += 1
        end = self.updated_at if self.updated_at is not None else 0.0
        done = Ended(self.steps, self.began if self.began is not None else end, end,
                     updated, self.loss)
        self.began, self.updated_at, self.loss = end, None, None
        self.stepped, self.backwards = set(), 0
        return done
