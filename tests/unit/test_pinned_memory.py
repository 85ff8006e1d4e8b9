"""Host memory of a save and of a snapshot round, as GPU ranks take it, on CPU tensors (what
is checked is sizes and order, not devices): the staging buffer is one allocation of
exactly the staged bytes, a data-parallel rank stages only the replicated tensors it writes,
the budget counts the exchange's ring, a buffer that cannot fit is refused with the figures,
and the ring reuses a chunk only after its sends completed. On a GPU the same code pins
(`benchmarks/gpu_check.py`'s pinned and exchange checks)."""

from __future__ import annotations

import pytest
import torch

from unbroken.checkpoint.host_buffer import ALIGN, HostBuffer
from unbroken.checkpoint.staging import StagingArea, refusal
from unbroken.checkpoint.writers import assign, digest, fill, replicated
from unbroken.runtime.sharded.chunk_ring import ChunkRing
from unbroken.runtime.sharded.host_copy import CHUNK, RING_SLOTS, HostBudget
from unbroken.runtime.sharded.host_copy import refusal as snapshot_refusal

MIB = 2**20


def _state() -> dict:
    """Odd sizes on purpose: a pinned allocator would round each up to a power of two."""
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(1000, 3), "b": torch.randn(7), "n": torch.tensor(5)},
            "optim": {"state": {0: {"exp_avg": torch.randn(1000, 3), "step": torch.tensor(3.0)},
                                1: {"exp_avg": torch.randn(7)}},
                      "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
            "extra": [torch.randn(5)]}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_the_staging_buffer_is_one_allocation_of_exactly_the_staged_bytes():
    state = _state()
    area = StagingArea()
    staged = area.stage(state, late=lambda t: False)
    tensors = [t for _, t in _flat(state)]
    exact = sum(-(-_nbytes(t) // ALIGN) * ALIGN for t in tensors)
    assert area.host_bytes == exact  # not a power of two per tensor: 12000 B stays 12032
    assert staged.nbytes == sum(_nbytes(t) for t in tensors)
    assert area.pinned_bytes == 0 and staged.pinned == 0  # no GPU: nothing to register
    assert torch.equal(staged.state["model"]["w"], state["model"]["w"])
    assert staged.state["optim"]["param_groups"] == state["optim"]["param_groups"]
    first = area._host.tensor.data_ptr()
    area.stage(_state(), late=lambda t: False)
    assert area._host.tensor.data_ptr() == first  # same layout: the buffer is reused
    area.close()
    assert area.host_bytes == 0


def test_a_data_parallel_rank_stages_only_the_replicated_tensors_it_writes():
    state = _state()
    items = list(replicated(state))
    assert {it.name for it in items} == {"model/w", "model/b", "model/n", "optim/state/0/exp_avg",
                                         "optim/state/0/step", "optim/state/1/exp_avg"}
    writers = assign(items, 4)
    assert assign(list(reversed(items)), 4) == writers  # the same on every rank, any order
    loads = [sum(it.nbytes for it in items if writers[it.path] == r) for r in range(4)]
    assert sorted(loads)[-2:] == [12000, 12000]  # the two large ones on two ranks
    staged_bytes = 0
    for rank in range(4):
        leave_out = frozenset(p for p, r in writers.items() if r != rank)
        staged = StagingArea().stage(state, late=lambda t: False, leave_out=leave_out)
        staged_bytes += staged.nbytes
        assert all(p not in leave_out for p, _ in _flat(staged.state))
        assert staged.state["extra"][0].numel() == 5  # a list's tensors stay with every rank
    whole = sum(_nbytes(t) for _, t in _flat(state))
    assert staged_bytes == whole + 3 * 20  # each replicated tensor once, the list's on all 4


def test_the_layout_digest_tells_ranks_that_hold_the_same_tensors():
    a, b = list(replicated(_state())), list(replicated(_state()))
    assert digest(a) == digest(b) and 0 < digest(a) < 2**56
    other = _state()
    other["model"]["w"] = torch.randn(1000, 4)
    assert digest(list(replicated(other))) != digest(a)


def test_a_rollback_fills_what_other_ranks_wrote_from_their_copies():
    """Two ranks' partial staged copies made whole by `fill`: both make the same broadcasts
    in the same order, each the writer of some, played here from the writers' own copies."""
    state = _state()
    items = {it.path: it for it in replicated(state)}
    writers = assign(list(items.values()), 2)
    parts = [StagingArea().stage(state, lambda t: False,
                                 leave_out=frozenset(p for p, r in writers.items() if r != rank)
                                 ).state for rank in range(2)]
    order = sorted(writers, key=lambda p: items[p].name)
    sent = [_at(parts[writers[p]], p).clone() for p in order]  # what each writer sends
    for rank in range(2):
        calls = iter(sent)

        def broadcast(t: torch.Tensor, writer: int, rank=rank, calls=calls) -> None:
            payload = next(calls)
            if writer != rank:
                t.copy_(payload)

        fill(parts[rank], writers, items, rank, broadcast)
        for path, t in _flat(state):
            assert torch.equal(_at(parts[rank], path), t), (rank, path)


def _at(state, path):
    for k in path:
        state = state[k]
    return state


def test_a_staging_buffer_that_cannot_fit_is_refused_with_the_figures():
    area = StagingArea(available=lambda: 10_000)
    with pytest.raises(MemoryError) as refused:
        area.stage(_state(), late=lambda t: False)
    line = str(refused.value)
    assert line == refusal(area_bytes(_state()), 10_000, False)
    assert "MiB of host memory on this rank" in line and "0 MiB is available" in line
    assert refusal(100 * MIB, 1000 * MIB, True) is None
    assert "800 MiB of pinned host memory" in refusal(800 * MIB + 1, 1000 * MIB, True)


def area_bytes(state: dict) -> int:
    return sum(-(-_nbytes(t) // ALIGN) * ALIGN for _, t in _flat(state))


def test_the_snapshot_budget_counts_the_exchanges_ring_on_gpu():
    budget = HostBudget(shard=400 * MIB, replicas=1, transient=RING_SLOTS * CHUNK)
    assert budget.copies == 1200 * MIB and budget.total == 1216 * MIB
    assert budget.describe() == ("1216 MiB ((1 + 2 x 1 replica(s)) x 400 MiB + 16 MiB pinned "
                                 "for the exchange)")
    assert snapshot_refusal(400 * MIB, 1, 1510 * MIB) is None  # 1200 of 1510: fits
    why = snapshot_refusal(400 * MIB, 1, 1510 * MIB, transient=300 * MIB)  # 1500 of 1510
    assert why is not None and "300 MiB pinned for the exchange" in why


class _Work:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("waited", self.name))


def test_the_ring_reuses_a_chunk_only_after_its_sends_completed():
    log: list = []
    ring = ChunkRing(slots=2, chunk=8, pin=False)
    data = torch.arange(40, dtype=torch.uint8)
    seen = []

    def post(host: torch.Tensor, i: int) -> list:
        seen.append(host.clone())
        log.append(("posted", i))
        return [_Work(log, f"{i}->a"), _Work(log, f"{i}->b")]

    left = ring.send([data[i:i + 8] for i in range(0, 40, 8)], post)
    assert torch.equal(torch.cat(seen), data)  # each chunk's bytes as they were sent
    # Chunk 2 reuses chunk 0's slot: both of chunk 0's sends were waited for first.
    assert log[:8] == [("posted", 0), ("posted", 1), ("waited", "0->a"), ("waited", "0->b"),
                       ("posted", 2), ("waited", "1->a"), ("waited", "1->b"), ("posted", 3)]
    assert [w.name for w in left] == ["4->a", "4->b", "3->a", "3->b"]
    assert ring.host_bytes == 16 and ring.pinned_bytes == 0 and ring.copies == 5
    with pytest.raises(ValueError, match="larger than the ring's chunks"):
        ring.send([torch.zeros(9, dtype=torch.uint8)], post)
    ring.close()


def test_a_host_buffer_pins_nothing_without_a_gpu():
    buf = HostBuffer(1000, pin=True)
    assert buf.nbytes == 1000 and buf.pinned_bytes == 0
    buf.close()
    buf.close()


def _flat(state, path=()):
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _flat(v, (*path, k))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            yield from _flat(v, (*path, i))
