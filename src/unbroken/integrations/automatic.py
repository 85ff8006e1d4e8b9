"""Armed in every worker under `unbroken run` (`unbroken.worker`): what a script trains with
a framework we integrate is protected without a change to the script.

Nothing is imported here: each framework's hook waits for the script to import it
(`import_hooks.when_imported`). `--no-integrations` (`WorkerEnv.integrations`) leaves every
framework alone; the check is made when the script trains, after a warm interpreter has
taken its assignment.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from unbroken.control.worker_env import WorkerEnv
from unbroken.import_hooks import when_imported


def arm() -> None:
    """Protect every Hugging Face `Trainer` (and subclass: TRL's) when it trains."""
    when_imported("transformers.trainer", _wrap_trainer_train)
    for package in ("lightning.pytorch", "pytorch_lightning"):
        when_imported(f"{package}.strategies",
                      functools.partial(_replace_lightning_ddp, package=package))


def wanted() -> bool:
    """Under `unbroken run`, integrations not turned off."""
    env = WorkerEnv.from_environ()
    return env.control is not None and env.integrations


def _wrap_trainer_train(module: ModuleType) -> None:
    trainer_class = module.Trainer
    original = trainer_class.train
    if getattr(original, "_unbroken", False):
        return

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if wanted():
            from unbroken.integrations.hf import protect

            protect(self)
        return original(self, *args, **kwargs)

    train._unbroken = True  # type: ignore[attr-defined]
    trainer_class.train = train


def _replace_lightning_ddp(module: ModuleType, package: str) -> None:
    """Lightning's `strategy="ddp"` (and `"auto"`, which picks it for several processes)
    builds `unbroken_ddp` (`unbroken.integrations.lightning`) when the Trainer is built,
    if `wanted()`; the same in the `lightning` package and the standalone
    `pytorch_lightning` (`package`). Left alone: a `DDPStrategy(...)` the script builds
    itself, the other DDP names (`ddp_spawn`, `ddp_fork`, `ddp_notebook`,
    `ddp_find_unused_parameters_*`), `fsdp` and `deepspeed`."""
    registry = module.StrategyRegistry
    entry = registry["ddp"]  # a dict: the class, its description and init params
    original = entry["strategy"]
    if getattr(original, "_unbroken", False):
        return

    def ddp(**kwargs: Any) -> Any:
        if wanted():
            from unbroken.integrations.lightning import strategy_class

            return strategy_class(package)(**kwargs)
        return original(**kwargs)

    ddp._unbroken = True  # type: ignore[attr-defined]
    registry.register("ddp", ddp, description=entry["description"], override=True,
                      **entry["init_params"])
