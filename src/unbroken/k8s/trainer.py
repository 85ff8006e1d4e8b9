"""Kubeflow Trainer v2: a ClusterTrainingRuntime (trainer.kubeflow.org/v1alpha1) and the
TrainJob that runs on it.

The runtime's template is the JobSet spec of `jobset.jobset_spec` (the same network,
success and failure policies, the same replicatedJob `node` with container `node`), with
the label that makes Trainer treat that Job as the trainer
(`trainer.kubeflow.org/trainjob-ancestor-step: trainer`). Trainer's torch plugin
(pkg/runtime/framework/plugins/torch) then sets the node count from the TrainJob's
numNodes, and PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the Job completion index),
PET_MASTER_ADDR (`<trainjob>-node-0-0.<trainjob>`) and PET_MASTER_PORT (29500) on that
container: `unbroken run` takes them as defaults, so the command leaves those flags out
(`pod.agent_args(pet=True)`). Trainer names the JobSet after the TrainJob, so the JobSet
labels give the job id as for a plain JobSet.

The runtime is the job's own (`<name>-runtime`), not a shared one: it holds the job's
Secret, volumes and policies. ClusterTrainingRuntimes are cluster-scoped, so two jobs of
the same name in two namespaces share one; use distinct names. Trainer replaces the
container's command and args with the TrainJob's, so the TrainJob carries the whole
command line, the script included; the runtime holds the same, so that it runs as it is.
Standby nodes need a second replicatedJob that Trainer does not drive: not offered.
"""

from __future__ import annotations

from unbroken.k8s import jobset, names, pod
from unbroken.k8s.spec import K8sSpec

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
ANCESTOR_TRAINER = "trainer"
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"


def cluster_training_runtime(spec: K8sSpec) -> dict:
    """The ClusterTrainingRuntime `<name>-runtime`: a torch mlPolicy and the JobSet
    template."""
    metadata = names.meta(spec, names.runtime_name(spec), "runtime", namespaced=False)
    metadata["labels"][FRAMEWORK_LABEL] = "torch"
    return {"apiVersion": API_VERSION, "kind": "ClusterTrainingRuntime", "metadata": metadata,
            "spec": {"mlPolicy": {"numNodes": spec.nodes_max, "torch": {}},
                     "template": {"spec": jobset.jobset_spec(
                         spec, pet=True, node_job_labels={ANCESTOR_LABEL: ANCESTOR_TRAINER})}}}


def train_job(spec: K8sSpec) -> dict:
    """The TrainJob `spec.name`: its image, node count, processes and resources per node,
    and the command line with the script."""
    trainer: dict = {"image": spec.image, "numNodes": spec.nodes_max,
                     "numProcPerNode": spec.nproc_per_node}
    if res := pod.resources(spec):
        trainer["resourcesPerNode"] = res
    trainer["command"] = list(pod.COMMAND)
    trainer["args"] = pod.agent_args(spec, pet=True)
    return {"apiVersion": API_VERSION, "kind": "TrainJob",
            "metadata": names.meta(spec, spec.name, "training"),
            "spec": {"runtimeRef": {"apiGroup": API_GROUP, "kind": "ClusterTrainingRuntime",
                                    "name": names.runtime_name(spec)},
                     "trainer": trainer}}
