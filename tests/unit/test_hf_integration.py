"""The Trainer integration's version gate: outside the versions its private Trainer methods
are tested with, a Trainer trains unprotected, saying so in one line."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from unbroken.integrations import hf  # noqa: E402


def test_only_the_tested_minor_versions_are_supported():
    """The newest 5.x and the last 4.x, each tested by a job (test_hf_trainer.py, and
    test_hf_trainer_v4.py under 4.57): any patch release of those, and nothing else."""
    assert hf.TESTED == ("4.57", "5.24")
    for version in ("4.57.6", "4.57.0", "5.24.0", "5.24.3"):
        assert hf.supported(version), version
    for version in ("4.56.2", "4.5.7", "5.23.1", "5.25.0", "5.99.1", "6.0.0"):
        assert not hf.supported(version), version


def test_each_major_version_gets_its_own_epoch_hooks():
    """5.x has `Trainer._run_epoch`; 4.x runs its epochs inline (hf_versions.py)."""
    from unbroken.integrations import hf_versions

    class Trainer:
        class callback_handler:  # noqa: N801 - the Trainer's attribute
            callbacks: list = []

        def _run_epoch(self):
            pass

        def _load_rng_state(self, checkpoint):
            pass

    assert isinstance(hf_versions.epochs_for("4.57.6", Trainer()), hf_versions.InlineEpochs)
    assert isinstance(hf_versions.epochs_for("5.24.0", Trainer()), hf_versions.EpochMethod)


@pytest.mark.parametrize(("batches", "accumulation"), [(9, 2), (8, 2), (16, 1), (7, 3), (2, 4)])
def test_a_4x_joiners_epoch_is_the_one_its_peers_loop_computes(batches, accumulation):
    """4.x's loop sets `state.epoch = epoch + (step + 1) / steps_in_epoch` at each update's
    last micro-batch (or the epoch's last); a joiner, whose loop counters are shifted, gets the
    same value from the step alone."""
    from unbroken.integrations.hf_versions import epoch_at

    peers, global_step = [], 0
    for epoch in range(3):
        for step in range(batches):
            if (step + 1) % accumulation == 0 or step + 1 == batches:
                global_step += 1
                peers.append((global_step, epoch + (step + 1) / batches))
    assert [(g, epoch_at(g, batches, accumulation)) for g, _ in peers] == peers


def test_an_untested_version_leaves_the_trainer_alone_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(hf.transformers, "__version__", "4.56.2")

    class Trainer:  # protect() must touch nothing of it but the mark
        pass

    trainer = Trainer()
    assert hf.protect(trainer) is trainer
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transformers 4.56.2" in err[0] and "unprotected" in err[0], err
    assert trainer._unbroken is False
    assert hf.protect(trainer) is trainer and capsys.readouterr().err == ""  # said once
