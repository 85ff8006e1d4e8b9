"""`K8sSpec` finds every mistake before anything is rendered, and says it in one line."""

from __future__ import annotations

import pytest

from unbroken.errors import UserError
from unbroken.k8s.spec import (
    ControlPlane,
    K8sSpec,
    Workload,
    parse_node_selector,
    parse_nodes,
    parse_toleration,
)

BASE = {"name": "job", "image": "img:1", "script": "train.py"}

MISTAKES = [
    ({"name": "Job"}, "--name 'Job'"),
    ({"name": "1job"}, "starting with a letter"),
    ({"name": "a" * 41}, "at most 40"),
    ({"name": "job-"}, "--name"),
    ({"namespace": "Bad_NS"}, "--namespace"),
    ({"image": ""}, "--image"),
    ({"image": "img 1"}, "--image"),
    ({"script": ""}, "training script"),
    ({"nodes_min": 0, "nodes_max": 0}, "at least 1"),
    ({"nodes_min": 3, "nodes_max": 2}, "MIN must not exceed MAX"),
    ({"nproc_per_node": 0}, "--nproc-per-node must be 1 or more"),
    ({"spares": -1}, "--spares"),
    ({"gpus": -1}, "--gpus"),
    ({"grace_seconds": 0}, "--grace-period"),
    ({"backoff_limit": -1}, "--backoff-limit"),
    ({"max_restarts": -1}, "--max-jobset-restarts"),
    ({"max_restarts_in_place": -1}, "--max-restarts"),
    ({"node_timeout": 0.0}, "--node-timeout"),
    ({"metrics_port": 0}, "metrics_port"),
    ({"metrics": True, "metrics_port": 29500}, "both 29500"),
    ({"checkpoint_pvc": "c", "checkpoint_host_path": "/c"}, "not both"),
    ({"checkpoint_pvc": "Bad_Claim"}, "--checkpoint-pvc"),
    ({"checkpoint_host_path": "relative"}, "absolute path on the node"),
    ({"checkpoint_mount": "ckpt"}, "--checkpoint-mount"),
    ({"checkpoint_mount": "/"}, "--checkpoint-mount"),
    ({"checkpoint_mount": "/var/run/unbroken/x"}, "overlaps /var/run/unbroken"),
    ({"checkpoint_mount": "/dev/shm"}, "overlaps /dev/shm"),
    ({"checkpoint_mount": "/var"}, "overlaps /var/run/unbroken"),
    ({"checkpoint_mount": "/run/unbroken/ckpt"}, "overlaps /run/unbroken"),
    ({"standby_nodes": 1, "workload": Workload.TRAINJOB}, "--standby-nodes needs --workload jobset"),
    ({"standby_nodes": 1, "workload": Workload.PYTORCHJOB}, "--standby-nodes needs"),
    ({"standby_nodes": 1, "nodes_min": 1, "nodes_max": 2}, "fixed --nnodes"),
    ({"workload": Workload.TRAINJOB, "port": 29600}, "PET_MASTER_PORT=29500"),
    ({"etcd_tls_secret": "tls"}, "--etcd-tls-secret needs --control-plane etcd"),
    ({"control_plane": ControlPlane.ETCD, "etcd_replicas": 2}, "must be odd"),
    ({"control_plane": ControlPlane.ETCD, "etcd_tls_secret": "Bad_Secret"}, "--etcd-tls-secret"),
    ({"secret_name": "bad secret"}, "--secret"),
    ({"node_selector": {"bad key!": "v"}}, "--node-selector"),
    ({"node_selector": {"k": "v" * 64}}, "not a label value"),
    ({"tolerations": ({"key": "k", "operator": "Exists", "effect": "Never"},)}, "effect"),
    ({"shm_size": "lots"}, "--shm-size"),
    ({"shm_size": "0Gi"}, "--shm-size"),
]


@pytest.mark.parametrize(("changes", "said"), MISTAKES, ids=[str(c) for c, _ in MISTAKES])
def test_each_mistake_is_one_clear_line(changes, said):
    with pytest.raises(UserError) as caught:
        K8sSpec(**{**BASE, **changes})
    message = str(caught.value)
    assert said in message and "\n" not in message, message


def test_defaults_follow_the_spec():
    spec = K8sSpec(**BASE)
    assert (spec.secret_name, spec.shm_size, spec.namespace) == ("job-secret", "1Gi", "default")
    assert spec.workload == Workload.JOBSET and spec.control_plane == ControlPlane.EMBEDDED
    assert K8sSpec(**BASE, gpus=8).shm_size == "16Gi"
    assert K8sSpec(**BASE, secret_name="mine", shm_size="2Gi").secret_name == "mine"
    assert K8sSpec(**BASE, workload="trainjob").workload == Workload.TRAINJOB  # a str is fine
    assert K8sSpec(**BASE, nodes_min=2, nodes_max=4).nnodes == "2:4"
    assert K8sSpec(**BASE, nodes_min=3, nodes_max=3).nnodes == "3"


def test_nodes_selectors_and_tolerations_parse_from_their_flag_forms():
    assert parse_nodes("4") == (4, 4) and parse_nodes("2:8") == (2, 8)
    with pytest.raises(UserError, match="--nnodes"):
        parse_nodes("two")
    assert parse_node_selector(["a=b", "example.com/gpu=h100", "empty="]) == {
        "a": "b", "example.com/gpu": "h100", "empty": ""}
    for bad, said in ((["novalue"], "KEY=VALUE"), (["a=1", "a=2"], "given twice")):
        with pytest.raises(UserError, match=said):
            parse_node_selector(bad)
    assert parse_toleration("nvidia.com/gpu:NoSchedule") == {
        "key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert parse_toleration("dedicated=training:NoExecute") == {
        "key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoExecute"}
    for bad in ("nocolon", ":NoSchedule", "k:Sometimes"):
        with pytest.raises(UserError, match="--toleration"):
            parse_toleration(bad)


def test_warnings_name_what_is_allowed_but_likely_not_meant():
    assert any("lost with its pod" in w for w in K8sSpec(**BASE).warnings())
    shared = K8sSpec(**BASE, nodes_min=2, nodes_max=2, checkpoint_host_path="/mnt/c").warnings()
    assert any("each node's own" in w for w in shared)
    assert K8sSpec(**BASE, checkpoint_pvc="c", gpus=8, efa=4).warnings() == []
