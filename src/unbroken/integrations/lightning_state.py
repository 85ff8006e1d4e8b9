"""Lightning's own state, as the strategy of `integrations/lightning.py` carries it to a
joiner: what Lightning's checkpoint holds besides the model and optimizers (loops,
callbacks, LR schedulers, precision, datamodule), dumped from a live Trainer by a peer and
handed to the joiner's own restore, with what a joiner needs to start where its peer is
(the batches of the update in flight it runs again, each `ModelCheckpoint`'s last save,
the logger's step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from unbroken.integrations.lightning_replay import UpdateBatches
    from unbroken.runtime.engine import Engine


class FitLoop(Protocol):
    """What the state uses of the strategy's fit loop (`lightning.FitSteps`, which makes it):
    declared here, so that this module never imports the strategy back."""

    trainer: Any  # Lightning's Trainer (either package's)
    engine: Engine
    batches: UpdateBatches
    local_batches: int
    batches_that_stepped: int | None
    from_peer: bool

_OWN_KEYS = ("hyper_parameters", "hparams_name", "hparams_type",
             "datamodule_hyper_parameters", "datamodule_hparams_name")
"""Checkpoint entries a joiner's script makes itself: they may hold any Python object, and
state from a peer travels as tensors and plain data only (never unpickled)."""

_REDONE = "unbroken_batches_redone"
"""The peer's batches of the update in flight already run: the joiner runs them again, its
strategy collectives local (the peer is past them)."""

_SAVED = "unbroken_checkpoint_saved"
"""Each `ModelCheckpoint`'s last save (its `_last_global_step_saved`, which its state dict
lacks): a joiner in the middle of an update must not save again at a step its peer saved
at (a save's collectives would meet the peer's all-reduce)."""
_SAVED_ATTRS = ("_last_global_step_saved", "_last_checkpoint_saved")


class LightningState:
    """What Lightning's checkpoint carries besides the model and optimizers (tracked
    themselves): loops, callbacks, LR schedulers, precision, datamodule, as one tracked
    object, in plain data and tensors (the state step packs it; nothing is pickled).
    `state_dict` dumps it fresh (the committed step's, taken inside the next step
    or between steps); `load_state_dict` hands it to Lightning's own restore."""

    def __init__(self, steps: FitLoop) -> None:
        self.steps = steps

    def state_dict(self) -> dict[str, Any]:
        trainer = self.steps.trainer
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in ("state_dict", "optimizer_states"):  # tracked: sent as tensors
            ckpt.pop(key, None)
        # The update in flight is not committed: the joiner runs its batches again.
        redone = len(self.steps.batches.earlier)
        progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for counts in (progress["total"], progress["current"]):
            done = counts["completed"] - redone
            counts.update(ready=done, started=done, processed=done, completed=done)
        ckpt[_REDONE] = redone
        ckpt[_SAVED] = {cb.state_key: {a: getattr(cb, a) for a in _SAVED_ATTRS}
                        for cb in trainer.checkpoint_callbacks}
        for key in _OWN_KEYS:  # the joiner's script builds its own
            ckpt.pop(key, None)
        return ckpt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = self.steps
        if not steps.engine.joining:  # its loops ran on: they cannot be set back in place
            raise RuntimeError("unbroken: a worker already in fit() was sent a peer's "
                               "Lightning state; it cannot take it in place")
        ckpt = dict(state)
        steps.local_batches = int(ckpt.pop(_REDONE, 0))
        saved = ckpt.pop(_SAVED, {})
        connector = steps.trainer._checkpoint_connector
        connector._loaded_checkpoint = ckpt  # loops, schedulers, precision: at fit's restore
        connector.restore_datamodule()
        connector.restore_callbacks()
        for callback in steps.trainer.checkpoint_callbacks:
            for attr, value in saved.get(callback.state_key, {}).items():
                setattr(callback, attr, value)
        fit_loop = ckpt["loops"]["fit_loop"]
        steps.batches_that_stepped = fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"]
        steps.from_peer = True
