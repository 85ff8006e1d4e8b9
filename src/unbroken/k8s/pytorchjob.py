"""The legacy Kubeflow training-operator PyTorchJob (kubeflow.org/v1): a Master (node 0)
and N-1 Workers.

training-operator (pkg/controller.v1/pytorch/envvar.go and master.go, v1.9) sets on every
pod, without an elasticPolicy: MASTER_ADDR and PET_MASTER_ADDR (`<name>-master-0`, a
Service per replica), MASTER_PORT and PET_MASTER_PORT (the `pytorch` container's port named
`pytorchjob-port`), WORLD_SIZE (replicas x nprocPerNode), RANK and PET_NODE_RANK (0 for the
Master, index+1 for Worker `index`), PET_NNODES (the replicas) and PET_NPROC_PER_NODE
(spec.nprocPerNode). `unbroken run` takes the PET_* variables as defaults, so the command
gives none of those flags (`pod.agent_args(pet=True)`): no $(RANK) or $(WORLD_SIZE) is
needed. The operator reads the exit code of the container named `pytorch` only.

The restart policy is training-operator's `ExitCode`, the one closest to unbroken's codes:
the operator fails the whole PyTorchJob on a code 1-127 ("permanent") and deletes and
recreates the pod on a code 128-255 ("retryable"). So 1 (gave up) and 2 (configuration)
fail the job, as they should, and 130/143 (SIGINT, SIGTERM: a deletion, an eviction) bring
the pod back, as they should. But 3 (control plane lost: worth restarting that node) and 4
(quarantined: bring the node back elsewhere) are below 128, so the operator takes them as
permanent too and fails the whole job, where a JobSet would recreate the pod. OnFailure
would restart 1 and 2 forever (until backoffLimit) on the same machine, and Never would
fail the job on any exit, evictions included: ExitCode loses least. Use the JobSet when
codes 3 and 4 must bring a node back.

Standby nodes would need a replica type the operator does not have: not offered.
"""

from __future__ import annotations

from unbroken.k8s import names, pod
from unbroken.k8s.spec import K8sSpec

API_VERSION = "kubeflow.org/v1"
CONTAINER = "pytorch"  # training-operator's PyTorchJobDefaultContainerName
PORT_NAME = "pytorchjob-port"  # training-operator's PyTorchJobDefaultPortName
RESTART_POLICY = "ExitCode"


def _replica(spec: K8sSpec, count: int) -> dict:
    container = pod.container(spec, name=CONTAINER, args=pod.agent_args(spec, pet=True),
                              identity=pod.pytorchjob_identity_env(), c10d_port_name=PORT_NAME)
    return {"replicas": count, "restartPolicy": RESTART_POLICY,
            "template": {"metadata": pod.template_metadata(spec, "node"),
                         "spec": pod.pod_spec(spec, container, restart_policy=None)}}


def pytorchjob(spec: K8sSpec) -> dict:
    """The PyTorchJob `spec.name`: Master 1 and Worker N-1 (no Worker for one node)."""
    replicas = {"Master": _replica(spec, 1)}
    if spec.nodes_max > 1:
        replicas["Worker"] = _replica(spec, spec.nodes_max - 1)
    return {"apiVersion": API_VERSION, "kind": "PyTorchJob",
            "metadata": names.meta(spec, spec.name, "training"),
            "spec": {"nprocPerNode": str(spec.nproc_per_node),
                     "runPolicy": {"backoffLimit": spec.backoff_limit},
                     "pytorchReplicaSpecs": replicas}}
