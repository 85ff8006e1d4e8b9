"""The Hugging Face Trainer's own state, as the Trainer integration (`integrations/hf.py`)
carries it between processes: what a peer (or a host copy, a checkpoint) hands over besides
the model, optimizer and scheduler, and what it never hands over, which process this is.

- `StateOfTrainer`: the `TrainerState` and the stateful callbacks' state, tracked
  (`run.track`), taken in place by a joiner or after a switch that took the state back.
- `take_slot`: the process's identity, which no peer's state carries (`_OWN_FIELDS`): a
  promoted spare takes its slot's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from transformers import Trainer
from transformers.trainer_callback import ExportableState

_OWN_FIELDS = ("is_local_process_zero", "is_world_process_zero")
"""`TrainerState` fields that say which process this is: never taken from a peer."""


class StateOfTrainer:
    """The `TrainerState` as a tracked object, with the stateful callbacks' state (early
    stopping's patience, for one): `state_dict` is their JSON, read fresh; `load_state_dict`
    updates the live state and callbacks in place (the Trainer's loop and the callbacks hold
    them), and the Trainer's counters that derive from the step."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _stateful(self) -> list[Any]:
        return [c for c in self.trainer.callback_handler.callbacks if isinstance(c, ExportableState)]

    def state_dict(self) -> dict[str, Any]:
        state = dataclasses.asdict(self.trainer.state)
        state["stateful_callbacks"] = {type(c).__name__: c.state() for c in self._stateful()}
        return {"json": json.dumps(state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer, loaded = self.trainer, json.loads(state["json"])
        callbacks = loaded.pop("stateful_callbacks")
        for own in _OWN_FIELDS:  # this process's, not the peer's
            loaded.pop(own, None)
        trainer.state.__dict__.update(loaded)
        for callback in self._stateful():
            for name, value in callbacks.get(type(callback).__name__, {}).get("attributes", {}).items():
                setattr(callback, name, value)
        trainer._globalstep_last_logged = trainer._initial_global_step = trainer.state.global_step


def take_slot(trainer: Trainer, slot: int) -> None:
    """A promoted spare built its Trainer as rank 0 of the stand-in world: it takes its
    slot's identity, where Accelerate and the Trainer keep it (the process index, the
    data shard's, the state's process-zero flag), before its first batch is drawn."""
    from accelerate.state import AcceleratorState, PartialState

    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if "process_index" in shared:
            shared["process_index"] = slot
    loader = trainer.callback_handler.train_dataloader
    sampler = getattr(loader, "batch_sampler", None)
    if hasattr(sampler, "process_index"):
        sampler.process_index = slot
    trainer.state.is_world_process_zero = slot == 0
