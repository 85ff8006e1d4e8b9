"""The JobSet (jobset.x-k8s.io/v1alpha2): the primary target.

One replicatedJob `node` of one Indexed Job whose pod `i` is node rank `i`, and, with
standby nodes, a replicatedJob `standby` whose pods join as `unbroken run --standby`.
Pods find node 0 by its stable host name `<name>-node-0-0.<name>` (enableDNSHostnames).

Success: an agent exits 0 only when the job's training finished (`errors.ExitCode`), so each
Job succeeds on its first pod that exits 0 (`policy.JOB_SUCCESS_POLICY`), and the JobSet when
its `node` Job has. A pod recreated late, after the job ended (it would wait for a job that
is gone), is then terminated by the Job controller instead of holding the JobSet open. A
quarantined node's pod (exit 4) fails and is recreated for its index, and that pod joins the
running job as a standby node. A permanent exit (1, 2) fails the JobSet at once; a Job out of
backoffLimit restarts the JobSet (`policy`).
"""

from __future__ import annotations

from unbroken.k8s import names, pod, policy
from unbroken.k8s.spec import K8sSpec

API_VERSION = "jobset.x-k8s.io/v1alpha2"


def job_template(spec: K8sSpec, *, role: str, count: int, args: list[str],
                 job_labels: dict[str, str] | None = None) -> dict:
    """An Indexed Job of `count` pods running `unbroken run args`, with the exit-code
    policy; `role` (node, standby) labels its pods. `job_labels`: labels on the Job
    template (Trainer reads one)."""
    container = pod.container(spec, name=pod.CONTAINER, args=args,
                              identity=pod.jobset_identity_env())
    out: dict = {}
    if job_labels:
        out["metadata"] = {"labels": dict(job_labels)}
    out["spec"] = {
        "completionMode": "Indexed", "completions": count, "parallelism": count,
        "backoffLimit": spec.backoff_limit,
        "podFailurePolicy": {"rules": policy.pod_failure_rules(pod.CONTAINER)},
        "successPolicy": policy.JOB_SUCCESS_POLICY,
        "template": {"metadata": pod.template_metadata(spec, role),
                     "spec": pod.pod_spec(spec, container)}}
    return out


def jobset_spec(spec: K8sSpec, *, pet: bool = False,
                node_job_labels: dict[str, str] | None = None) -> dict:
    """The JobSet's spec (a Trainer runtime's template holds the same, with `pet`: the
    controller gives the node count, rank and master by PET_* variables)."""
    replicated = [{"name": names.NODE_JOB, "replicas": 1,
                   "template": job_template(spec, role=names.NODE_JOB, count=spec.nodes_max,
                                            args=pod.agent_args(spec, pet=pet),
                                            job_labels=node_job_labels)}]
    if spec.standby_nodes:
        replicated.append({"name": names.STANDBY_JOB, "replicas": 1,
                           "template": job_template(spec, role=names.STANDBY_JOB,
                                                    count=spec.standby_nodes,
                                                    args=pod.agent_args(spec, standby=True))})
    return {
        "network": {"enableDNSHostnames": True, "subdomain": spec.name,
                    "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [names.NODE_JOB]},
        "failurePolicy": policy.jobset_failure_policy(spec),
        "replicatedJobs": replicated,
    }


def jobset(spec: K8sSpec) -> dict:
    """The JobSet named `spec.name`."""
    return {"apiVersion": API_VERSION, "kind": "JobSet",
            "metadata": names.meta(spec, spec.name, "training"),
            "spec": jobset_spec(spec)}
