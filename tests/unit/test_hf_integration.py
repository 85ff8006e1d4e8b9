"""The Trainer integration's gate: protection is decided by what the installed Trainer has
(its seams, `integrations/hf_seams.py`) and does (the order of an update's calls,
`integrations/update_order.py`), never by a list of version strings."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import transformers  # noqa: E402

from unbroken.integrations import hf, hf_seams, hf_versions, seams  # noqa: E402
from unbroken.integrations.seams import Seam  # noqa: E402


def test_no_version_list_decides_protection(monkeypatch):
    """A release the project has never heard of, with the seams present: protected."""
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    assert hf.unprotected() is None
    src = (hf.__file__.rsplit("/", 1)[0])
    import pathlib
    for path in pathlib.Path(src).parent.rglob("*.py"):
        assert "TESTED" not in path.read_text(), path


def test_a_missing_seam_is_one_line_that_names_it_and_what_it_is_for(monkeypatch):
    monkeypatch.delattr(transformers.Trainer, "_get_num_items_in_batch")
    why = hf.unprotected()
    assert why == ("transformers.trainer.Trainer._get_num_items_in_batch is missing (the "
                   "adapter takes each update's boundary from its item count)")
    assert "\n" not in why


def test_a_seam_whose_signature_changed_is_named_with_the_parameter(monkeypatch):
    def training_step(self, model, batch):  # `inputs` and `num_items_in_batch` renamed
        pass

    monkeypatch.setattr(transformers.Trainer, "training_step", training_step)
    assert hf.unprotected().startswith(
        "transformers.trainer.Trainer.training_step takes no parameter inputs, "
        "num_items_in_batch (the adapter runs each micro-batch through it)")


def test_seams_refuse_what_cannot_be_imported_or_called():
    assert seams.fault(Seam("no_such_module_here", "x", "")) == "no_such_module_here cannot be imported"
    assert seams.fault(Seam("transformers:__version__", "upper", "")) is None
    assert seams.fault(Seam("transformers", "__version__", "")) == "transformers.__version__ is not callable"
    assert seams.fault(Seam("transformers", "__version__", "", callable=False)) is None
    assert seams.fault(Seam("transformers.trainer:Trainer", "no_such", "")) == \
        "transformers.trainer.Trainer.no_such is missing"
    assert seams.absent(object(), ("__class__", "_x"), "a thing") == "a thing has no attribute _x"


def test_the_epoch_hooks_are_picked_by_what_the_trainer_has():
    """`_run_epoch` (5.x): the epoch method; without it (4.x): the inline loop's hooks."""
    class WithRunEpoch:
        class callback_handler:  # noqa: N801 - the Trainer's attribute
            callbacks: list = []

        def _run_epoch(self):
            pass

        def _load_rng_state(self, checkpoint):
            pass

    class Inline:
        class callback_handler:  # noqa: N801
            callbacks: list = []

    assert isinstance(hf_versions.epochs_for(WithRunEpoch()), hf_versions.EpochMethod)
    assert isinstance(hf_versions.epochs_for(Inline()), hf_versions.InlineEpochs)
    names = {s.name for s in hf_seams.SEAMS + hf_versions.epoch_seams()}
    epochs = "_run_epoch" if hasattr(transformers.Trainer, "_run_epoch") else "_inner_training_loop"
    assert {epochs, "_get_num_items_in_batch", "SkipBatchSampler", "skip_first_batches",
            "DataLoaderShard"} <= names


def test_a_5x_trainer_with_an_inline_epoch_loop_trains_unprotected():
    """5.0.0 has no `_run_epoch`: the inline loop's joiner hooks, verified on 4.x's loop,
    ended a replacement's run with other parameters there (benchmarks/framework_matrix.py)."""
    assert hf_seams.unverified_inline_loop(False, "5.0.0")
    assert not hf_seams.unverified_inline_loop(False, "4.57.6")
    assert not hf_seams.unverified_inline_loop(True, "5.25.0")
    assert not hf_seams.unverified_inline_loop(True, "99.0.0")
