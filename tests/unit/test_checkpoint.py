"""Atomic DCP checkpoints: torn, truncated, corrupt and hostile ones are never loaded."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from unbroken.checkpoint.checkpointer import Checkpointer, committed_checkpoints
from unbroken.errors import CheckpointMismatch
from unbroken.telemetry.schema import encode


def _state(seed: int, width: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(width, 3, generator=g), "b": torch.randn(3, generator=g)},
            "unbroken": {"step": torch.tensor(seed)}}


def _saved(tmp_path, steps=(10, 20, 30)):
    events = []
    ckpt = Checkpointer(tmp_path / "ckpt", keep=5, record=lambda e: events.append((e.event, encode(e))))
    for step in steps:
        ckpt.save(_state(step), step)
    return ckpt, events


def _load(ckpt) -> tuple[int | None, dict]:
    target = _state(0)
    return ckpt.load_latest(target), target


def test_save_load_roundtrip_and_retention(tmp_path):
    events = []
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, record=lambda e: events.append(e.event))
    for step in (10, 20, 30):
        ckpt.save(_state(step), step)
    assert [s for s, _ in committed_checkpoints(tmp_path / "ckpt")] == [30, 20]
    step, target = _load(ckpt)
    assert step == 30
    assert torch.equal(target["model"]["w"], _state(30)["model"]["w"])
    assert int(target["unbroken"]["step"]) == 30
    assert events.count("checkpoint_saved") == 3 and "checkpoint_loaded" in events


def test_corrupt_checkpoint_is_skipped_with_an_event(tmp_path):
    ckpt, events = _saved(tmp_path)
    data = next((tmp_path / "ckpt" / "step_000000030").glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte, same size
    data.write_bytes(bytes(blob))
    step, target = _load(ckpt)
    assert step == 20
    assert torch.equal(target["model"]["w"], _state(20)["model"]["w"])
    invalid = [kw for name, kw in events if name == "checkpoint_invalid"]
    assert invalid[0]["step"] == 30 and "checksum" in invalid[0]["reason"]


def test_truncated_checkpoint_is_skipped(tmp_path):
    ckpt, events = _saved(tmp_path)
    meta = tmp_path / "ckpt" / "step_000000030" / ".metadata"
    with open(meta, "r+b") as fh:
        fh.truncate(os.path.getsize(meta) // 2)
    assert _load(ckpt)[0] == 20
    assert "truncated" in [kw for n, kw in events if n == "checkpoint_invalid"][0]["reason"]


def test_torn_save_is_never_loaded(tmp_path):
    """A save killed before its commit leaves a temporary directory, which is ignored."""
    ckpt, _ = _saved(tmp_path, steps=(10,))
    torn = tmp_path / "ckpt" / ".tmp-step_000000020-a0"
    shutil.copytree(tmp_path / "ckpt" / "step_000000010", torn)
    (torn / "manifest.json").unlink()
    assert _load(ckpt)[0] == 10
    # And a committed directory without its manifest (impossible via save) is rejected too.
    no_manifest = tmp_path / "ckpt" / "step_000000040"
    shutil.copytree(torn, no_manifest)
    assert _load(ckpt)[0] == 10
    Checkpointer(tmp_path / "ckpt")  # a new run's rank 0 sweeps torn saves
    assert not torn.exists()


def test_checkpoint_that_does_not_fit_names_the_difference(tmp_path):
    ckpt, _ = _saved(tmp_path, steps=(10,))
    wider = _state(0, width=5)
    with pytest.raises(CheckpointMismatch, match=r"model\.w: checkpoint \(4, 3\) vs model \(5, 3\)"):
        ckpt.load_latest(wider)
    extra = _state(0)
    extra["model"]["new_layer"] = torch.zeros(2)
    with pytest.raises(CheckpointMismatch, match="not in checkpoint: model.new_layer"):
        ckpt.load_latest(extra)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_hostile_metadata_is_refused_not_executed(tmp_path):
    ckpt, _ = _saved(tmp_path, steps=(10,))
    path = tmp_path / "ckpt" / "step_000000010"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    # Re-seal the manifest, as an attacker with write access could.
    from unbroken.checkpoint.manifest import describe_files, write_manifest

    write_manifest(path, 10, describe_files(path))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(CheckpointMismatch, match="not allowed"):
            _load(ckpt)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "pwned").exists()


def test_hostile_value_in_a_data_file_is_refused_not_executed(tmp_path):
    """DCP stores non-tensor values (a learning rate) as pickles, and its own planner loads
    them with weights_only=False; ours loads plain data only."""
    import torch.distributed.checkpoint as dcp

    from unbroken.checkpoint.manifest import describe_files, write_manifest

    ckpt = Checkpointer(tmp_path / "ckpt")
    state = _state(10)
    state["unbroken"]["note"] = _Evil()  # pickling it runs nothing; unpickling would
    path = tmp_path / "ckpt" / "step_000000010"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    write_manifest(path, 10, describe_files(path))  # sealed, as by someone with write access
    target = _state(0)
    target["unbroken"]["note"] = 0.0
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(CheckpointMismatch, match="unbroken.note is not plain data"):
            ckpt.load_latest(target)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "pwned").exists()
    plain = _state(0)
    plain["unbroken"]["note"] = 0.0
    state["unbroken"]["note"] = 0.5  # plain data loads fine
    ckpt.save(state, 11)
    assert ckpt.load_latest(plain) == 11 and plain["unbroken"]["note"] == 0.5
