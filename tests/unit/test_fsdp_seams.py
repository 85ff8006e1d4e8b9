"""What the sharded path needs of FSDP2, decided by what the installed torch has, never by
its version: the parameter groups of a state (a list in torch 2.13+, one before), and
whether a step aborted mid-flight can be reset (`FSDPModule.reset_iter_state`, 2.13+).
gpu_check.py's dry run under torch 2.11 found both (check G)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from unbroken.runtime.sharded.shards import LocalShards, param_groups


def test_a_states_groups_are_read_from_the_list_or_the_single_group():
    assert param_groups(SimpleNamespace(_fsdp_param_groups=("a", "b"))) == ["a", "b"]
    assert param_groups(SimpleNamespace(_fsdp_param_group="a")) == ["a"]  # torch 2.11, 2.12
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    assert param_groups(SimpleNamespace()) == []


class _Sharded(torch.nn.Linear):
    """A module as `fully_shard` leaves it: it answers `_get_fsdp_state`."""

    def _get_fsdp_state(self):
        return SimpleNamespace(_is_root=True)


class _Resettable(_Sharded):
    def reset_iter_state(self) -> None:
        pass


def _shards(model: torch.nn.Module) -> LocalShards:
    shards = object.__new__(LocalShards)  # only the model is read: no mesh, no group
    shards.model = model
    return shards


def test_an_fsdp2_without_reset_iter_state_turns_in_place_off_in_one_line():
    why = _shards(torch.nn.Sequential(_Sharded(2, 2))).unresettable()
    assert why is not None and "reset_iter_state" in why and "\n" not in why
    assert _shards(torch.nn.Sequential(_Resettable(2, 2))).unresettable() is None
    assert _shards(torch.nn.Linear(2, 2)).unresettable() is None  # nothing sharded

