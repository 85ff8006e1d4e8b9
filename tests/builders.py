"""What several test modules build in process: a tiny model with its optimizer and its
state, checkpoint files with the reports ranks make of them, report timestamps, an event
log kept in memory."""

from __future__ import annotations

from pathlib import Path

import torch

from unbroken.telemetry.events import EventLog


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same small model (BatchNorm included: buffers that change in forward) every call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def train_step(model, optimizer) -> None:
    model(torch.randn(32, 8)).pow(2).mean().backward()  # also moves BatchNorm's statistics
    optimizer.step()
    optimizer.zero_grad()


def state_of(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, [optimizer])
    return {"model": model_sd, "optim": optim_sd}


def clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    return obj


def assert_same(a, b, path="") -> None:
    """Two (nested) states are equal, tensors bit for bit; the message names the first path
    that differs."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a} != {b}"


def write_file(directory: Path, name: str, size: int) -> None:
    """A checkpoint data file of `size` bytes."""
    (directory / name).write_bytes(b"x" * size)


def file_reports(*ranks: dict[str, int]) -> list[dict]:
    """What each rank reports it wrote ({name: bytes} per rank), as persist() receives it."""
    return [{"ok": True, "files": {n: {"bytes": b, "crc32": "0"} for n, b in files.items()}}
            for files in ranks]


# A fixed epoch for sample reports' timestamps.
T0 = 1_700_000_000.0


def plots_in(page: Path) -> int:
    """How many plots an HTML report embeds."""
    return page.read_text().count('<img class="plot"')


class Recorder(EventLog):
    """The event log, kept in memory: what was emitted, in order, as the log would hold it."""

    def __init__(self) -> None:
        super().__init__(None, source="worker", node=0, rank=0, attempt=0)
        self.records: list[dict] = []

    def emit(self, event, **fields):  # noqa: ANN001, ANN003, ANN201
        record = super().emit(event, **fields)
        self.records.append(record)
        return record

    def named(self, name: str) -> list[dict]:
        return [r for r in self.records if r["event"] == name]
