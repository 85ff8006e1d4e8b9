"""The pod template pieces every workload shares: the agent's command line, its
environment, resources, volumes and mounts.

The command line is a contract: tests and a pod emulator parse it with the real
`unbroken run` parser, after expanding `$(VAR)` as Kubernetes would. Its order and
spelling are fixed (`agent_args`).

The job's signing secret is a Secret mounted as a file (`--secret-file`), never an
environment value and never part of a manifest: `secret_command` says how to make it.
"""

from __future__ import annotations

from unbroken.k8s import names, sizing
from unbroken.k8s.spec import ControlPlane, K8sSpec
from unbroken.telemetry.event_copy import POD_UID_ENV

CONTAINER = "node"
"""The agent's container in a JobSet or Trainer pod: Trainer's torch plugin looks for
`node`, and the podFailurePolicy rules name it."""
COMMAND = ["unbroken", "run"]

RUN_DIR = "/var/run/unbroken/run"
SECRET_DIR = "/var/run/unbroken/secret"
SECRET_KEY = "secret"
SECRET_FILE = f"{SECRET_DIR}/{SECRET_KEY}"
ETCD_TLS_DIR = "/var/run/unbroken/etcd-tls"
# cert-manager's (and kubernetes.io/tls's) keys, and the agent flag each goes to.
ETCD_TLS_FILES = (("--etcd-cacert", "ca.crt"), ("--etcd-cert", "tls.crt"), ("--etcd-key", "tls.key"))
SECRET_MODE = 0o400

C10D_PORT_NAME = "c10d"
METRICS_PORT_NAME = "metrics"

JOB_ID_VAR = "UNBROKEN_JOB_ID"


def shutdown_timeout(spec: K8sSpec) -> int:
    """The agent's --shutdown-timeout: 5 s inside the pod's grace period, so that a pod
    told to stop hands its ranks over and exits before the kubelet's SIGKILL."""
    return max(1, spec.grace_seconds - 5)


def agent_args(spec: K8sSpec, *, standby: bool = False, pet: bool = False) -> list[str]:
    """`unbroken run`'s arguments, in this order and spelling:

    --nnodes N|MIN:MAX --nproc-per-node P, then --node-rank $(JOB_COMPLETION_INDEX) (or
    --standby); --rdzv-id $(UNBROKEN_JOB_ID); the control plane (c10d: --master-addr and
    --master-port; etcd: --rdzv-endpoint, --local-addr $(POD_IP) and the TLS files);
    --run-dir, --secret-file, --shutdown-timeout, --node-timeout, --max-restarts; --spares
    and --metrics-port/--metrics-addr when set; --event-dir or --event-stdout
    (`event_args`); the health check's (`check_args`); --tee 3 with the rank prefix; `--run-arg`'s; --continue-dead-job; the
    script and its arguments.

    `pet`: the pod's controller sets torchrun's PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT (Trainer's torch plugin,
    training-operator), which `unbroken run` takes as defaults: those flags are left out,
    but for `--nnodes MIN:MAX`, which no controller's PET_NNODES can say.
    """
    args: list[str] = []
    if not pet:
        args += ["--nnodes", spec.nnodes, "--nproc-per-node", str(spec.nproc_per_node)]
        args += ["--standby"] if standby else ["--node-rank", "$(JOB_COMPLETION_INDEX)"]
    elif spec.elastic:
        args += ["--nnodes", spec.nnodes]
    args += ["--rdzv-id", f"$({JOB_ID_VAR})"]
    if spec.control_plane == ControlPlane.EMBEDDED:
        args += ["--rdzv-backend", "c10d"]
        if not pet:
            args += ["--master-addr", names.master_addr(spec), "--master-port", str(spec.port)]
    else:
        args += ["--rdzv-backend", "etcd", "--rdzv-endpoint", ",".join(names.etcd_endpoints(spec)),
                 "--local-addr", "$(POD_IP)"]
        if spec.etcd_tls_secret:
            for flag, key in ETCD_TLS_FILES:
                args += [flag, f"{ETCD_TLS_DIR}/{key}"]
    args += ["--run-dir", RUN_DIR, "--secret-file", SECRET_FILE,
             "--shutdown-timeout", str(shutdown_timeout(spec)),
             "--node-timeout", f"{spec.node_timeout:g}",
             "--max-restarts", str(spec.max_restarts_in_place)]
    if spec.spares:
        args += ["--spares", str(spec.spares)]
    if spec.metrics:
        args += ["--metrics-port", str(spec.metrics_port), "--metrics-addr", "0.0.0.0"]
    args += event_args(spec) + check_args(spec)
    args += ["--tee", "3", "--log-line-prefix-template", RANK_PREFIX, *spec.run_args]
    args += ["--continue-dead-job", spec.script, *spec.script_args]
    return args


RANK_PREFIX = "[rank${rank}]:"
"""Each worker line in the pod's log, as torchrun --tee prefixes it, by its global rank."""
EVENT_SUBDIR = "unbroken-events"
"""Under the checkpoint volume: `<mount>/unbroken-events/<job id>/`, every pod's events."""


def event_args(spec: K8sSpec) -> list[str]:
    """Where a pod's events outlive it: a file of its own on the shared checkpoint volume (a
    PVC) under the job's id, else (node-local or no volume) its log's stdout, tagged."""
    if spec.checkpoint_pvc:
        return ["--event-dir", f"{spec.checkpoint_mount}/{EVENT_SUBDIR}/$({JOB_ID_VAR})"]
    return ["--event-stdout"]


def check_args(spec: K8sSpec) -> list[str]:
    """What the agent's health check covers before its node joins: the checkpoint volume
    (writable, at speed), the memory of the processes' host copies, the GPUs."""
    out = []
    if spec.checkpoint_pvc or spec.checkpoint_host_path:
        out += ["--check-dir", spec.checkpoint_mount]
    state = sizing.quantity_bytes(spec.state_size) or 0
    out += ["--check-memory", str(spec.processes * sizing.HOST_COPIES * state)]
    if spec.gpus:
        out += ["--check-gpus", str(spec.gpus)]
    return out


def _from_field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def jobset_identity_env() -> list[dict]:
    """The job id of a JobSet's pods (Trainer's too): `<jobset name>-<jobset uid>`, from the
    labels JobSet puts on every pod. A re-applied JobSet of the same name gets a new UID,
    so a new id; a JobSet restart keeps its UID, so the agents continue the same job."""
    return [_from_field("JOBSET_NAME", f"metadata.labels['{names.JOBSET_NAME_LABEL}']"),
            _from_field("JOBSET_UID", f"metadata.labels['{names.JOBSET_UID_LABEL}']"),
            _from_field("JOBSET_RESTART_ATTEMPT",
                        f"metadata.labels['{names.JOBSET_RESTART_LABEL}']"),
            {"name": JOB_ID_VAR, "value": "$(JOBSET_NAME)-$(JOBSET_UID)"}]


def pytorchjob_identity_env() -> list[dict]:
    """The job id of a PyTorchJob's pods: its name. training-operator labels no UID on its
    pods (and the downward API cannot read owner references), so a PyTorchJob deleted and
    applied again under the same name meets its predecessor's keys in etcd, and
    --continue-dead-job continues from them: the same name is the same job."""
    return [_from_field("PYTORCHJOB_NAME", f"metadata.labels['{names.PYTORCHJOB_NAME_LABEL}']"),
            {"name": JOB_ID_VAR, "value": "$(PYTORCHJOB_NAME)"}]


def fabric_env(spec: K8sSpec) -> list[dict]:
    """NCCL's and EFA's environment, kept short.

    With GPUs (NCCL's environment-variable documentation): NCCL_SOCKET_IFNAME=^lo,docker keeps
    NCCL's bootstrap and socket traffic off loopback and docker bridges (a leading ^ excludes
    interfaces by prefix); NCCL_DEBUG=WARN prints NCCL's warnings, not its INFO chatter.

    With EFA (AWS, "Get started with EFA and NCCL" for EC2, and the EKS manifests of
    aws-samples/awsome-distributed-training): FI_PROVIDER=efa makes libfabric, and through it
    the image's aws-ofi-nccl plugin, use the EFA devices. FI_EFA_USE_DEVICE_RDMA is left
    unset on purpose: unset, libfabric uses the device's RDMA where the instance has it
    (p4d, p5); set to 1, it aborts on EFA instances without RDMA (g5, g6), as fi_efa(7)
    says.
    """
    env = []
    if spec.gpus:
        env += [{"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker"},
                {"name": "NCCL_DEBUG", "value": "WARN"}]
    if spec.efa:
        env += [{"name": "FI_PROVIDER", "value": "efa"}]
    return env


def env(spec: K8sSpec, identity: list[dict]) -> list[dict]:
    """The container's environment, in order (a later value may use an earlier one as
    $(NAME)): the job's identity, the pod's name, IP and UID (its event file's name), HOME
    and the caches on the writable `home` volume, NCCL's and EFA's, then `--env`'s. The Job
    controller injects JOB_COMPLETION_INDEX itself."""
    return [*identity, _from_field("POD_NAME", "metadata.name"),
            _from_field("POD_IP", "status.podIP"), _from_field(POD_UID_ENV, "metadata.uid"),
            *({"name": k, "value": v} for k, v in CACHE_ENV), *fabric_env(spec),
            *({"name": k, "value": v} for k, v in spec.extra_env)]


def resources(spec: K8sSpec) -> dict:
    """CPU, memory (`sizing`), GPUs and EFA interfaces, limits = requests: Guaranteed QoS."""
    amounts = {"cpu": spec.pod_cpu, "memory": spec.pod_memory}
    if spec.gpus:
        amounts["nvidia.com/gpu"] = str(spec.gpus)
    if spec.efa:
        amounts["vpc.amazonaws.com/efa"] = str(spec.efa)
    return {"limits": dict(amounts), "requests": dict(amounts)}


HOME_DIR = "/var/run/unbroken/home"
"""A writable emptyDir: HOME and the caches a non-root user must be able to write."""
CACHE_ENV = (("HOME", HOME_DIR), ("HF_HOME", f"{HOME_DIR}/.cache/huggingface"),
             ("TRITON_CACHE_DIR", f"{HOME_DIR}/.cache/triton"),
             ("TORCHINDUCTOR_CACHE_DIR", f"{HOME_DIR}/.cache/torchinductor"))
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true"}
"""Karpenter does not consolidate a node away under a training pod (unbroken drains on
SIGTERM, but a voluntary disruption still costs a recovery)."""


def pod_security_context(spec: K8sSpec) -> dict:
    """Non-root, the volumes given to its group (only where their owner differs: large
    checkpoint volumes are not walked each start), the runtime's default seccomp."""
    uid = spec.run_as_user
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict:
    """The restricted profile's container part: no privilege escalation, no capability."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def template_metadata(spec: K8sSpec, role: str) -> dict:
    """A training pod template's labels and annotations."""
    return {"labels": names.labels(spec, role), "annotations": dict(DO_NOT_DISRUPT)}


def volumes(spec: K8sSpec) -> list[dict]:
    """run and home (emptyDirs), secret (the job's Secret, 0400), checkpoints (PVC or hostPath, when
    given), shm (memory-backed /dev/shm), etcd-tls (when etcd serves TLS)."""
    out: list[dict] = [
        {"name": "run", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        {"name": "secret", "secret": {"secretName": spec.secret_name, "defaultMode": SECRET_MODE,
                                      "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}}]
    if spec.checkpoint_pvc:
        out.append({"name": "checkpoints",
                    "persistentVolumeClaim": {"claimName": spec.checkpoint_pvc}})
    elif spec.checkpoint_host_path:
        out.append({"name": "checkpoints",
                    "hostPath": {"path": spec.checkpoint_host_path, "type": "DirectoryOrCreate"}})
    out.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
    if spec.etcd_tls_secret:
        out.append({"name": "etcd-tls", "secret": {"secretName": spec.etcd_tls_secret,
                                                   "defaultMode": SECRET_MODE}})
    return out


def volume_mounts(spec: K8sSpec) -> list[dict]:
    out: list[dict] = [{"name": "run", "mountPath": RUN_DIR},
                       {"name": "home", "mountPath": HOME_DIR},
                       {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}]
    if spec.checkpoint_pvc or spec.checkpoint_host_path:
        out.append({"name": "checkpoints", "mountPath": spec.checkpoint_mount})
    out.append({"name": "shm", "mountPath": "/dev/shm"})
    if spec.etcd_tls_secret:
        out.append({"name": "etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": True})
    return out


def container(spec: K8sSpec, *, name: str, args: list[str], identity: list[dict],
              c10d_port_name: str = C10D_PORT_NAME) -> dict:
    """The agent's container: `unbroken run` with `args`, its environment, ports, resources
    and mounts."""
    ports = [{"name": c10d_port_name, "containerPort": spec.port, "protocol": "TCP"}]
    if spec.metrics:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": spec.metrics_port,
                      "protocol": "TCP"})
    return {"name": name, "image": spec.image, "command": list(COMMAND), "args": args,
            "env": env(spec, identity), "ports": ports, "resources": resources(spec),
            "securityContext": container_security_context(),
            "volumeMounts": volume_mounts(spec)}


def pod_spec(spec: K8sSpec, the_container: dict, *, restart_policy: str | None = "Never") -> dict:
    """A pod spec around `the_container`. restartPolicy Never (a podFailurePolicy needs it:
    the Job, not the kubelet, decides what a failed pod's exit code means); None leaves it to
    the controller (training-operator sets it from the replica's policy)."""
    out: dict = {}
    if restart_policy:
        out["restartPolicy"] = restart_policy
    out["terminationGracePeriodSeconds"] = spec.grace_seconds
    if spec.service_account:
        out["serviceAccountName"] = spec.service_account
    if spec.priority_class:
        out["priorityClassName"] = spec.priority_class
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    out["securityContext"] = pod_security_context(spec)
    out["containers"] = [the_container]
    out["volumes"] = volumes(spec)
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [dict(t) for t in spec.tolerations]
    return out


def secret_command(spec: K8sSpec) -> str:
    """The one command that makes the job's Secret: the value is made on the spot and
    never shown, stored or rendered."""
    return (f"kubectl create secret generic {spec.secret_name} --namespace {spec.namespace} "
            f"--from-literal={SECRET_KEY}=\"$(openssl rand -hex 32)\"")


def service_account(spec: K8sSpec) -> dict:
    """The pods' ServiceAccount, annotated with the IAM role IRSA gives its pods."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {**names.meta(spec, spec.service_account or "", "training"),
                         "annotations": {"eks.amazonaws.com/role-arn": spec.irsa_role_arn}}}
