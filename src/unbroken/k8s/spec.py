"""What `unbroken k8s` is asked to generate: one typed, validated `K8sSpec`.

Every mistake is found here, before anything is rendered, and told in one line
(`UserError`). The renderers (`jobset`, `trainer`, `pytorchjob`, `etcd`, `observability`)
take a valid spec and never check it again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from unbroken.errors import UserError
from unbroken.k8s import sizing
from unbroken.launch.flags.values import parse_nnodes


class Workload(StrEnum):
    """The Kubernetes object that runs the job's pods."""

    JOBSET = "jobset"
    """A JobSet (jobset.x-k8s.io/v1alpha2): the primary target; the only one with standby nodes."""
    TRAINJOB = "trainjob"
    """A Kubeflow Trainer v2 TrainJob and the ClusterTrainingRuntime it runs on."""
    PYTORCHJOB = "pytorchjob"
    """A legacy Kubeflow training-operator PyTorchJob (kubeflow.org/v1)."""


class ControlPlane(StrEnum):
    """Where the agents keep their control state."""

    EMBEDDED = "embedded"
    """Node 0's agent serves a TCPStore (`--rdzv-backend c10d`): nothing else to deploy, but
    that pod is a single point of failure."""
    ETCD = "etcd"
    """An etcd StatefulSet of the job's own (`--rdzv-backend etcd`): any agent can lead."""


# JobSet validates the names it derives as DNS-1035 labels (a letter first), and the JobSet
# name is also the name of its headless Service. The longest pod name it derives is
# `<name>-standby-<job>-<index>-xxxxx`: a name of 40 leaves room for 5-digit indices.
NAME_MAX = 40
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
QUANTITY = re.compile(r"(\d+(\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
METRICS_PORT = 9478
CROWDED_PORTS = {9100: "node-exporter", 9400: "dcgm-exporter", 9464: "OpenTelemetry's "
                 "Prometheus exporter", 8080: "cAdvisor and many apps"}
"""Ports a metrics port must not take: hostNetwork exporters and sidecars hold them."""
TRAINER_MASTER_PORT = 29500  # Trainer's torch plugin sets PET_MASTER_PORT to this, always
# Paths the pod mounts for unbroken itself (pod.py); a checkpoint mount must not shadow them
# (/var/run is /run in most images).
RESERVED_MOUNTS = ("/var/run/unbroken", "/run/unbroken", "/dev/shm")


def parse_nodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX`, as `unbroken run --nnodes` takes it: (min, max)."""
    nodes = parse_nnodes(text)
    return nodes.min, nodes.max


def parse_node_selector(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` items into a nodeSelector; a key given twice is a mistake."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--node-selector takes KEY=VALUE, got {item!r}")
        if key in out:
            raise UserError(f"--node-selector {key} is given twice")
        out[key] = value
    return out


def parse_toleration(text: str) -> dict[str, str]:
    """`KEY=VALUE:EFFECT` (operator Equal) or `KEY:EFFECT` (operator Exists) into a
    toleration."""
    head, sep, effect = text.rpartition(":")
    if not sep or not head:
        raise UserError(f"--toleration takes KEY=VALUE:EFFECT or KEY:EFFECT, got {text!r}")
    if effect not in TAINT_EFFECTS:
        raise UserError(f"--toleration {text}: the effect must be one of "
                        f"{', '.join(TAINT_EFFECTS)}, got {effect!r}")
    key, eq, value = head.partition("=")
    if eq:
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}


def _label_key_error(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return "its prefix is not a DNS subdomain"
    if len(name) > 63 or not LABEL_NAME.fullmatch(name):
        return "its name must be 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
    return None


def _label_value_ok(value: str) -> bool:
    return value == "" or (len(value) <= 63 and LABEL_NAME.fullmatch(value) is not None)


@dataclass(frozen=True)
class K8sSpec:
    """One training job on Kubernetes: what `unbroken k8s` renders. Constructing one checks
    it (a `UserError` names the first mistake, in one line); `secret_name` and `shm_size`
    get their defaults then."""

    name: str
    """The job's name: the JobSet's (TrainJob's, PyTorchJob's), and the prefix of every other
    object's. A DNS-1035 label of at most 40 characters: JobSet derives pod host names
    (`<name>-standby-0-<index>`) and a headless Service from it."""
    image: str
    """The container image: it must hold the training script and have `unbroken` on PATH."""
    script: str
    """The training script, a path inside the image."""
    script_args: tuple[str, ...] = ()
    """The script's own arguments."""
    namespace: str = "default"
    """The namespace every namespaced object goes to."""
    workload: Workload = Workload.JOBSET
    """Which object runs the pods."""
    nodes_min: int = 1
    """MIN of `--nnodes MIN:MAX` (equal to `nodes_max` for a fixed number of nodes)."""
    nodes_max: int = 1
    """The most nodes that train: the number of training pods."""
    nproc_per_node: int = 1
    """Worker processes per node (`--nproc-per-node`)."""
    standby_nodes: int = 0
    """JobSet only: pods that join as `unbroken run --standby` and take a lost node's ranks.
    Needs a fixed number of nodes."""
    spares: int = 0
    """Hot spare processes per node (`--spares`)."""
    gpus: int = 0
    """`nvidia.com/gpu` per pod (limits = requests); with any, the NCCL environment is set."""
    efa: int = 0
    """`vpc.amazonaws.com/efa` interfaces per pod (AWS); with any, the EFA environment is set."""
    checkpoint_pvc: str | None = None
    """A PersistentVolumeClaim to mount at `checkpoint_mount` (shared by every node: for a
    multi-node job, a ReadWriteMany volume such as EFS or FSx for Lustre)."""
    checkpoint_host_path: str | None = None
    """Or a node's directory (hostPath, DirectoryOrCreate): node-local, so only for one node
    or a shared file system mounted on every node at that path."""
    checkpoint_mount: str = "/checkpoints"
    """Where the checkpoint volume is mounted in the container: pass it to the script."""
    metrics: bool = False
    """Serve Prometheus metrics and render a metrics Service, a ServiceMonitor and a
    PrometheusRule (both need the Prometheus Operator's CRDs) and the Grafana dashboard's
    ConfigMap."""
    metrics_port: int = 9478
    """The port every agent serves /metrics on (`--metrics-port`): none of the common
    exporters' (`CROWDED_PORTS`)."""
    control_plane: ControlPlane = ControlPlane.EMBEDDED
    """Embedded TCPStore on node 0, or an etcd StatefulSet."""
    etcd_replicas: int = 3
    """Members of the etcd StatefulSet: an odd number."""
    etcd_tls_secret: str | None = None
    """A Secret with `ca.crt`, `tls.crt` and `tls.key` (cert-manager's layout): etcd serves
    https with client-certificate auth, peers included, and the agents present the same
    certificate. None: plain http inside the namespace."""
    secret_name: str = ""
    """The Secret holding the job's signing secret under key `secret` (default
    `<name>-secret`). Mounted as a file, never an environment value; never rendered."""
    grace_seconds: int = 30
    """The pods' terminationGracePeriodSeconds; the agent's --shutdown-timeout is 5 s less,
    so that it hands its ranks over and exits before the SIGKILL."""
    backoff_limit: int = 6
    """Per Job: pod failures counted (exit 3, 4, or unknown codes) before the Job fails."""
    max_restarts: int = 3
    """JobSet failurePolicy.maxRestarts: whole-JobSet restarts after a Job ran out of
    backoffLimit."""
    max_restarts_in_place: int = 10
    """unbroken's own budget of recoveries inside the pods (`unbroken run --max-restarts`)."""
    node_timeout: float = 10.0
    """Seconds of agent silence before its node is lost (`--node-timeout`)."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """The pods' nodeSelector."""
    tolerations: tuple[Mapping[str, str], ...] = ()
    """The pods' tolerations (`parse_toleration`)."""
    shm_size: str = ""
    """The size limit of /dev/shm, a memory-backed emptyDir (default 16Gi with GPUs, else
    1Gi): NCCL and DataLoader workers need more than a container's 64 MiB."""
    port: int = 29500
    """The c10d TCPStore port on node 0 (embedded control plane)."""
    cpu: str = ""
    """CPU per training pod, requests = limits (default: `sizing.cpu_cores`)."""
    memory: str = ""
    """Memory per training pod, requests = limits (default: `sizing.memory_bytes`, from
    `/dev/shm`, the processes and `state_size`)."""
    state_size: str = ""
    """A rank's state (parameters, optimizer): the host copies hold 3 x this (default 8Gi
    with GPUs, 256Mi without)."""
    run_as_user: int = 1000
    """The containers' user (and group, and the volumes' fsGroup): the image's user."""
    service_account: str | None = None
    """The pods' ServiceAccount (IRSA: the role that reaches S3)."""
    irsa_role_arn: str | None = None
    """With `service_account`: render it, annotated `eks.amazonaws.com/role-arn`."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets the kubelet pulls the image with."""
    priority_class: str | None = None
    """The pods' priorityClassName."""
    run_args: tuple[str, ...] = ()
    """More `unbroken run` flags, before the script (checked by its own parser)."""
    extra_env: tuple[tuple[str, str], ...] = ()
    """More environment variables for the training container, in order."""

    def __post_init__(self) -> None:
        if not self.secret_name:
            object.__setattr__(self, "secret_name", f"{self.name}-secret")
        if not self.shm_size:
            object.__setattr__(self, "shm_size", "16Gi" if self.gpus else "1Gi")
        if not self.state_size:
            object.__setattr__(self, "state_size", sizing.STATE_SIZE[bool(self.gpus)])
        for name in ("image_pull_secrets", "run_args", "extra_env"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "workload", Workload(self.workload))
        object.__setattr__(self, "control_plane", ControlPlane(self.control_plane))
        object.__setattr__(self, "script_args", tuple(self.script_args))
        object.__setattr__(self, "tolerations", tuple(self.tolerations))
        self._check()

    @property
    def processes(self) -> int:
        """Processes per training pod that hold state: workers and spares."""
        return self.nproc_per_node + self.spares

    @property
    def pod_cpu(self) -> str:
        return self.cpu or str(sizing.cpu_cores(gpus=bool(self.gpus), processes=self.processes))

    @property
    def pod_memory(self) -> str:
        if self.memory:
            return self.memory
        return sizing.gibibytes(sizing.memory_bytes(
            gpus=bool(self.gpus), processes=self.processes,
            shm=sizing.quantity_bytes(self.shm_size) or 0,
            state=sizing.quantity_bytes(self.state_size) or 0))

    @property
    def pod_security(self) -> str:
        """The Pod Security level the training pods meet: `restricted`, or `baseline` where
        a hostPath volume (`--checkpoint-host-path`) rules it out."""
        return "baseline" if self.checkpoint_host_path else "restricted"

    @property
    def elastic(self) -> bool:
        return self.nodes_min != self.nodes_max

    @property
    def nnodes(self) -> str:
        """`--nnodes` as `unbroken run` takes it: N or MIN:MAX."""
        return f"{self.nodes_min}:{self.nodes_max}" if self.elastic else str(self.nodes_max)

    def _check(self) -> None:
        if len(self.name) > NAME_MAX or not DNS1035_LABEL.fullmatch(self.name):
            raise UserError(f"--name {self.name!r}: a job name is at most {NAME_MAX} lowercase "
                            "letters, digits and '-', starting with a letter and ending with a "
                            "letter or digit (JobSet makes pod host names and a Service of it)")
        if len(self.namespace) > 63 or not DNS1123_LABEL.fullmatch(self.namespace):
            raise UserError(f"--namespace {self.namespace!r} is not a valid namespace (a DNS "
                            "label: lowercase letters, digits and '-')")
        if not self.image or any(c.isspace() for c in self.image):
            raise UserError(f"--image {self.image!r}: give the container image, e.g. "
                            "registry/unbroken-train:1.0")
        if not self.script:
            raise UserError("give the training script: unbroken k8s [flags] SCRIPT [ARGS...]")
        if self.nodes_min < 1:
            raise UserError(f"--nnodes {self.nnodes}: the number of nodes must be at least 1")
        if self.nodes_max < self.nodes_min:
            raise UserError(f"--nnodes {self.nnodes}: MIN must not exceed MAX")
        for flag, value, least in (("--nproc-per-node", self.nproc_per_node, 1),
                                   ("--standby-nodes", self.standby_nodes, 0),
                                   ("--spares", self.spares, 0), ("--gpus", self.gpus, 0),
                                   ("--efa", self.efa, 0),
                                   ("--grace-period", self.grace_seconds, 1),
                                   ("--backoff-limit", self.backoff_limit, 0),
                                   ("--max-jobset-restarts", self.max_restarts, 0),
                                   ("--max-restarts", self.max_restarts_in_place, 0),
                                   ("etcd_replicas", self.etcd_replicas, 1)):
            if value < least:
                raise UserError(f"{flag} must be {least} or more, got {value}")
        if not self.node_timeout > 0:
            raise UserError(f"--node-timeout must be a positive number of seconds, got "
                            f"{self.node_timeout:g}")
        for flag, value in (("metrics_port", self.metrics_port), ("port", self.port)):
            if not 1 <= value <= 65535:
                raise UserError(f"{flag} must be a port between 1 and 65535, got {value}")
        if self.metrics and self.metrics_port == self.port:
            raise UserError(f"the metrics port and the c10d port are both {self.port}")
        if self.standby_nodes:
            if self.workload != Workload.JOBSET:
                raise UserError(f"--standby-nodes needs --workload jobset: a {self.workload} "
                                "has one kind of node only")
            if self.elastic:
                raise UserError(f"--standby-nodes needs a fixed --nnodes, not {self.nnodes}: "
                                "with a range, the nodes beyond MAX stand by on their own")
        if self.workload == Workload.TRAINJOB and self.port != TRAINER_MASTER_PORT:
            raise UserError(f"port {self.port}: Kubeflow Trainer sets PET_MASTER_PORT="
                            f"{TRAINER_MASTER_PORT} for every TrainJob")
        if self.checkpoint_pvc and self.checkpoint_host_path:
            raise UserError("give --checkpoint-pvc or --checkpoint-host-path, not both")
        if self.checkpoint_pvc is not None and (
                len(self.checkpoint_pvc) > 253
                or not DNS1123_SUBDOMAIN.fullmatch(self.checkpoint_pvc)):
            raise UserError(f"--checkpoint-pvc {self.checkpoint_pvc!r} is not a valid claim "
                            "name (lowercase letters, digits, '-' and '.')")
        if self.checkpoint_host_path is not None and not self.checkpoint_host_path.startswith("/"):
            raise UserError(f"--checkpoint-host-path {self.checkpoint_host_path!r} must be an "
                            "absolute path on the node")
        mount = self.checkpoint_mount.rstrip("/")
        if not self.checkpoint_mount.startswith("/") or not mount:
            raise UserError(f"--checkpoint-mount {self.checkpoint_mount!r} must be an absolute "
                            "path other than /")
        for reserved in RESERVED_MOUNTS:
            if mount == reserved or mount.startswith(reserved + "/") \
                    or reserved.startswith(mount + "/"):
                raise UserError(f"--checkpoint-mount {self.checkpoint_mount} overlaps "
                                f"{reserved}, which unbroken's pod mounts for itself")
        if self.control_plane == ControlPlane.ETCD and self.etcd_replicas % 2 == 0:
            raise UserError(f"etcd_replicas must be odd (1, 3, 5), got {self.etcd_replicas}: "
                            "an even cluster survives no more failures than one member fewer")
        if self.etcd_tls_secret is not None:
            if self.control_plane != ControlPlane.ETCD:
                raise UserError("--etcd-tls-secret needs --control-plane etcd")
            if not DNS1123_SUBDOMAIN.fullmatch(self.etcd_tls_secret):
                raise UserError(f"--etcd-tls-secret {self.etcd_tls_secret!r} is not a valid "
                                "Secret name")
        if len(self.secret_name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(self.secret_name):
            raise UserError(f"--secret {self.secret_name!r} is not a valid Secret name "
                            "(lowercase letters, digits, '-' and '.')")
        for key, value in self.node_selector.items():
            if (why := _label_key_error(key)) is not None:
                raise UserError(f"--node-selector {key}={value}: {key!r} is not a label key: {why}")
            if not _label_value_ok(value):
                raise UserError(f"--node-selector {key}={value}: {value!r} is not a label value "
                                "(at most 63 letters, digits, '-', '_' or '.')")
        for tol in self.tolerations:
            if (why := _label_key_error(tol.get("key", ""))) is not None:
                raise UserError(f"--toleration {tol.get('key')!r} is not a taint key: {why}")
            if not _label_value_ok(tol.get("value", "")):
                raise UserError(f"--toleration value {tol.get('value')!r} is not a taint value")
            if tol.get("effect") not in TAINT_EFFECTS:
                raise UserError(f"--toleration effect {tol.get('effect')!r} must be one of "
                                f"{', '.join(TAINT_EFFECTS)}")
        self._check_layout()
        self._check_pod_settings()
        quantity = QUANTITY.fullmatch(self.shm_size)
        if quantity is None or float(quantity.group(1)) <= 0:
            raise UserError(f"--shm-size {self.shm_size!r} must be a positive size such as "
                            "16Gi or 512Mi")

    def _check_layout(self) -> None:
        """Layouts that cannot run: each process needs a GPU of its own."""
        if not self.gpus:
            return
        if self.nproc_per_node > self.gpus:
            raise UserError(f"--nproc-per-node {self.nproc_per_node} with --gpus {self.gpus}: "
                            "each worker needs a GPU of its own (give --nproc-per-node "
                            f"{self.gpus} or fewer)")
        if self.processes > self.gpus:
            raise UserError(f"--nproc-per-node {self.nproc_per_node} and --spares "
                            f"{self.spares} need {self.processes} GPUs, the pod has "
                            f"--gpus {self.gpus}: a spare holds a GPU of its own (give "
                            f"--nproc-per-node {self.gpus - self.spares})")

    def _check_pod_settings(self) -> None:
        for flag, value in (("--memory", self.memory), ("--state-size", self.state_size)):
            if value and (sizing.quantity_bytes(value) or 0) <= 0:
                raise UserError(f"{flag} {value!r} must be a positive quantity such as 64Gi")
        if self.cpu and (not re.fullmatch(r"\d+(\.\d+)?m?", self.cpu)
                         or float(self.cpu.rstrip("m")) <= 0):
            raise UserError(f"--cpu {self.cpu!r} must be a positive number of cores such as "
                            "8 or 500m")
        if not 0 < self.run_as_user < 2**31:
            raise UserError(f"--run-as-user {self.run_as_user}: a non-root user id (1 or more)")
        for flag, value in (("--service-account", self.service_account),
                            ("--priority-class", self.priority_class),
                            *(("--image-pull-secret", v) for v in self.image_pull_secrets)):
            if value is not None and (len(value) > 253
                                      or not DNS1123_SUBDOMAIN.fullmatch(value)):
                raise UserError(f"{flag} {value!r} is not a valid object name (lowercase "
                                "letters, digits, '-' and '.')")
        if self.irsa_role_arn is not None:
            if self.service_account is None:
                raise UserError("--irsa-role-arn needs --service-account: the role is the "
                                "ServiceAccount's annotation")
            if not re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+",
                                self.irsa_role_arn):
                raise UserError(f"--irsa-role-arn {self.irsa_role_arn!r} is not an IAM role "
                                "ARN (arn:aws:iam::123456789012:role/NAME)")
        for key, _value in self.extra_env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise UserError(f"--env {key}=...: {key!r} is not an environment variable name")
        if self.metrics and self.metrics_port in CROWDED_PORTS:
            raise UserError(f"--metrics-port {self.metrics_port} is {CROWDED_PORTS[self.metrics_port]}'s "
                            f"port on many nodes: choose another (default {METRICS_PORT})")

    def warnings(self) -> list[str]:
        """What is allowed but probably not meant, one line each."""
        out = []
        if not (self.checkpoint_pvc or self.checkpoint_host_path):
            out.append("no --checkpoint-pvc or --checkpoint-host-path: checkpoints written in "
                       "the container are lost with its pod, and a restart starts from step 0")
        elif self.checkpoint_host_path and self.nodes_max + self.standby_nodes > 1:
            out.append(f"--checkpoint-host-path {self.checkpoint_host_path} is each node's own "
                       "directory: a multi-node job needs one shared file system (a "
                       "ReadWriteMany --checkpoint-pvc) unless that path is one on every node")
        if self.checkpoint_host_path:
            out.append("--checkpoint-host-path: the pods mount a hostPath volume "
                       "(spec.volumes[].hostPath), so they meet the 'baseline' Pod Security "
                       "profile, not 'restricted'")
        if self.efa and not self.gpus:
            out.append("--efa without --gpus: EFA carries NCCL's traffic; without GPUs the "
                       "workers' gloo traffic goes over TCP anyway")
        return out
