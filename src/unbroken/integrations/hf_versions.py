"""Where a joiner's training starts at its peers' step, by transformers version: the one part
of the Trainer integration (`integrations/hf.py`) whose private Trainer API differs between
the versions tested.

A joiner learns its peers' step at `on_train_begin` (it joins there). By then the Trainer has
already decided, from the checkpoint it was given (none: a joiner's state comes from a peer),
which epoch its loop starts in and how many batches it skips.
- 5.x runs each epoch in `Trainer._run_epoch`, whose arguments carry that decision:
  `EpochMethod` passes the peers' epoch and the batches to skip, and the Trainer's own skip
  does the rest (`skip_first_batches`, `update_step` from the skipped updates). The same
  method reruns the epochs from an older step when a switch took the state back (`Rewind`).
- 4.x (4.57) runs the epochs inline in `_inner_training_loop`, with the decision in its locals:
  `InlineEpochs` shifts the loop instead (see its docstring). Its loop cannot be rerun from
  an older step, so a sharded job (the only kind whose state a switch can take back) is
  restarted on a fault, said at the start.
`epochs_for(trainer)` picks one by what the Trainer has (`_run_epoch`), never by version;
`hf.unprotected()` checks first that the Trainer has every attribute the pick relies on.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset
from transformers import Trainer, TrainerCallback

from unbroken.integrations.seams import Seam

PEER = "unbroken:peer"
"""The `resume_from_checkpoint` a 5.x joiner's first epoch passes to the Trainer's skip: its
state came from a peer, and no file is read."""


class Rewind(Exception):  # noqa: N818
    """A switch took the state back to `step`, older than the update the Trainer's loop drew
    (a sharded job's dead rank's shard came from an in-memory snapshot): the epoch is left
    and run again from `step` (`EpochMethod.run_epoch`)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the state went back to step {step}")
        self.step = step


def epochs_for(trainer: Trainer) -> EpochMethod | InlineEpochs:
    """The epoch hooks for the installed Trainer, installed on `trainer`: by what it has
    (`_run_epoch`: 5.x), never by its version string."""
    return EpochMethod(trainer) if hasattr(type(trainer), "_run_epoch") else InlineEpochs(trainer)


def epoch_seams() -> tuple[Seam, ...]:
    """The Trainer attributes the epoch hooks `epochs_for` picks rely on (`seams`)."""
    from transformers import Trainer

    trainer = "transformers.trainer:Trainer"
    if hasattr(Trainer, "_run_epoch"):
        return (Seam(trainer, "_run_epoch", "starts a joiner's epoch at its peers' step",
                     ("epoch", "num_update_steps_per_epoch")),
                Seam(trainer, "_load_rng_state", "keeps a joiner's RNG state from its peer"))
    return (Seam(trainer, "_inner_training_loop", "shifts the inline epoch loop for a joiner"),
            Seam("transformers.trainer_callback:TrainerCallback", "on_epoch_begin",
                 "sets a joiner's epoch"))


class EpochMethod:
    """transformers 5.x: `Trainer._run_epoch`, wrapped; a joiner's first epoch starts at the
    peers' step, with the Trainer's own skip of the batches already trained. After a switch
    that took the state back (`Rewind`), the epochs from that step up to the current one run
    again the same way, on the same batches (the sampler's order depends on the epoch only),
    still inside `train()`."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._skip_to: int | None = None
        self._run_epoch = trainer._run_epoch
        trainer._run_epoch = self.run_epoch
        trainer._load_rng_state = self._load_rng_state(trainer._load_rng_state)

    def why_not(self) -> str | None:
        """Why a joiner could not start at its peers' step (None: it can)."""
        return None

    def start_at(self, step: int) -> None:
        """This process joined at `on_train_begin`; its peers stand at `step`."""
        self._skip_to = step or None

    def run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        start, self._skip_to = self._skip_to, None
        while True:
            try:
                if start is None:
                    return self._run_epoch(*args, **kwargs)
                first, offset = divmod(start, kwargs["num_update_steps_per_epoch"])
                if kwargs["epoch"] < first:
                    self._skip_to = start
                    return None  # trained by the peers before this one joined
                skipped = offset * self.trainer.args.gradient_accumulation_steps
                for epoch in range(first, kwargs["epoch"] + 1):
                    result = self._run_epoch(*args, **{
                        **kwargs, "epoch": epoch, "epochs_trained": first,
                        "resume_from_checkpoint": PEER, "steps_trained_in_current_epoch": skipped})
                return result
            except Rewind as rewind:
                start = rewind.step

    @staticmethod
    def _load_rng_state(original: Any) -> Any:
        def load(checkpoint: Any) -> None:
            if checkpoint != PEER:  # a peer's RNG: the engine seeds each step
                original(checkpoint)
        return load


class InlineEpochs:
    """transformers 4.x: the epoch loop is inline in `_inner_training_loop`, so a joiner's
    loop starts as a fresh run's would (epoch 0, no skip), and is shifted to its peers' step:
    - its loop's epoch `i` is the peers' epoch `i + e`: the train loader's epoch (its shuffle)
      is set to `i + e` at each `on_epoch_begin`, after the loop's own `set_epoch(i)`;
    - the batches of epoch `e` already trained are skipped with the Trainer's own means
      (accelerate's `SkipBatchSampler`, as `skip_first_batches` builds it: indices skipped,
      no batch loaded), in place in the loader for that first epoch, so that the loop's
      length of it, and the update boundaries it counts from that length (the epoch's last,
      partial, update included), are those of the remaining batches;
    - `state.epoch`, which the loop computes from its own counters, is set back to the
      peers' at each step's end, before any other callback sees it.
    With an `IterableDataset` (no batch sampler to skip with) a joiner could not start at its
    peers' step, and with sharded parameters (FSDP2) a switch can take the state back to a
    snapshot, from which the inline loop cannot be rerun: `why_not()` says so, and in-place
    recovery is off for the job."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._shift: int | None = None  # the peers' epoch minus the loop's, once joined
        self._batches: Any = None  # the loader's own batch sampler, while the skip stands in
        self._loop_epoch = -1  # the loop's own count of its epochs in this train()
        trainer.callback_handler.callbacks.insert(0, _InlineEpochCallback(self))

    def why_not(self) -> str | None:
        """Why a joiner could not start at its peers' step (None: it can); the same on every
        rank, asked before the job starts."""
        if isinstance(self.trainer.callback_handler.train_dataloader.dataset, IterableDataset):
            return ("transformers 4.x with an IterableDataset: a joiner cannot skip to its "
                    "peers' step")
        from torch.distributed.tensor import DTensor  # 4.x only: no import at start-up

        if any(isinstance(p, DTensor) for p in self.trainer.model.parameters()):
            return ("transformers 4.x with sharded parameters (FSDP2): its inline epoch loop "
                    "cannot be rerun from a snapshot's older step (5.x's can)")
        return None

    def start_at(self, step: int) -> None:
        """This process joined at `on_train_begin`, before its loop's first epoch; its peers
        stand at `step`."""
        self._loop_epoch = -1
        epoch, offset = divmod(step, self._updates_per_epoch())
        self._shift = epoch
        if offset:
            from accelerate.data_loader import SkipBatchSampler

            self._batches = self._loader().batch_sampler
            skip = offset * self.trainer.args.gradient_accumulation_steps
            self._use(SkipBatchSampler(self._batches, skip))

    def _loader(self) -> Any:
        """The torch `DataLoader` the Trainer's train loader iterates (accelerate's wraps one)."""
        loader = self.trainer.callback_handler.train_dataloader
        return getattr(loader, "base_dataloader", loader)

    def _use(self, batches: Any) -> None:
        """The loader's batch sampler from now on: a DataLoader refuses a new one once built,
        and its own is put back at the end of the epoch."""
        object.__setattr__(self._loader(), "batch_sampler", batches)

    def _full_batches(self) -> Any:
        return self._batches if self._batches is not None else self._loader().batch_sampler

    def _updates_per_epoch(self) -> int:
        """The loop's `num_update_steps_per_epoch`, from the loader's full length."""
        return max(-(-len(self._full_batches()) // self.trainer.args.gradient_accumulation_steps), 1)

    def epoch_begin(self) -> None:
        self._loop_epoch += 1
        if not self._shift:
            return
        skipping = self._loader().batch_sampler
        self._use(self._full_batches())  # the epoch reaches the sampler through its own
        try:
            self.trainer.callback_handler.train_dataloader.set_epoch(self._loop_epoch + self._shift)
        finally:
            self._use(skipping)

    def epoch_end(self) -> None:
        if self._batches is not None:
            self._use(self._batches)
            self._batches = None

    def step_end(self) -> None:
        """A joiner's `state.epoch` set to its peers' (`epoch_at`)."""
        if self._shift is not None:
            state = self.trainer.state
            state.epoch = epoch_at(state.global_step, len(self._full_batches()),
                                   self.trainer.args.gradient_accumulation_steps)


def epoch_at(step: int, batches: int, accumulation: int) -> float:
    """The 4.x loop's `state.epoch` after update `step` (1-based): `epoch + (micro-batch + 1) /
    batches`, from the step alone (an epoch's updates take `accumulation` micro-batches each,
    the last one the rest)."""
    per_epoch = max(-(-batches // accumulation), 1)
    epoch = (step - 1) // per_epoch
    return epoch + min((step - epoch * per_epoch) * accumulation, batches) / batches


class _InlineEpochCallback(TrainerCallback):
    """The loop's events for `InlineEpochs`; first of the Trainer's callbacks."""

    def __init__(self, epochs: InlineEpochs) -> None:
        self.epochs = epochs

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.epochs.epoch_begin()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.epochs.epoch_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.epochs.step_end()
