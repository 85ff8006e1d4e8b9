"""Both images install through deploy/install.sh, and run as the user `unbroken k8s` gives
the pods (`--run-as-user`'s default): the Dockerfiles, read as text (no Docker here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from unbroken.k8s.spec import K8sSpec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_each_image_installs_with_the_one_script_and_runs_as_the_pods_user(name):
    text = (DEPLOY / name).read_text()
    runs = re.findall(r"^RUN (.+?)(?<!\\)$", text, flags=re.M | re.S)
    assert any("deploy/install.sh" in r for r in runs), runs
    assert not re.search(r"pip3? install", text), "install through deploy/install.sh only"
    (user,) = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert int(user) == K8sSpec(name="x", image="i", script="s").run_as_user
    assert (DEPLOY.parent / ".dockerignore").read_text().splitlines().count(".venv") == 1


def test_the_cuda_image_starts_from_nvidias_pytorch_container():
    assert re.search(r"^ARG BASE=nvcr\.io/nvidia/pytorch:\S+-py3$",
                     (DEPLOY / "Dockerfile.cuda").read_text(), flags=re.M)
