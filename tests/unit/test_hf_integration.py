"""The Trainer integration's version gate: outside the versions its private Trainer methods
are tested with, a Trainer trains unprotected, saying so in one line."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from unbroken.integrations import hf  # noqa: E402


def test_only_the_tested_minor_versions_are_supported():
    assert hf.supported(hf.TESTED[0] + ".0")
    assert not hf.supported("4.57.6")
    assert not hf.supported("5.99.1")


def test_an_untested_version_leaves_the_trainer_alone_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(hf.transformers, "__version__", "4.57.6")

    class Trainer:  # protect() must touch nothing of it but the mark
        pass

    trainer = Trainer()
    assert hf.protect(trainer) is trainer
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transformers 4.57.6" in err[0] and "unprotected" in err[0], err
    assert trainer._unbroken is False
    assert hf.protect(trainer) is trainer and capsys.readouterr().err == ""  # said once
