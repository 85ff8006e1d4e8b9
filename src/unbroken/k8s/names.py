"""What every rendered object is called, how it is labelled, and the host names and ports
the pods reach each other by. Declared once: the renderers and the agents' command line
must agree on them."""

from __future__ import annotations

from unbroken.k8s.spec import ControlPlane, K8sSpec, Workload

# JobSet's labels on its pods (sigs.k8s.io/jobset api/jobset/v1alpha2 and pkg/constants).
# The UID label needs JobSet v0.9.0 or later.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
JOBSET_RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
# training-operator's label on a PyTorchJob's pods (kubeflow.org/v1 common_types.go).
PYTORCHJOB_NAME_LABEL = "training.kubeflow.org/job-name"

NODE_JOB = "node"
"""The training nodes' replicatedJob (JobSet, Trainer): its pods are `<name>-node-0-<rank>`."""
STANDBY_JOB = "standby"
"""The standby nodes' replicatedJob (JobSet only)."""

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380


def labels(spec: K8sSpec, component: str) -> dict[str, str]:
    """The labels every object (and pod template) carries: `kubectl get all -l
    app.kubernetes.io/instance=<name>` lists the job's objects."""
    return {"app.kubernetes.io/part-of": "unbroken", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component}


def meta(spec: K8sSpec, name: str, component: str, namespaced: bool = True) -> dict:
    """An object's metadata: its name, the job's namespace (unless cluster-scoped), labels."""
    out: dict = {"name": name}
    if namespaced:
        out["namespace"] = spec.namespace
    out["labels"] = labels(spec, component)
    return out


def master_addr(spec: K8sSpec) -> str:
    """Node 0's host name, as the other pods resolve it: JobSet's
    `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>` (Trainer's JobSet is named
    after the TrainJob), or training-operator's per-replica Service `<name>-master-0`."""
    if spec.workload == Workload.PYTORCHJOB:
        return f"{spec.name}-master-0"
    return f"{spec.name}-{NODE_JOB}-0-0.{spec.name}"


def pod_selector(spec: K8sSpec) -> dict[str, str]:
    """Labels that select the job's pods, as their controller sets them."""
    if spec.workload == Workload.PYTORCHJOB:
        return {PYTORCHJOB_NAME_LABEL: spec.name}
    return {JOBSET_NAME_LABEL: spec.name}


def etcd_service(spec: K8sSpec) -> str:
    """The etcd StatefulSet's name, and its headless Service's."""
    return f"{spec.name}-etcd"


def etcd_member(spec: K8sSpec, index: int) -> str:
    return f"{etcd_service(spec)}-{index}"


def etcd_host(spec: K8sSpec, index: int) -> str:
    """A member's stable DNS name within the namespace: `<name>-etcd-i.<name>-etcd`."""
    return f"{etcd_member(spec, index)}.{etcd_service(spec)}"


def etcd_scheme(spec: K8sSpec) -> str:
    return "https" if spec.etcd_tls_secret else "http"


def etcd_endpoints(spec: K8sSpec) -> list[str]:
    """The agents' `--rdzv-endpoint` list: every member's client address (`https://` in
    front when etcd serves TLS, as `unbroken run` takes it)."""
    assert spec.control_plane == ControlPlane.ETCD
    prefix = "https://" if spec.etcd_tls_secret else ""
    return [f"{prefix}{etcd_host(spec, i)}:{ETCD_CLIENT_PORT}" for i in range(spec.etcd_replicas)]


def runtime_name(spec: K8sSpec) -> str:
    """The job's own ClusterTrainingRuntime: it holds the job's volumes and policies, so it
    is one per job, not a shared `unbroken-torch`."""
    return f"{spec.name}-runtime"


def metrics_service(spec: K8sSpec) -> str:
    return f"{spec.name}-metrics"


def prometheus_rule(spec: K8sSpec) -> str:
    return f"{spec.name}-rules"


def dashboard_configmap(spec: K8sSpec) -> str:
    return f"{spec.name}-grafana-dashboard"
