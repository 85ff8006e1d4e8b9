"""Checkpoints marked verified or unverified by the replica checks (issue 27): the mark is in
the manifest, and a restart loads the newest checkpoint whose replicas agreed rather than a
newer one whose replicas did not. (A real job: tests/integration/test_verified_restart.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from unbroken.checkpoint.checkpointer import Checkpointer
from unbroken.checkpoint.layout import step_name
from unbroken.checkpoint.loader import UNVERIFIED, choose
from unbroken.checkpoint.manifest import MANIFEST, manifest_verified, verify_manifest
from unbroken.telemetry.schema import encode


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g)}, "unbroken": {"step": torch.tensor(seed)}}


def _saved(tmp_path, marks: dict[int, bool | None]):
    """Checkpoints of each step in `marks` (oldest first), each saved with its mark."""
    events: list[tuple[str, dict]] = []
    ckpt = Checkpointer(tmp_path / "ckpt", keep=10,
                        record=lambda e: events.append((e.event, encode(e))))
    for step, verified in marks.items():
        ckpt.save(_state(step), step, verified=verified)
    events.clear()
    return ckpt, events


def _manifest(tmp_path, step: int) -> dict:
    return json.loads((tmp_path / "ckpt" / step_name(step) / MANIFEST).read_text())


def _invalid(events) -> list[tuple[int, str]]:
    return [(kw["step"], kw["reason"]) for name, kw in events if name == "checkpoint_invalid"]


def _corrupt(tmp_path, step: int) -> None:
    data = next((tmp_path / "ckpt" / step_name(step)).glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))


@pytest.mark.parametrize("verified", [True, False, None])
def test_the_mark_is_written_into_the_manifest_and_left_out_when_unknown(tmp_path, verified):
    _saved(tmp_path, {5: verified})
    manifest = _manifest(tmp_path, 5)
    if verified is None:
        assert "verified" not in manifest
    else:
        assert manifest["verified"] is verified
    assert manifest["attempt"] == 0 and manifest["step"] == 5
    assert manifest_verified(tmp_path / "ckpt" / step_name(5)) is verified
    assert verify_manifest(tmp_path / "ckpt" / step_name(5)) is None


def test_start_carries_the_mark_into_an_async_save(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    assert ckpt.start(_state(7), 7, verified=False)
    assert ckpt.wait(60)
    assert _manifest(tmp_path, 7)["verified"] is False


def test_a_newer_unverified_checkpoint_is_passed_over_for_the_verified_one(tmp_path):
    ckpt, events = _saved(tmp_path, {10: True, 20: False, 30: False})
    target = _state(0)
    assert ckpt.load_latest(target) == 10
    assert torch.equal(target["model"]["w"], _state(10)["model"]["w"])
    assert _invalid(events) == [(30, UNVERIFIED), (20, UNVERIFIED)]
    assert all(reason.startswith("unverified") for _, reason in _invalid(events))
    loaded = [kw for name, kw in events if name == "checkpoint_loaded"]
    assert [kw["step"] for kw in loaded] == [10]


def test_with_none_verified_the_newest_is_loaded_even_if_unverified(tmp_path):
    ckpt, events = _saved(tmp_path, {10: False, 20: None, 30: False})
    assert ckpt.load_latest(_state(0)) == 30
    assert _invalid(events) == []


def test_without_marks_the_newest_intact_is_loaded_as_before(tmp_path):
    ckpt, events = _saved(tmp_path, {10: None, 20: None, 30: None})
    assert choose(tmp_path / "ckpt", 0, None, lambda e: events.append((e.event, encode(e)))) \
        == tmp_path / "ckpt" / step_name(30)
    assert _invalid(events) == []
    _corrupt(tmp_path, 30)
    assert ckpt.load_latest(_state(0)) == 20
    assert [s for s, _ in _invalid(events)] == [30]


def test_a_manifest_written_before_the_mark_existed_still_loads(tmp_path):
    """An old manifest has no `verified` key (and no attempt): intact, unmarked."""
    ckpt, events = _saved(tmp_path, {10: True, 20: None})
    path = tmp_path / "ckpt" / step_name(20) / MANIFEST
    old = json.loads(path.read_text())
    del old["attempt"]
    path.write_text(json.dumps(old))
    assert manifest_verified(path.parent) is None and verify_manifest(path.parent) is None
    assert ckpt.load_latest(_state(0)) == 20
    assert _invalid(events) == []


def test_an_unmarked_checkpoint_newer_than_a_verified_one_is_loaded(tmp_path):
    """Not marked unverified: taken, and the unverified one newer than it passed over."""
    ckpt, events = _saved(tmp_path, {10: True, 20: None, 30: False})
    assert ckpt.load_latest(_state(0)) == 20
    assert _invalid(events) == [(30, UNVERIFIED)]


def test_a_damaged_verified_checkpoint_does_not_count(tmp_path):
    """The only verified checkpoint is corrupt: the newest intact one, unverified or not."""
    ckpt, events = _saved(tmp_path, {10: True, 20: None, 30: False})
    _corrupt(tmp_path, 10)
    assert ckpt.load_latest(_state(0)) == 30
    invalid = _invalid(events)
    assert [s for s, _ in invalid] == [10] and "checksum" in invalid[0][1]


def test_a_damaged_checkpoint_among_them_is_reported_as_damaged(tmp_path):
    ckpt, events = _saved(tmp_path, {10: True, 20: True, 30: False})
    _corrupt(tmp_path, 20)
    assert ckpt.load_latest(_state(0)) == 10
    invalid = _invalid(events)
    assert invalid[0][0] == 20 and "checksum" in invalid[0][1]
    assert invalid[1:] == [(30, UNVERIFIED)]


def test_an_unreadable_manifest_has_no_mark(tmp_path):
    directory = tmp_path / "step"
    directory.mkdir()
    assert manifest_verified(directory) is None
    (directory / MANIFEST).write_text("[1, 2]")
    assert manifest_verified(directory) is None
    (directory / MANIFEST).write_text('{"verified": "yes"}')
    assert manifest_verified(directory) is None
