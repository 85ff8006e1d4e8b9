"""Pure logic: the fault language, hang-timeout calibration, the heartbeat page, and how
state is packed to travel between peers."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.control.heartbeat_page import PHASE_CHECKPOINT, PHASE_STARTING, PHASE_TRAINING, Beat
from unbroken.errors import UserError
from unbroken.faults import FaultSpec, parse_faults
from unbroken.launch.workers.hang_detector import HangDetector
from unbroken.launch.workers.heartbeat_reader import HeartbeatReader
from unbroken.runtime.heartbeat import HeartbeatWriter


def test_fault_language_roundtrips():
    faults = parse_faults("crash:rank=1,step=30; hang:rank=2,step=60 ;slow:rank=0,step=5,seconds=2.5")
    assert faults == [FaultSpec("crash", 1, 30), FaultSpec("hang", 2, 60), FaultSpec("slow", 0, 5, 2.5)]
    assert parse_faults(";".join(map(str, faults))) == faults
    assert parse_faults("") == [] and parse_faults(None) == []


@pytest.mark.parametrize("bad, needle", [
    ("boom:rank=1,step=2", "unknown fault kind"),
    ("crash:rank=1", "needs rank= and step="),
    ("crash:rank=x,step=1", "non-numeric"),
    ("crash:rank=1,step=1,when=now", "unknown fault field"),
    ("crash:rank=-1,step=1", ">= 0"),
    ("crash:rank1,step=1", "NAME=VALUE"),
])
def test_fault_language_rejects_bad_specs(bad, needle):
    with pytest.raises(UserError, match=needle):
        parse_faults(bad)


def _beat(step, t, phase=PHASE_TRAINING):
    return Beat(step=step, monotonic=t, phase=phase, pid=1)


def test_hang_timeout_is_calibrated_from_step_times():
    d = HangDetector(startup_timeout=100, floor=5, factor=10)
    d.observe(_beat(-1, 0.0, PHASE_STARTING))
    assert d.overdue(99.0) is None and d.overdue(101.0) == 100  # startup timeout
    d.observe(_beat(0, 101.0))  # the first step began; nothing timed yet
    assert d.step_timeout() == 100
    for i in range(1, 6):
        d.observe(_beat(i, 101.0 + i * 2.0))  # 2 s steps
    assert d.step_timeout() == pytest.approx(20.0)  # 10 x the slowest step
    assert d.overdue(111.0 + 19.0) is None and d.overdue(111.0 + 21.0) == pytest.approx(20.0)


def test_hang_timeout_has_a_floor_and_respects_checkpoints_and_fixed_values():
    d = HangDetector(floor=5, factor=10, checkpoint_timeout=300)
    d.observe(_beat(0, 0.0))
    d.observe(_beat(1, 0.01))
    assert d.step_timeout() == 5  # 10 x 10 ms is below the floor
    d.observe(_beat(1, 0.02, PHASE_CHECKPOINT))
    assert d.overdue(200.0) is None and d.overdue(301.0) == 300
    fixed = HangDetector(fixed_timeout=2.5)
    fixed.observe(_beat(0, 0.0))
    assert fixed.overdue(3.0) == 2.5


def test_heartbeat_page_is_shared_between_writer_and_reader(tmp_path):
    path = tmp_path / "rank_0.hb"
    reader = HeartbeatReader(path)
    assert reader.read() is None  # nothing yet
    writer = HeartbeatWriter(path)
    assert reader.read().phase == PHASE_STARTING
    writer.stamp(41)
    beat = reader.read()
    assert beat.step == 41 and beat.phase == PHASE_TRAINING


def test_a_half_written_first_stamp_is_no_beat(tmp_path):
    """Regression: a read racing the first stamp saw the pid but a zero time, and the
    agent judged a live worker silent since boot (hours) and killed it as hung."""
    import mmap
    import struct

    path = tmp_path / "rank_0.hb"
    HeartbeatWriter(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as page:
        struct.pack_into("<qqqq", page, 0, -1, 0, PHASE_STARTING, 1234)  # time not yet stored
        assert HeartbeatReader(path).read() is None
        struct.pack_into("<q", page, 8, 5_000_000_000)
        assert HeartbeatReader(path).read().monotonic == 5.0


def test_state_travels_whole_through_pack_and_unpack():
    """Tensors of mixed dtypes and odd sizes, packed back to back into one buffer, come back
    equal (a view to another dtype needs an aligned offset: unpack must not rely on one)."""
    import torch

    from unbroken.runtime.generations.state_sync import byte_view, pack, unpack

    state = {
        "model": {"w": torch.randn(3), "b": torch.tensor([1.5], dtype=torch.bfloat16),
                  "n": torch.tensor(7, dtype=torch.int64)},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": ["w"]}],
                  "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3)}}},
        "name": "x", "none": None,
    }
    header, tensors = pack(state)
    back = unpack(header, torch.cat([byte_view(t) for t in tensors]))
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["name"] == "x" and back["none"] is None
    for path in (("model", "w"), ("model", "b"), ("model", "n")):
        a, b = state[path[0]][path[1]], back[path[0]][path[1]]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(back["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"])


def _stream_state(rank: int, store_path: str, out: str) -> None:
    """One side of test_state_streams_in_chunks (a spawned process)."""
    import torch
    import torch.distributed as dist

    from unbroken.runtime.generations.state_sync import pack, recv_bytes, send_tensors, unpack

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    state = {"w": torch.randn(4, 6).t(), "b": torch.arange(5, dtype=torch.bfloat16),
             "e": torch.empty(0), "flag": torch.tensor([True, False])}
    header, tensors = pack(state)
    total = sum(t.numel() * t.element_size() for t in tensors)
    if rank == 0:
        send_tensors(tensors, total, dst=1, group=None, device=torch.device("cpu"), chunk=7)
    else:
        back = unpack(header, recv_bytes(total, 0, None, torch.device("cpu"), chunk=7))
        same = all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype
                   for k in state)
        Path(out).write_text(str(same))
    dist.destroy_process_group()


def test_state_streams_in_chunks_through_one_small_buffer(tmp_path):
    """A 7-byte chunk: tensors split across chunks and chunks across tensors (a transposed,
    non-contiguous one, an empty one, bfloat16 and bool), between two gloo processes."""
    import torch.multiprocessing as mp

    out = tmp_path / "same.txt"
    mp.spawn(_stream_state, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    assert out.read_text() == "True"


def test_pack_refuses_what_cannot_travel():
    import torch

    from unbroken.runtime.generations.state_sync import pack

    with pytest.raises(TypeError, match="state.model.fn"):
        pack({"model": {"fn": object()}, "t": torch.zeros(1)})
