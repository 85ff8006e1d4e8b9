"""What the Lightning integration (`integrations/lightning.py`) relies on in the installed
Lightning, checked on the live Trainer before a fit is protected: protection is decided by
what the installed Lightning has, never by its version string. Both ways Lightning is
installed are covered: the `lightning` package and the standalone `pytorch_lightning`."""

from __future__ import annotations

import importlib
from typing import Any

from unbroken.integrations import seams

_LIVE = (  # (the object, as reached from the Trainer, and what the adapter reads on it)
    ("_checkpoint_connector", ("_loaded_checkpoint", "resume_start")),
    ("fit_loop", ("_combined_loader", "_data_fetcher")),
    ("fit_loop.epoch_loop", ("_batches_that_stepped", "_build_kwargs", "update_lr_schedulers",
                             "automatic_optimization")),
    ("fit_loop.epoch_loop.automatic_optimization", ("_make_closure",)),
)
"""Lightning's private attributes the integration relies on, checked on the live Trainer
(`seams.absent`) before a fit is protected: protection is decided by what the installed
Lightning has, never by its version string. `ModelCheckpoint`'s `_last_global_step_saved`
and `_last_checkpoint_saved` are read where present (`lightning_state`), and the epoch
loop's `_broadcast_sigterm_tensor` (2.6) is turned off where present."""

PACKAGES = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}
"""The two ways Lightning is installed, each with its Fabric: the `lightning` package and
the standalone `pytorch_lightning` (whose classes are others: a strategy is made for each,
`strategy_class`)."""


def unprotected(trainer: Any, package: str) -> str | None:
    """Why this fit cannot be recovered in place, or None."""
    top = package.split(".")[0]
    lightning = f"{top} {importlib.import_module(top).__version__}"
    for path, names in _LIVE:
        obj = trainer
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            return f"{lightning}: the Trainer has no {path}"
        if (why := seams.absent(obj, names, f"the Trainer's {path}")) is not None:
            return f"{lightning}: {why}"
    if not trainer.lightning_module.automatic_optimization:
        return "manual optimization is not recovered in place"
    return None
