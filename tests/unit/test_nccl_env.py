"""NCCL's side of in-place recovery, decided without a GPU: the environment an in-place
worker gets (control/nccl_env.py), and which groups are NCCL's (runtime/groups/process_group.py).
What these decisions do on a GPU is benchmarks/gpu_check.py's to show."""

from __future__ import annotations

import pytest

from unbroken.control import nccl_env
from unbroken.runtime.groups.process_group import holds_nccl, nccl_backed

IN_PLACE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250"}


def test_an_in_place_worker_gets_every_setting_and_torch_2_15_keeps_legacy_nccl():
    assert nccl_env.needed({}, True, "2.13.0+cpu") == (IN_PLACE, [])
    changes, lines = nccl_env.needed({}, True, "2.15.0+cu128")
    assert changes == {**IN_PLACE, "TORCH_DIST_USE_NCCL2": "0"} and lines == []


def test_a_users_contrary_value_is_overridden_with_one_line_naming_it():
    changes, lines = nccl_env.needed({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                      "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, True, "2.14.1")
    assert changes["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in changes  # already as needed: nothing said
    (line,) = lines
    assert line.startswith("unbroken: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 overridden with 2 for "
                           "in-place recovery: ")


def test_without_in_place_torchruns_default_and_the_users_value_stands():
    assert nccl_env.needed({}, False, "2.15.0") == ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, [])
    assert nccl_env.needed({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, False, "2.15.0") == ({}, [])


@pytest.mark.parametrize("version, release", [
    ("2.13.0+cpu", (2, 13)), ("2.15.0", (2, 15)), ("2.16.0a0+git", (2, 16)), ("weird", (0, 0))])
def test_torch_releases_are_read_from_the_version_string(version, release):
    assert nccl_env.torch_release(version) == release


@pytest.mark.parametrize("backend, cuda, nccl", [
    ("nccl", True, True), ("nccl", False, True), ("cpu:gloo,cuda:nccl", True, True),
    ("nccl-legacy", True, True), (None, True, True), ("undefined", True, True), ("", True, True),
    (None, False, False), ("undefined", False, False), ("gloo", True, False)])
def test_which_init_process_group_forms_make_nccl_communicators(backend, cuda, nccl):
    assert nccl_backed(backend, cuda) is nccl


def test_a_group_is_nccls_by_its_backends_class_not_its_name():
    class ProcessGroupNCCL2:  # torch 2.15's class name, the only thing looked at
        pass

    class Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            if self.backend is None:
                raise RuntimeError("No backend type associated with device type cuda")
            return self.backend

    assert holds_nccl(Group(ProcessGroupNCCL2()))
    assert not holds_nccl(Group(object()))
    assert not holds_nccl(Group(None))
