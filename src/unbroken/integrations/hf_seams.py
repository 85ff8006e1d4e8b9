"""The Trainer and Accelerate attributes the Trainer integration (`integrations/hf.py`)
relies on, declared once and checked as installed (`seams`) before a Trainer is protected:
protection is decided by what the installed Trainer has, never by its version string."""

from __future__ import annotations

from typing import Any

import transformers
from transformers import Trainer

from unbroken.integrations import seams
from unbroken.integrations.hf_versions import epoch_seams
from unbroken.integrations.seams import Seam

_TRAINER = "transformers.trainer:Trainer"
SEAMS = (
    Seam(_TRAINER, "train", "passes a joiner's resume_from_checkpoint", ("resume_from_checkpoint",)),
    Seam(_TRAINER, "training_step", "runs each micro-batch through it",
         ("model", "inputs", "num_items_in_batch")),
    Seam(_TRAINER, "_get_num_items_in_batch", "takes each update's boundary from its item count",
         ("batch_samples", "device")),
    Seam(_TRAINER, "_maybe_log_save_evaluate", "recovers a fault in the log, save and evaluation"),
    Seam(_TRAINER, "_save_checkpoint", "times the Trainer's own saves as a long phase"),
    Seam(_TRAINER, "evaluate", "times an evaluation as a long phase"),
    Seam(_TRAINER, "add_callback", "follows the update through callbacks"),
    Seam("transformers.trainer_callback:TrainerCallback", "on_pre_optimizer_step",
         "checks each update before its optimizer step"),
    Seam("transformers.trainer_callback:TrainerCallback", "on_optimizer_step",
         "spans the optimizer step"),
    Seam("accelerate.data_loader", "SkipBatchSampler", "skips a joiner's trained batches",
         ("batch_sampler", "skip_batches")),
    Seam("accelerate.data_loader", "skip_first_batches", "skips a joiner's trained batches",
         ("dataloader", "num_batches")),
    Seam("accelerate.data_loader", "DataLoaderShard", "finds the loader a joiner skips in"),
)
"""The Trainer and Accelerate attributes the integration relies on, checked as installed
(`seams.missing`) before a Trainer is protected; where a joiner starts depends on whether
the Trainer runs its epochs in `_run_epoch` (`hf_versions.epochs_for`). The order of the
calls in an update is checked on the first two updates (`update_order`)."""


def unprotected(trainer: Any = None) -> str | None:
    """Why a Trainer cannot be protected as installed, or `trainer` as configured (one
    line), or None."""
    if trainer is not None and getattr(trainer, "is_deepspeed_enabled", False):
        # DeepSpeed's engine owns the optimizer, its ZeRO partitions and the gradient
        # reduction: not recovered in place yet (later work).
        return "a DeepSpeed Trainer is not recovered in place"
    if unverified_inline_loop(hasattr(Trainer, "_run_epoch"), transformers.__version__):
        return ("this Trainer runs its epochs inline, and a joiner's start in a 5.x inline "
                "loop is not verified")
    return seams.missing(SEAMS + epoch_seams())


def unverified_inline_loop(has_run_epoch: bool, version: str) -> bool:
    """The Trainer runs its epochs inline (no `_run_epoch`) and is not 4.x. The inline
    loop's joiner hooks (`hf_versions.InlineEpochs`) are verified on 4.x's loop; on 5.0.0's a
    replacement's run ended with other parameters than a fault-free run's
    (benchmarks/framework_matrix.py): such a Trainer is not protected until the resumed
    epoch's samples are checked at run time. Pure."""
    return not has_run_epoch and not version.startswith("4.")
