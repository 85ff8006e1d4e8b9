"""`unbroken k8s`'s flags, and their translation into a `K8sSpec` (which checks them)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from unbroken.errors import UserError
from unbroken.k8s.spec import (
    METRICS_PORT,
    ControlPlane,
    K8sSpec,
    Workload,
    parse_node_selector,
    parse_nodes,
    parse_toleration,
)
from unbroken.launch.flags.values import seconds


def add_k8s_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True,
                   help="the job's name (at most 40 characters: a-z, 0-9, '-'); every object is "
                        "named after it")
    p.add_argument("--namespace", default="default", help="the namespace (default: default)")
    p.add_argument("--image", required=True,
                   help="the container image: it holds the script and `unbroken`")
    p.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.JOBSET.value,
                   help="jobset (default): a JobSet; trainjob: a Kubeflow Trainer v2 TrainJob and "
                        "its ClusterTrainingRuntime; pytorchjob: a training-operator PyTorchJob")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="training nodes (pods), as `unbroken run --nnodes` (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="P",
                   help="worker processes per node (default 1)")
    p.add_argument("--standby-nodes", type=int, default=0, metavar="S",
                   help="jobset: pods that stand by to take a lost node's ranks (default 0)")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="hot spare processes per node (`unbroken run --spares`; default 0)")
    p.add_argument("--gpus", type=int, default=0, metavar="G",
                   help="nvidia.com/gpu per pod (default 0)")
    p.add_argument("--efa", type=int, default=0, metavar="E",
                   help="vpc.amazonaws.com/efa interfaces per pod (AWS; default 0)")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--checkpoint-pvc", default=None, metavar="NAME",
                       help="a PersistentVolumeClaim for checkpoints (ReadWriteMany for several "
                            "nodes)")
    store.add_argument("--checkpoint-host-path", default=None, metavar="PATH",
                       help="or a directory on each node (hostPath)")
    p.add_argument("--checkpoint-mount", default="/checkpoints", metavar="PATH",
                   help="where checkpoints are mounted in the container (default /checkpoints): "
                        "pass it to your script")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=False,
                   help="serve Prometheus metrics; add a metrics Service, a ServiceMonitor, a "
                        "PrometheusRule and the Grafana dashboard's ConfigMap (default: no)")
    p.add_argument("--control-plane", choices=[c.value for c in ControlPlane],
                   default=ControlPlane.EMBEDDED.value,
                   help="embedded (default): node 0's agent serves the store; etcd: a 3-member "
                        "etcd StatefulSet of the job's own, so that any agent can lead")
    p.add_argument("--etcd-tls-secret", default=None, metavar="NAME",
                   help="a Secret with ca.crt, tls.crt, tls.key: etcd speaks https with client "
                        "certificates (default: plain http)")
    p.add_argument("--secret", default=None, metavar="NAME",
                   help="the Secret with the job's signing secret under key `secret` (default "
                        "NAME-secret); mounted as a file, never rendered")
    p.add_argument("--grace-period", type=int, default=30, metavar="SECONDS",
                   help="the pods' terminationGracePeriodSeconds (default 30)")
    p.add_argument("--backoff-limit", type=int, default=6, metavar="N",
                   help="pod failures a Job counts before it fails (default 6)")
    p.add_argument("--max-jobset-restarts", type=int, default=3, metavar="N",
                   help="JobSet restarts after a Job failed (failurePolicy.maxRestarts; default 3)")
    p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                   help="recoveries inside the pods (`unbroken run --max-restarts`; default 10)")
    p.add_argument("--node-timeout", type=seconds, default=10.0, metavar="SECONDS",
                   help="seconds of agent silence before a node is lost (default 10)")
    p.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label the pods need (repeatable)")
    p.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT",
                   help="a taint the pods tolerate (repeatable)")
    p.add_argument("--shm-size", default=None, metavar="SIZE",
                   help="the size of /dev/shm (default 16Gi with GPUs, else 1Gi)")
    p.add_argument("--metrics-port", type=int, default=METRICS_PORT, metavar="PORT",
                   help=f"the agents' /metrics port (default {METRICS_PORT}: none of the common "
                        "exporters' 9100, 9400, 9464, 8080)")
    p.add_argument("--cpu", default="", metavar="CORES",
                   help="CPU per training pod, requests = limits (default: 8 per process with "
                        "GPUs, 1 without, +1 for the agent)")
    p.add_argument("--memory", default="", metavar="SIZE",
                   help="memory per training pod, requests = limits (default: /dev/shm + per "
                        "process its base and 3 x --state-size + 1Gi; docs/kubernetes.md)")
    p.add_argument("--state-size", default="", metavar="SIZE",
                   help="one rank's state (parameters, optimizer), for the host copies' memory "
                        "(default 8Gi with GPUs, 256Mi without)")
    p.add_argument("--run-as-user", type=int, default=1000, metavar="UID",
                   help="the containers' user, group and volumes' fsGroup: the image's user "
                        "(default 1000, deploy/Dockerfile.*'s)")
    p.add_argument("--service-account", default=None, metavar="NAME",
                   help="the pods' ServiceAccount (e.g. the one IRSA maps to a role for S3)")
    p.add_argument("--irsa-role-arn", default=None, metavar="ARN",
                   help="render --service-account annotated with this IAM role (EKS IRSA)")
    p.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME",
                   help="a Secret to pull the image with (repeatable)")
    p.add_argument("--priority-class", default=None, metavar="NAME",
                   help="the pods' priorityClassName")
    p.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                   help="one more `unbroken run` argument, before the script (repeatable; "
                        "e.g. --run-arg=--hang-timeout=600)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the training container (repeatable)")
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="write one file per object into DIR (default: YAML on stdout)")
    p.add_argument("script", help="the training script, a path inside the image")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def spec_from_args(args: argparse.Namespace) -> K8sSpec:
    """The flags as a K8sSpec (a UserError names the first mistake)."""
    nodes_min, nodes_max = parse_nodes(args.nnodes)
    check_run_args(args.run_arg)
    return K8sSpec(
        name=args.name, namespace=args.namespace, image=args.image,
        workload=Workload(args.workload), nodes_min=nodes_min, nodes_max=nodes_max,
        nproc_per_node=args.nproc_per_node, standby_nodes=args.standby_nodes,
        spares=args.spares, gpus=args.gpus, efa=args.efa, checkpoint_pvc=args.checkpoint_pvc,
        checkpoint_host_path=args.checkpoint_host_path, checkpoint_mount=args.checkpoint_mount,
        metrics=args.metrics, control_plane=ControlPlane(args.control_plane),
        etcd_tls_secret=args.etcd_tls_secret, secret_name=args.secret or "",
        grace_seconds=args.grace_period, backoff_limit=args.backoff_limit,
        max_restarts=args.max_jobset_restarts, max_restarts_in_place=args.max_restarts,
        node_timeout=args.node_timeout, node_selector=parse_node_selector(args.node_selector),
        tolerations=tuple(parse_toleration(t) for t in args.toleration),
        shm_size=args.shm_size or "", script=args.script, script_args=tuple(args.script_args),
        metrics_port=args.metrics_port, cpu=args.cpu, memory=args.memory,
        state_size=args.state_size, run_as_user=args.run_as_user,
        service_account=args.service_account, irsa_role_arn=args.irsa_role_arn,
        image_pull_secrets=tuple(args.image_pull_secret), priority_class=args.priority_class,
        run_args=tuple(args.run_arg), extra_env=tuple(parse_env(e) for e in args.env))


def check_run_args(run_args: list[str]) -> None:
    """`--run-arg`s as `unbroken run`'s own parser reads them (a mistake: one line)."""
    if not run_args:
        return
    from unbroken.launch.flags.parser import add_run_flags

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise UserError(f"--run-arg {' '.join(run_args)}: unbroken run says: {message}")

    parser = _Parser(prog="unbroken run", add_help=False)
    add_run_flags(parser, {})
    parser.parse_args([*run_args, "train.py"])


def parse_env(item: str) -> tuple[str, str]:
    """`KEY=VALUE` (the value may be empty, or hold '=')."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UserError(f"--env takes KEY=VALUE, got {item!r}")
    return key, value
