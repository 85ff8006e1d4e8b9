"""The replicas' checksum: exact, order-free, blind to buffers, alert to every bit."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from unbroken.runtime.anomalies.checksum import checksum, state_tensors, wrap64

WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of `t` with one bit of one element flipped."""
    out = t.clone().contiguous()
    words = out.view(WORDS[out.element_size()]).reshape(-1)
    width = 8 * out.element_size()
    mask = 1 << bit
    if bit == width - 1:
        mask -= 1 << width  # the sign bit, as the signed word sees it
    words[index] = words[index] ^ mask
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_single_bit_flip_changes_the_checksum(dtype):
    torch.manual_seed(0)
    t = torch.randn(6, dtype=torch.float64).to(dtype)
    other = torch.randn(3)
    before = checksum([other, t])
    width = 8 * t.element_size()
    for index, bit in itertools.product(range(t.numel()), range(width)):
        after = checksum([other, flipped(t, index, bit)])
        assert after[0] != before[0], (index, bit)
        assert after != before


def test_int64_words_wrap_mod_2_to_the_64():
    big = torch.full((4,), 2**63 - 1, dtype=torch.int64)
    plain, weighted = checksum([big])
    assert plain == wrap64(4 * (2**63 - 1)) and weighted == plain
    assert -(2**63) <= plain < 2**63
    assert wrap64(2**63) == -(2**63) and wrap64(-1) == -1 and wrap64(2**64 + 5) == 5


def test_other_dtypes_and_nothing():
    assert checksum([]) == (0, 0)
    t = [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int8),
         torch.zeros(0), torch.tensor(3.5), torch.ones(2, dtype=torch.complex128)]
    assert checksum(t) == checksum([x.clone() for x in t])
    assert checksum(t) != checksum([torch.tensor([True, True, True]), *t[1:]])


def _build(seed: int = 0, bn: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 8)]
    if bn:
        layers.append(torch.nn.BatchNorm1d(8))
    layers += [torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randn(5, 4, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_two_replicas_built_alike_agree():
    (m1, o1), (m2, o2) = _build(), _build()
    _train(m1, o1)
    _train(m2, o2)
    assert checksum(state_tensors(m1, [o1])) == checksum(state_tensors(m2, [o2]))
    _train(m2, o2, seed=2)  # a different batch: a different state
    assert checksum(state_tensors(m1, [o1])) != checksum(state_tensors(m2, [o2]))


def test_the_order_of_float_summation_does_not_matter():
    torch.manual_seed(0)
    t = torch.randn(1000)
    perm = torch.randperm(1000)
    back = t[perm][torch.argsort(perm)]
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))
    assert checksum([back]) == checksum([t])
    # An integer sum of the words does not depend on their order at all, where a float sum
    # of the values does: the reversed tensor has the same checksum.
    assert checksum([t.flip(0)]) == checksum([t])
    # Values reached by different float operations but bitwise equal: the same checksum.
    a, b, c = torch.tensor([1.0, 0.5]), torch.tensor([2.0, 0.25]), torch.tensor([4.0, 0.125])
    assert checksum([(a + b) + c]) == checksum([a + (b + c)])


def test_buffers_are_left_out():
    (m1, o1), (m2, o2) = _build(bn=True), _build(bn=True)
    _train(m1, o1)
    _train(m2, o2)
    m2[1].running_mean.add_(1.0)  # each DDP rank's own batch statistics
    m2[1].num_batches_tracked.add_(7)
    assert checksum(state_tensors(m1, [o1])) == checksum(state_tensors(m2, [o2]))
    with torch.no_grad():
        m2[1].weight[0] += 1.0  # a parameter is not a buffer
    assert checksum(state_tensors(m1, [o1])) != checksum(state_tensors(m2, [o2]))


def test_adamw_state_is_included():
    (m1, o1), (m2, o2) = _build(), _build()
    _train(m1, o1)
    _train(m2, o2)
    tensors = state_tensors(m2, [o2])
    params = list(m2.parameters())
    assert len(tensors) == len(params) * 4  # each param; its exp_avg, exp_avg_sq, step
    assert any(t.dim() == 0 for t in tensors)  # the step counters
    first = params[0]
    o2.state[first]["exp_avg"].view(-1)[0] += 1e-3
    assert checksum(state_tensors(m1, [o1])) != checksum(state_tensors(m2, [o2]))
    o2.state[first]["exp_avg"].copy_(o1.state[list(m1.parameters())[0]]["exp_avg"])
    assert checksum(state_tensors(m1, [o1])) == checksum(state_tensors(m2, [o2]))
    o2.state[first]["step"] += 1
    assert checksum(state_tensors(m1, [o1])) != checksum(state_tensors(m2, [o2]))


def test_swapping_two_tensors_of_one_size_changes_the_weighted_sum():
    a, b, c = torch.randn(5), torch.randn(5), torch.randn(3)
    plain, weighted = checksum([a, b, c])
    swapped = checksum([b, a, c])
    assert swapped[0] == plain and swapped[1] != weighted


def test_a_dtensor_counts_by_its_local_view():
    local = torch.randn(4)
    fake = SimpleNamespace(to_local=lambda: local)
    model = SimpleNamespace(parameters=lambda: [fake])
    assert [t is local or torch.equal(t, local) for t in state_tensors(model, [])] == [True]
    assert checksum(state_tensors(model, [])) == checksum([local])
