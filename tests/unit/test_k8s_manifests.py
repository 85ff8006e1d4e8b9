"""`unbroken k8s`'s manifests, checked offline: no cluster, no process, no socket.

- The core objects (Service, StatefulSet, ConfigMap), every Job a JobSet or a Trainer runtime
  holds (as a batch/v1 Job) and every PyTorchJob pod template (as a core/v1 PodTemplate)
  validate with kubernetes-validate in strict mode against Kubernetes 1.31 (the first with
  Job pod failure policies GA) and the newest schema the pinned package ships.
- JobSet, TrainJob and ClusterTrainingRuntime go through kubeflow-trainer-api's models,
  PyTorchJob through kubeflow-training's, and back: the models ignore unknown fields, so the
  round trip is compared to the original and any field dropped (a misspelt or misplaced
  one), changed or added fails, with its path.
- The ServiceMonitor has no schema in any package: `test_the_service_monitor_*` check its
  fields by hand.
- Every pod's command line, with `$(VAR)` expanded from the environment its controller gives
  it (JobSet's labels, the Job's completion index, Trainer's and training-operator's PET_*
  variables), parses under the real `unbroken run` parser into a LaunchConfig.
- Content: the exit-code policy code by code, the secret only as a mounted file, the job id
  from the JobSet's name and UID, etc.; and golden files for four invocations
  (UPDATE_GOLDEN=1 rewrites them).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

# At collection, before the unit tier's guard is up: urllib3 probes IPv6 with a socket on import.
from kubeflow.training import ApiClient
from kubeflow_trainer_api import models as trainer_models

from unbroken.cli import _build_parser
from unbroken.control.address import BackendKind
from unbroken.errors import RETRY, ExitCode, Retry
from unbroken.k8s import names, observability, pod, policy
from unbroken.k8s.flags import spec_from_args
from unbroken.k8s.render import render, to_yaml, write_dir
from unbroken.k8s.spec import ControlPlane, K8sSpec, Workload
from unbroken.launch.flags.parser import config_from_args

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "k8s"
SCRIPT = ROOT / "tests" / "scripts" / "ckpt_train.py"
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())
UID = "0b6f3c52-9d1e-4c1a-8f7e-2a5d6c7e8f90"  # a JobSet's UID, as the API server makes one

# Four representative invocations of `unbroken k8s` (the goldens), then more shapes for the
# checks that run on every rendering.
INVOCATIONS = {
    "jobset-gpu": ["--name", "llama", "--image", "registry.example.com/train:1.0",
                   "--nnodes", "4", "--nproc-per-node", "8", "--gpus", "8", "--efa", "4",
                   "--checkpoint-pvc", "ckpt-fsx", "--metrics", "--node-selector",
                   "node.kubernetes.io/instance-type=p5.48xlarge", "--toleration",
                   "nvidia.com/gpu:NoSchedule", "/workspace/train.py", "--steps", "1000",
                   "--checkpoint-dir", "/checkpoints/llama"],
    "jobset-etcd-standby": ["--name", "resilient", "--namespace", "ml", "--image", "img:2",
                            "--nnodes", "3", "--nproc-per-node", "2", "--standby-nodes", "1",
                            "--spares", "1", "--control-plane", "etcd", "--etcd-tls-secret",
                            "resilient-etcd-tls", "--checkpoint-host-path", "/mnt/shared/ckpt",
                            "--grace-period", "60", "--secret", "team-secret",
                            "/app/train.py"],
    "trainjob": ["--name", "tj", "--image", "img:3", "--workload", "trainjob", "--nnodes", "2",
                 "--nproc-per-node", "4", "--gpus", "4", "--checkpoint-pvc", "ckpt",
                 "--metrics", "/app/train.py", "--lr", "3e-4"],
    "pytorchjob-etcd": ["--name", "legacy", "--image", "img:4", "--workload", "pytorchjob",
                        "--nnodes", "3", "--nproc-per-node", "2", "--control-plane", "etcd",
                        "--checkpoint-pvc", "ckpt", "--metrics", "/app/train.py"],
}
MORE = {
    "jobset-one-node": ["--name", "solo", "--image", "img", "/app/train.py"],
    "jobset-elastic": ["--name", "elastic", "--image", "img", "--nnodes", "2:4",
                       "--node-timeout", "2.5", "--max-restarts", "0", "/app/train.py"],
    "trainjob-elastic-etcd": ["--name", "tje", "--image", "img", "--workload", "trainjob",
                              "--nnodes", "1:3", "--control-plane", "etcd", "/app/train.py"],
    "pytorchjob-one-node": ["--name", "pj", "--image", "img", "--workload", "pytorchjob",
                            "/app/train.py"],
    # A platform team's 8-node H100 job: etcd, metrics, a shared volume, IRSA for S3.
    "llm": ["--name", "llm", "--image", "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm:1",
            "--nnodes", "8", "--gpus", "8", "--efa", "32", "--nproc-per-node", "8",
            "--control-plane", "etcd", "--metrics", "--checkpoint-pvc", "ckpt",
            "--service-account", "trainer", "/app/train.py"],
    "llm-platform": ["--name", "llmp", "--image", "img:5", "--nnodes", "2", "--gpus", "8",
                     "--nproc-per-node", "7", "--spares", "1", "--checkpoint-pvc", "ckpt",
                     "--service-account", "trainer", "--irsa-role-arn",
                     "arn:aws:iam::123456789012:role/llm-s3", "--image-pull-secret", "ecr",
                     "--priority-class", "training-high", "--run-arg=--hang-timeout=600",
                     "--env", "HF_HUB_OFFLINE=1", "--state-size", "20Gi", "/app/train.py"],
}
ALL = {**INVOCATIONS, **MORE}


def spec_of(argv: list[str], script: str | None = None) -> K8sSpec:
    """The K8sSpec `unbroken k8s argv` makes, through the real CLI parser; `script` replaces
    the script (a real file, for config_from_args)."""
    args = _build_parser().parse_args(["k8s", *argv])
    if script is not None:
        args.script = script
    return spec_from_args(args)


@pytest.fixture(scope="module", params=sorted(ALL))
def case(request) -> tuple[str, K8sSpec, list[dict]]:
    spec = spec_of(ALL[request.param])
    return request.param, spec, render(spec)


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def job_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    """(replicatedJob name, Job template) of every JobSet and Trainer runtime."""
    out = []
    for obj in objs:
        if obj["kind"] == "JobSet":
            spec = obj["spec"]
        elif obj["kind"] == "ClusterTrainingRuntime":
            spec = obj["spec"]["template"]["spec"]
        else:
            continue
        out += [(rj["name"], rj["template"]) for rj in spec["replicatedJobs"]]
    return out


def pod_templates(objs: list[dict]) -> list[dict]:
    """Every pod template rendered (JobSet, Trainer runtime, PyTorchJob replicas)."""
    out = [t["spec"]["template"] for _, t in job_templates(objs)]
    for job in of_kind(objs, "PyTorchJob"):
        out += [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return out


def containers(objs: list[dict]) -> list[dict]:
    out = [c for t in pod_templates(objs) for c in t["spec"]["containers"]]
    for sts in of_kind(objs, "StatefulSet"):
        out += sts["spec"]["template"]["spec"]["containers"]
    return out


# ------------------------------------------------------------------ schemas and models


def test_core_objects_validate_strictly_against_kubernetes_schemas(case):
    _, _, objs = case
    core = [o for o in objs if o["apiVersion"] in ("v1", "apps/v1")]
    jobs = [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"x-{n}"}, **t}
            for n, t in job_templates(objs)]
    templates = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                  "template": t} for job in of_kind(objs, "PyTorchJob")
                 for t in (r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values())]
    assert core or jobs or templates
    for obj in core + jobs + templates:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_an_unknown_field():
    service = render(spec_of(ALL["jobset-gpu"]))[-4]
    assert service["kind"] == "Service"
    service = {**service, "spec": {**service["spec"], "clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="clusterIp"):
        kubernetes_validate.validate(service, "1.31", strict=True)


def diff(original, back, path: str = "$") -> list[str]:
    """Where `back` differs from `original`: dropped, added and changed fields, by path."""
    if isinstance(original, dict) and isinstance(back, dict):
        out = [f"{path}.{k}: dropped by the model" for k in original if k not in back]
        out += [f"{path}.{k}: added by the model ({back[k]!r})" for k in back if k not in original]
        for k in original.keys() & back.keys():
            out += diff(original[k], back[k], f"{path}.{k}")
        return out
    if isinstance(original, list) and isinstance(back, list):
        if len(original) != len(back):
            return [f"{path}: {len(original)} items became {len(back)}"]
        return [d for i, (a, b) in enumerate(zip(original, back, strict=True))
                for d in diff(a, b, f"{path}[{i}]")]
    if original != back or type(original) is not type(back):
        return [f"{path}: {original!r} became {back!r}"]
    return []


TRAINER_MODELS = {
    "JobSet": trainer_models.JobsetV1alpha2JobSet,
    "TrainJob": trainer_models.TrainerV1alpha1TrainJob,
    "ClusterTrainingRuntime": trainer_models.TrainerV1alpha1ClusterTrainingRuntime,
}


def trainer_round_trip(obj: dict) -> dict:
    return TRAINER_MODELS[obj["kind"]].from_dict(obj).to_dict()


def pytorchjob_round_trip(obj: dict) -> dict:
    class Response:  # what ApiClient.deserialize reads: the body as JSON text
        data = json.dumps(obj)

    client = ApiClient()
    return client.sanitize_for_serialization(client.deserialize(Response(), "KubeflowOrgV1PyTorchJob"))


def round_trip(obj: dict) -> dict:
    return pytorchjob_round_trip(obj) if obj["kind"] == "PyTorchJob" else trainer_round_trip(obj)


def test_custom_resources_survive_their_models_round_trip_field_for_field(case):
    _, _, objs = case
    custom = [o for o in objs if o["kind"] in (*TRAINER_MODELS, "PyTorchJob")]
    assert custom
    for obj in custom:
        assert diff(obj, round_trip(obj)) == [], obj["kind"]


@pytest.mark.parametrize("kind", ["JobSet", "ClusterTrainingRuntime", "PyTorchJob"])
def test_the_round_trip_catches_a_misspelt_field(kind):
    argv = {"JobSet": "jobset-gpu", "ClusterTrainingRuntime": "trainjob",
            "PyTorchJob": "pytorchjob-etcd"}[kind]
    (obj,) = of_kind(render(spec_of(ALL[argv])), kind)
    broken = json.loads(json.dumps(obj))
    (template,) = pod_templates([broken])[:1]
    template["spec"]["containers"][0]["volumeMount"] = []  # volumeMounts, misspelt
    assert any("volumeMount: dropped" in d for d in diff(broken, round_trip(broken)))


def test_the_models_reject_an_unknown_pod_failure_action():
    (obj,) = of_kind(render(spec_of(ALL["jobset-gpu"])), "JobSet")
    broken = json.loads(json.dumps(obj))
    broken["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][1][
        "action"] = "Fail"
    with pytest.raises(ValueError, match="enum"):
        trainer_round_trip(broken)


# ------------------------------------------------------------------ the ServiceMonitor


def metrics_objects(objs):
    (service,) = [o for o in of_kind(objs, "Service") if o["metadata"]["name"].endswith("-metrics")]
    (monitor,) = of_kind(objs, "ServiceMonitor")
    return service, monitor


@pytest.mark.parametrize("name", [n for n, a in ALL.items() if "--metrics" in a])
def test_the_service_monitor_selects_the_metrics_service_and_its_port(name):
    # No package ships the ServiceMonitor's schema (monitoring.coreos.com/v1 is the
    # Prometheus Operator's CRD): its fields are checked here, one by one.
    spec = spec_of(ALL[name])
    service, monitor = metrics_objects(render(spec))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"] == spec.namespace
    assert set(monitor["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [spec.namespace]}
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval"}
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])


@pytest.mark.parametrize("name", [n for n, a in ALL.items() if "--metrics" in a])
def test_the_prometheus_rule_holds_the_shipped_rules_as_they_are(name):
    # The PrometheusRule's schema is the Prometheus Operator's CRD (no package ships it):
    # its fields here; the rules themselves are promtool's (tests/integration/
    # test_prometheus.py).
    spec = spec_of(ALL[name])
    (rule,) = of_kind(render(spec), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert rule["metadata"]["namespace"] == spec.namespace
    assert rule["metadata"]["name"] == f"{spec.name}-rules"
    shipped = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "prometheus"
                              / "unbroken-rules.yml").read_text())
    assert rule["spec"] == {"groups": shipped["groups"]}


@pytest.mark.parametrize("name", [n for n, a in ALL.items() if "--metrics" in a])
def test_the_metrics_service_reaches_the_agents_metrics_port(name):
    spec = spec_of(ALL[name])
    objs = render(spec)
    service, _ = metrics_objects(objs)
    (port,) = service["spec"]["ports"]
    assert port["port"] == spec.metrics_port
    for template in pod_templates(objs):
        labels = {**template["metadata"]["labels"], **controller_labels(spec)}
        assert service["spec"]["selector"].items() <= labels.items()
        (agent,) = template["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in agent["ports"]}
        assert named[port["targetPort"]] == spec.metrics_port
        args = agent["args"]
        assert args[args.index("--metrics-port") + 1] == str(spec.metrics_port)
        assert args[args.index("--metrics-addr") + 1] == "0.0.0.0"


def test_the_dashboard_configmap_holds_the_packaged_dashboard():
    objs = render(spec_of(ALL["jobset-gpu"]))
    (cm,) = of_kind(objs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = ROOT / "src" / "unbroken" / "telemetry" / "grafana" / "unbroken.json"
    assert cm["data"] == {"unbroken.json": shipped.read_text()}
    assert json.loads(cm["data"]["unbroken.json"])["panels"]


# ------------------------------------------------------------------ the pods' command lines


def controller_labels(spec: K8sSpec) -> dict[str, str]:
    """The labels a pod's controller puts on it (those the rendering relies on)."""
    if spec.workload == Workload.PYTORCHJOB:
        return {names.PYTORCHJOB_NAME_LABEL: spec.name}
    return {names.JOBSET_NAME_LABEL: spec.name, names.JOBSET_UID_LABEL: UID,
            names.JOBSET_RESTART_LABEL: "0"}


VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, $$ is $, anything else
    is left as written."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return VAR.sub(one, text)


def field(path: str, labels: dict[str, str], annotations: dict[str, str], pod_name: str) -> str:
    if m := re.fullmatch(r"metadata\.labels\['(.+)'\]", path):
        return labels[m.group(1)]
    if m := re.fullmatch(r"metadata\.annotations\['(.+)'\]", path):
        return annotations[m.group(1)]
    return {"metadata.name": pod_name, "status.podIP": "10.1.2.3",
            "metadata.uid": "0c5a0e2e-1f4b-4c1e-9a59-7d2b8c0e4f11"}[path]


def container_env(container: dict, injected: dict[str, str], labels: dict[str, str],
                  annotations: dict[str, str], pod_name: str) -> dict[str, str]:
    """The environment Kubernetes gives the container: its env in order (a value may use an
    earlier one), then what the controllers inject (`injected`)."""
    env: dict[str, str] = {}
    for var in container["env"]:
        assert set(var) in ({"name", "value"}, {"name", "valueFrom"}), var
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            (source,) = var["valueFrom"].items()
            assert source[0] == "fieldRef", var  # never a secretKeyRef
            env[var["name"]] = field(source[1]["fieldPath"], labels, annotations, pod_name)
    return {**env, **injected}


def pods(spec: K8sSpec, objs: list[dict]) -> list[tuple[str, int, dict, dict[str, str], list]]:
    """Every pod the controllers would make: (role, index, container, environment, volumes),
    the container as the controller runs it (Trainer puts the TrainJob's image, command and
    args in the runtime's `node` container)."""
    out = []
    labels = controller_labels(spec)
    for obj in objs:
        if obj["kind"] == "JobSet" or obj["kind"] == "ClusterTrainingRuntime":
            trainjobs = of_kind(objs, "TrainJob")
            for role, template in job_templates([obj]):
                (agent,) = template["spec"]["template"]["spec"]["containers"]
                count = template["spec"]["completions"]
                injected_pet: dict[str, str] = {}
                if trainjobs:  # Trainer's torch plugin (pkg/runtime/framework/plugins/torch)
                    trainer = trainjobs[0]["spec"]["trainer"]
                    agent = {**agent, "image": trainer["image"], "command": trainer["command"],
                             "args": trainer["args"]}
                    count = trainer["numNodes"]
                    injected_pet = {"PET_NNODES": str(count),
                                    "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                                    "PET_MASTER_ADDR": f"{spec.name}-node-0-0.{spec.name}",
                                    "PET_MASTER_PORT": "29500"}
                for index in range(count):
                    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
                    injected = {"JOB_COMPLETION_INDEX": str(index), **injected_pet}
                    if trainjobs:
                        injected["PET_NODE_RANK"] = str(index)
                    env = container_env(agent, injected, labels, annotations,
                                        f"{spec.name}-{role}-0-{index}-abcde")
                    out.append((role, index, agent, env,
                                template["spec"]["template"]["spec"]["volumes"]))
        elif obj["kind"] == "PyTorchJob":  # training-operator v1.9, envvar.go and master.go
            replicas = obj["spec"]["pytorchReplicaSpecs"]
            total = sum(r["replicas"] for r in replicas.values())
            nproc = obj["spec"]["nprocPerNode"]
            (master,) = replicas["Master"]["template"]["spec"]["containers"]
            master_port = {p["name"]: p["containerPort"] for p in master["ports"]}["pytorchjob-port"]
            for rtype, replica in replicas.items():
                (agent,) = replica["template"]["spec"]["containers"]
                for index in range(replica["replicas"]):
                    rank = index + (1 if rtype == "Worker" else 0)
                    addr = f"{spec.name}-master-0"
                    injected = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(master_port),
                                "PET_MASTER_PORT": str(master_port), "MASTER_ADDR": addr,
                                "PET_MASTER_ADDR": addr, "WORLD_SIZE": str(total * int(nproc)),
                                "RANK": str(rank), "PET_NODE_RANK": str(rank),
                                "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(total)}
                    env = container_env(agent, injected, labels, {},
                                        f"{spec.name}-{rtype.lower()}-{index}")
                    out.append((rtype.lower(), rank, agent, env,
                                replica["template"]["spec"]["volumes"]))
    return out


def mounted(agent: dict, template_volumes: list[dict], tmp_path: Path) -> dict:
    """Each mountPath of the container, mapped to a directory under tmp_path holding what
    the volume would (a Secret's keys as files)."""
    volumes = {v["name"]: v for v in template_volumes}
    where = {}
    for mount in agent["volumeMounts"]:
        local = tmp_path / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "secret" in volume:
            keys = [i["path"] for i in volume["secret"].get("items", [])] or [
                "ca.crt", "tls.crt", "tls.key"]
            for key in keys:
                (local / key).write_text("x")
        where[mount["mountPath"]] = local
    return where


def unmount(arg: str, where: dict[str, Path]) -> str:
    for path, local in where.items():
        if arg.startswith(path + "/"):
            return str(local / arg[len(path) + 1:])
    return arg


def test_every_pod_command_parses_under_the_real_unbroken_run_parser(case, tmp_path, monkeypatch):
    name, _, _ = case
    spec = spec_of(ALL[name], script=str(SCRIPT))
    all_pods = pods(spec, render(spec))
    assert len(all_pods) == spec.nodes_max + spec.standby_nodes
    for role, index, agent, env, volumes in all_pods:
        assert agent["command"] == ["unbroken", "run"]
        args = [expand(a, env) for a in agent["args"]]
        assert not [a for a in args if "$(" in a], f"an undefined variable in {args}"
        where = mounted(agent, volumes, tmp_path / f"{role}{index}")
        for var in [v for v in os.environ if v.startswith("PET_")]:
            monkeypatch.delenv(var)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            own = len(args) - len(spec.script_args) - 1  # the agent's flags, not the script's
            parsed = _build_parser().parse_args(
                ["run", *[unmount(a, where) for a in args[:own]], *args[own:]])
        warnings: list[str] = []
        cfg = config_from_args(parsed, warnings.append)
        if not spec.elastic:
            assert warnings == []
        assert cfg.run_id == (spec.name if spec.workload == Workload.PYTORCHJOB
                              else f"{spec.name}-{UID}")
        assert (cfg.nnodes, cfg.min_nodes, cfg.nproc_per_node) == (
            spec.nodes_max, spec.nodes_min, spec.nproc_per_node)
        assert cfg.standby == (role == names.STANDBY_JOB)
        if not spec.elastic and role != names.STANDBY_JOB:
            assert cfg.node_rank == index and not cfg.assign_rank
        assert cfg.etcd.continue_dead_job
        assert cfg.secret_file == str(where[pod.SECRET_DIR] / "secret")
        assert cfg.run_dir == Path(pod.RUN_DIR)
        assert cfg.kill_grace == max(1, spec.grace_seconds - 5)
        assert cfg.node_timeout == spec.node_timeout
        assert cfg.recovery.max_restarts == spec.max_restarts_in_place
        assert cfg.recovery.spares == spec.spares
        assert cfg.telemetry.metrics_port == (spec.metrics_port if spec.metrics else None)
        assert cfg.script == str(SCRIPT) and cfg.script_args == list(spec.script_args)
        if spec.control_plane == ControlPlane.ETCD:
            assert cfg.backend == BackendKind.ETCD and cfg.local_addr == "10.1.2.3"
            assert list(cfg.etcd_endpoints) == names.etcd_endpoints(spec)
        else:
            assert cfg.backend == BackendKind.TCP
            assert (cfg.master_addr, cfg.master_port) == (names.master_addr(spec), spec.port)


# ------------------------------------------------------------------ content


EXPECTED_ACTION = {Retry.NEVER: "FailJob", Retry.NODE: "Count", Retry.REPLACE: "Count",
                   Retry.SIGNAL: "Ignore", Retry.NONE: None}


def action_for(rules: list[dict], code: int) -> str | None:
    """What a podFailurePolicy does with a pod of container `node` that exited `code`: the
    first matching rule's action, None if no rule matches."""
    for rule in rules:
        req = rule.get("onExitCodes")
        if req and req["operator"] == "In" and code in req["values"]:
            return rule["action"]
    return None


def test_every_job_runs_indexed_pods_that_never_restart_in_place(case):
    _, spec, objs = case
    for _, template in job_templates(objs):
        job = template["spec"]
        assert job["completionMode"] == "Indexed"
        assert job["completions"] == job["parallelism"]
        assert job["backoffLimit"] == spec.backoff_limit
        assert job["template"]["spec"]["restartPolicy"] == "Never"
        assert job["template"]["spec"]["terminationGracePeriodSeconds"] == spec.grace_seconds
        # Exit 0 is only ever the training's end (a drained node exits 5, a quarantined one
        # 4): the first pod that exits 0 completes its Job, and a late pod is ended.
        assert job["successPolicy"] == {"rules": [{"succeededCount": 1}]}
        assert "0" not in map(str, [c for r in job["podFailurePolicy"]["rules"]
                                    for c in r.get("onExitCodes", {}).get("values", [])])


def test_the_exit_code_policy_is_what_errors_retry_says_code_by_code(case):
    _, _, objs = case
    for _, template in job_templates(objs):
        rules = template["spec"]["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "Ignore", "onPodConditions": [
            {"type": "DisruptionTarget", "status": "True"}]}
        for rule in rules[1:]:
            req = rule["onExitCodes"]
            assert req["containerName"] == pod.CONTAINER
            assert req["values"] == sorted(set(req["values"])) and 0 not in req["values"]
        assert [r["action"] for r in rules[1:]] == ["Ignore", "FailJob", "Count"]
        for code in ExitCode:
            assert action_for(rules, int(code)) == EXPECTED_ACTION[RETRY[code]], code


def test_a_quarantined_node_is_never_ignored_and_never_a_success():
    action = policy.job_action(ExitCode.QUARANTINED)
    assert action not in (None, "Ignore")
    rules = policy.pod_failure_rules(pod.CONTAINER)
    assert action_for(rules, ExitCode.QUARANTINED) == "Count"


def test_the_jobset_fails_on_a_permanent_exit_and_restarts_on_any_other(case):
    _, spec, objs = case
    for obj in of_kind(objs, "JobSet") + of_kind(objs, "ClusterTrainingRuntime"):
        js = obj["spec"] if obj["kind"] == "JobSet" else obj["spec"]["template"]["spec"]
        assert js["failurePolicy"] == {
            "maxRestarts": spec.max_restarts,
            "rules": [{"name": "permanent", "action": "FailJobSet",
                       "onJobFailureReasons": ["PodFailurePolicy"]}]}
        assert js["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}
        assert js["network"] == {"enableDNSHostnames": True, "subdomain": spec.name,
                                 "publishNotReadyAddresses": True}
        assert [rj["name"] for rj in js["replicatedJobs"]] == (
            ["node", "standby"] if spec.standby_nodes else ["node"])
        assert all(rj["replicas"] == 1 for rj in js["replicatedJobs"])


def test_the_secret_is_a_mounted_file_never_an_env_value_or_an_object(case):
    _, spec, objs = case
    text = to_yaml(objs)
    assert "kind: Secret" not in text
    assert not re.search(r"\b[0-9a-f]{64}\b", text)
    for template in pod_templates(objs):
        (agent,) = template["spec"]["containers"]
        assert "envFrom" not in agent
        assert all("secretKeyRef" not in json.dumps(v) for v in agent["env"])
        secrets = {v["name"]: v["secret"] for v in template["spec"]["volumes"] if "secret" in v}
        assert secrets["secret"] == {"secretName": spec.secret_name, "defaultMode": 0o400,
                                     "items": [{"key": "secret", "path": "secret"}]}
        mounts = {m["name"]: m for m in agent["volumeMounts"]}
        assert mounts["secret"] == {"name": "secret", "mountPath": pod.SECRET_DIR, "readOnly": True}
        args = agent["args"]
        assert args[args.index("--secret-file") + 1] == f"{pod.SECRET_DIR}/secret"


def test_the_job_id_is_the_jobset_name_and_uid(case):
    _, spec, objs = case
    for template in pod_templates(objs):
        (agent,) = template["spec"]["containers"]
        args = agent["args"]
        assert args[args.index("--rdzv-id") + 1] == "$(UNBROKEN_JOB_ID)"
        env = {v["name"]: v for v in agent["env"]}
        order = [v["name"] for v in agent["env"]]
        if spec.workload == Workload.PYTORCHJOB:
            assert env["UNBROKEN_JOB_ID"]["value"] == "$(PYTORCHJOB_NAME)"
            continue
        assert env["UNBROKEN_JOB_ID"]["value"] == "$(JOBSET_NAME)-$(JOBSET_UID)"
        for var, label in (("JOBSET_NAME", "jobset-name"), ("JOBSET_UID", "jobset-uid"),
                           ("JOBSET_RESTART_ATTEMPT", "restart-attempt")):
            assert env[var]["valueFrom"]["fieldRef"]["fieldPath"] == (
                f"metadata.labels['jobset.sigs.k8s.io/{label}']")
            assert order.index(var) < order.index("UNBROKEN_JOB_ID")
        assert "JOB_COMPLETION_INDEX" not in env  # the Job controller injects it


def test_the_command_line_keeps_its_order_and_spelling():
    spec = spec_of(ALL["jobset-etcd-standby"])
    (js,) = of_kind(render(spec), "JobSet")
    node, standby = (rj["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
                     for rj in js["spec"]["replicatedJobs"])
    endpoints = ",".join(f"https://resilient-etcd-{i}.resilient-etcd:2379" for i in range(3))
    tls = "/var/run/unbroken/etcd-tls"
    assert node == [
        "--nnodes", "3", "--nproc-per-node", "2", "--node-rank", "$(JOB_COMPLETION_INDEX)",
        "--rdzv-id", "$(UNBROKEN_JOB_ID)", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints,
        "--local-addr", "$(POD_IP)", "--etcd-cacert", f"{tls}/ca.crt", "--etcd-cert",
        f"{tls}/tls.crt", "--etcd-key", f"{tls}/tls.key", "--run-dir", "/var/run/unbroken/run",
        "--secret-file", "/var/run/unbroken/secret/secret", "--shutdown-timeout", "55",
        "--node-timeout", "10", "--max-restarts", "10", "--spares", "1", "--event-stdout",
        "--check-dir", "/checkpoints", "--check-memory", str(3 * 3 * 256 * 2**20), "--tee", "3", "--log-line-prefix-template", "[rank${rank}]:", "--continue-dead-job",
        "/app/train.py"]
    assert standby == [*node[:4], "--standby", *node[6:]]


def test_trainer_and_training_operator_commands_leave_pet_flags_to_the_controller():
    for name in ("trainjob", "pytorchjob-etcd"):
        for template in pod_templates(render(spec_of(ALL[name]))):
            args = template["spec"]["containers"][0]["args"]
            for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr",
                         "--master-port"):
                assert flag not in args, (name, flag)
    (tj,) = of_kind(render(spec_of(ALL["trainjob-elastic-etcd"])), "TrainJob")
    args = tj["spec"]["trainer"]["args"]
    assert args[:2] == ["--nnodes", "1:3"]  # a range no controller's PET_NNODES can say


def test_the_trainjob_runs_on_its_own_runtime_as_trainer_expects():
    spec = spec_of(ALL["trainjob"])
    runtime, train_job = render(spec)[:2]
    assert runtime["kind"] == "ClusterTrainingRuntime" and "namespace" not in runtime["metadata"]
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert node["template"]["spec"]["template"]["spec"]["containers"][0]["name"] == "node"
    assert train_job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
        "name": runtime["metadata"]["name"]}
    trainer = train_job["spec"]["trainer"]
    assert (trainer["image"], trainer["numNodes"], trainer["numProcPerNode"]) == ("img:3", 2, 4)
    # 16Gi + 4 x (6Gi + 3 x 8Gi) + 1Gi; 4 x 8 + 1 cores
    amounts = {"cpu": "33", "memory": "137Gi", "nvidia.com/gpu": "4"}
    assert trainer["resourcesPerNode"] == {"limits": amounts, "requests": amounts}
    assert trainer["args"][-3:] == ["/app/train.py", "--lr", "3e-4"]


def test_the_pytorchjob_has_a_master_and_workers_with_the_exit_code_policy():
    (job,) = of_kind(render(spec_of(ALL["pytorchjob-etcd"])), "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {k: (r["replicas"], r["restartPolicy"]) for k, r in replicas.items()} == {
        "Master": (1, "ExitCode"), "Worker": (2, "ExitCode")}
    assert job["spec"]["nprocPerNode"] == "2"
    for replica in replicas.values():
        (agent,) = replica["template"]["spec"]["containers"]
        assert agent["name"] == "pytorch"
        assert "pytorchjob-port" in {p["name"] for p in agent["ports"]}
        assert "restartPolicy" not in replica["template"]["spec"]
    (solo,) = of_kind(render(spec_of(ALL["pytorchjob-one-node"])), "PyTorchJob")
    assert list(solo["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_gpu_and_efa_pods_get_their_resources_and_fabric_environment():
    spec = spec_of(ALL["jobset-gpu"])
    (template,) = pod_templates(render(spec))
    (agent,) = template["spec"]["containers"]
    # 16Gi of /dev/shm + 8 x (6Gi + 3 x 8Gi of host copies) + 1Gi; 8 x 8 cores + 1.
    amounts = {"cpu": "65", "memory": "257Gi", "nvidia.com/gpu": "8",
               "vpc.amazonaws.com/efa": "4"}
    assert agent["resources"] == {"limits": amounts, "requests": amounts}
    env = {v["name"]: v.get("value") for v in agent["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert "FI_EFA_USE_DEVICE_RDMA" not in env  # =1 aborts on EFA without RDMA (g5, g6)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt-fsx"}
    assert template["spec"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert template["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    (cpu,) = pod_templates(render(spec_of(ALL["jobset-one-node"])))
    # 1Gi + (2Gi + 3 x 256Mi) + 1Gi, rounded up; 1 + 1 cores
    assert cpu["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "2", "memory": "5Gi"}
    assert not {"NCCL_DEBUG", "FI_PROVIDER"} & {v["name"] for v in cpu["spec"]["containers"][0]["env"]}


def test_the_etcd_cluster_and_the_agents_agree_on_its_names():
    spec = spec_of(ALL["jobset-etcd-standby"])
    objs = render(spec)
    service, sts = objs[:2]
    assert (service["kind"], sts["kind"]) == ("Service", "StatefulSet")
    assert service["metadata"]["name"] == sts["metadata"]["name"] == sts["spec"]["serviceName"] \
        == "resilient-etcd"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"client": 2379, "peer": 2380}
    assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    assert etcd["image"].startswith("quay.io/coreos/etcd:v3.5.")
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in etcd["command"][1:])
    assert flags["--name"] == "$(POD_NAME)"
    members = [f"resilient-etcd-{i}" for i in range(3)]
    assert flags["--initial-cluster"] == ",".join(
        f"{m}=https://{m}.resilient-etcd:2380" for m in members)
    assert flags["--listen-client-urls"] == "https://0.0.0.0:2379"
    assert flags["--advertise-client-urls"] == "https://$(POD_NAME).resilient-etcd:2379"
    assert {"--client-cert-auth", "--trusted-ca-file", "--peer-client-cert-auth"} <= flags.keys()
    assert flags["--data-dir"].startswith(etcd["volumeMounts"][0]["mountPath"] + "/")
    assert names.etcd_endpoints(spec) == [f"https://{m}.resilient-etcd:2379" for m in members]
    plain = render(spec_of(ALL["pytorchjob-etcd"]))[1]
    (plain_etcd,) = plain["spec"]["template"]["spec"]["containers"]
    assert "--client-cert-auth" not in plain_etcd["command"]
    assert "--listen-client-urls=http://0.0.0.0:2379" in plain_etcd["command"]


def test_objects_come_in_apply_order_and_are_written_one_per_file(tmp_path):
    kinds = {name: [o["kind"] for o in render(spec_of(argv))] for name, argv in ALL.items()}
    assert kinds["jobset-gpu"] == ["JobSet", "Service", "ServiceMonitor", "PrometheusRule", "ConfigMap"]
    assert kinds["jobset-etcd-standby"] == ["Service", "StatefulSet", "PodDisruptionBudget",
                                            "JobSet"]
    assert kinds["trainjob"] == ["ClusterTrainingRuntime", "TrainJob", "Service",
                                 "ServiceMonitor", "PrometheusRule", "ConfigMap"]
    assert kinds["pytorchjob-etcd"] == ["Service", "StatefulSet", "PodDisruptionBudget",
                                        "PyTorchJob", "Service",
                                        "ServiceMonitor", "PrometheusRule", "ConfigMap"]
    objs = render(spec_of(ALL["trainjob"]))
    paths = write_dir(objs, tmp_path / "out")
    assert [p.name for p in paths] == [
        "00-clustertrainingruntime-tj-runtime.yaml", "01-trainjob-tj.yaml",
        "02-service-tj-metrics.yaml", "03-servicemonitor-tj-metrics.yaml",
        "04-prometheusrule-tj-rules.yaml", "05-configmap-tj-grafana-dashboard.yaml"]
    assert [yaml.safe_load(p.read_text()) for p in paths] == objs
    assert write_dir(objs, tmp_path / "out") == paths  # the same files again: fine


def test_strings_that_any_yaml_reader_takes_for_numbers_or_booleans_are_quoted():
    # kubectl reads YAML with go-yaml, which takes 3e-4 and 0o17 for numbers and y, n for
    # booleans where PyYAML writes them unquoted: a number in `args` fails the apply.
    risky = ["3e-4", "1E3", "0o17", "0x1f", "1_000", ".5", "+1", "-2", "y", "N", "on", "off",
             "~", "null", "True", ".inf", "1.5"]
    text = to_yaml([{"args": risky}])
    assert text == "args:\n" + "".join(f"- '{r}'\n" for r in risky)
    plain = ["--nnodes", "16Gi", "train.py", "$(POD_IP)", "^lo,docker", "2:4", "0.0.0.0"]
    assert yaml.safe_load(to_yaml([{"args": plain}]))["args"] == plain
    assert "- --nnodes\n" in to_yaml([{"args": plain}])


def test_names_fit_the_63_character_labels_jobset_derives():
    spec = K8sSpec(name="a" * 40, image="i", script="s.py", nodes_min=9999, nodes_max=9999,
                   standby_nodes=99)
    longest = f"{spec.name}-standby-0-{spec.standby_nodes - 1}-abcde"  # as JobSet's webhook checks
    assert len(longest) <= 63
    assert len(f"{spec.name}-node-0-{spec.nodes_max - 1}-abcde") <= 63
    assert len(names.etcd_member(spec, 4)) <= 52  # a StatefulSet's pods get a revision label


# ------------------------------------------------------------------ goldens


def golden_text(objs: list[dict]) -> str:
    """The rendering as the golden files hold it: the dashboard's JSON (checked on its own
    above, and edited on its own schedule) stands as a placeholder."""
    objs = json.loads(json.dumps(objs))
    for obj in objs:
        if obj["kind"] == "ConfigMap" and "unbroken.json" in obj.get("data", {}):
            obj["data"]["unbroken.json"] = f"<{observability.DASHBOARD_FILE} of the package>"
    return to_yaml(objs)


@pytest.mark.parametrize("name", sorted(INVOCATIONS))
def test_the_rendering_matches_its_golden_file(name):
    path = GOLDEN / f"{name}.yaml"
    text = (f"# unbroken k8s {' '.join(INVOCATIONS[name])}\n"
            + golden_text(render(spec_of(INVOCATIONS[name]))))
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    expected = path.read_text() if path.exists() else ""
    assert text == expected, (
        f"{path.relative_to(ROOT)} differs from the rendering: if the change is meant, "
        "rewrite the goldens with  UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_k8s_manifests.py "
        "and review their diff")


# ------------------------------------------------------------------ a platform team's checks
# The Pod Security Standards' "restricted" profile, check by check, as the admission
# controller applies it (kubernetes.io/docs/concepts/security/pod-security-standards/,
# v1.31): evaluated here on every pod spec rendered.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What keeps `pod` (a pod spec) out of the restricted profile; [] when it meets it."""
    out = []
    psc = pod.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(key)
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runs as root")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
    return out


def every_pod_spec(objs: list[dict]) -> list[dict]:
    out = [t["spec"] for t in pod_templates(objs)]
    out += [sts["spec"]["template"]["spec"] for sts in of_kind(objs, "StatefulSet")]
    return out


def test_every_pod_meets_the_restricted_profile_or_targets_baseline_and_says_why(case):
    name, spec, objs = case
    for pod_spec in every_pod_spec(objs):
        violations = restricted_violations(pod_spec)
        if spec.checkpoint_host_path and pod_spec in [t["spec"] for t in pod_templates(objs)]:
            assert violations == ["volume checkpoints: ['hostPath']"], (name, violations)
            assert spec.pod_security == "baseline"
            assert any("spec.volumes[].hostPath" in w and "baseline" in w
                       for w in spec.warnings())
        else:
            assert violations == [], (name, violations)


def test_the_restricted_check_finds_what_it_looks_for():
    one = every_pod_spec(render(spec_of(ALL["jobset-one-node"])))[0]
    assert restricted_violations(one) == []
    bad = {**one, "hostNetwork": True,
           "securityContext": {**one["securityContext"], "runAsNonRoot": False},
           "containers": [{**one["containers"][0], "securityContext": {}}]}
    assert restricted_violations(bad) == [
        "hostNetwork", "node: allowPrivilegeEscalation is not false",
        "node: capabilities do not drop ALL", "node: runAsNonRoot is not true"]


def test_every_container_is_guaranteed_requests_equal_limits(case):
    name, _, objs = case
    for c in containers(objs):
        res = c["resources"]
        assert res["requests"] == res["limits"], (name, c["name"])
        assert {"cpu", "memory"} <= set(res["limits"]), (name, c["name"])


def test_the_platform_teams_job_renders_as_asked():
    spec = spec_of(ALL["llm"])
    objs = render(spec)
    (template,) = pod_templates(objs)
    ps = template["spec"]
    assert ps["serviceAccountName"] == "trainer"
    assert ps["securityContext"]["fsGroup"] == 1000
    assert ps["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert template["metadata"]["annotations"] == {"karpenter.sh/do-not-disrupt": "true"}
    env = {v["name"]: v.get("value") for v in ps["containers"][0]["env"]}
    assert env["HOME"] == "/var/run/unbroken/home"
    assert {"HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} <= set(env)
    assert "/var/run/unbroken/home" in {m["mountPath"] for m in ps["containers"][0]["volumeMounts"]}
    args = ps["containers"][0]["args"]
    assert args[args.index("--metrics-port") + 1] == "9478"
    (pdb,) = of_kind(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "etcd"
    (etcd,) = of_kind(objs, "StatefulSet")
    member = etcd["spec"]["template"]["spec"]["containers"][0]
    assert member["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in member["command"]
    assert "podAntiAffinity" in etcd["spec"]["template"]["spec"]["affinity"]
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget"
                and o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] != "etcd"]
    for obj in [pdb, *of_kind(objs, "ServiceAccount")]:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_irsa_pull_secrets_priority_run_args_and_env_reach_the_pods():
    spec = spec_of(ALL["llm-platform"])
    objs = render(spec)
    (account,) = of_kind(objs, "ServiceAccount")
    assert account["metadata"]["name"] == "trainer"
    assert account["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/llm-s3"}
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(account, version, strict=True)
    (template,) = pod_templates(objs)
    ps = template["spec"]
    assert ps["imagePullSecrets"] == [{"name": "ecr"}]
    assert ps["priorityClassName"] == "training-high"
    c = ps["containers"][0]
    assert c["args"][c["args"].index("--continue-dead-job") - 1] == "--hang-timeout=600"
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} == c["env"][-1]
    # 16Gi + 8 processes (7 workers and a spare) x (6Gi + 3 x 20Gi) + 1Gi
    assert c["resources"]["limits"]["memory"] == "545Gi"


@pytest.mark.parametrize("argv, said", [
    (["--gpus", "8", "--nproc-per-node", "8", "--spares", "1"],
     "--nproc-per-node 8 and --spares 1 need 9 GPUs, the pod has --gpus 8"),
    (["--gpus", "4", "--nproc-per-node", "8"],
     "--nproc-per-node 8 with --gpus 4: each worker needs a GPU of its own"),
    (["--metrics", "--metrics-port", "9400"], "--metrics-port 9400 is dcgm-exporter's port"),
    (["--irsa-role-arn", "arn:aws:iam::123456789012:role/x"],
     "--irsa-role-arn needs --service-account"),
    (["--service-account", "t", "--irsa-role-arn", "role/x"], "is not an IAM role ARN"),
    (["--run-arg=--max-restarts=many"], "--run-arg --max-restarts=many: unbroken run says:"),
    (["--env", "NO_VALUE"], "--env takes KEY=VALUE"),
    (["--memory", "lots"], "--memory 'lots' must be a positive quantity"),
    (["--cpu", "0"], "--cpu '0' must be a positive number of cores"),
    (["--run-as-user", "0"], "--run-as-user 0: a non-root user id"),
])
def test_a_layout_or_setting_that_cannot_run_is_refused_in_one_line_with_exit_2(argv, said,
                                                                                 capsys):
    from unbroken.cli import main

    code = main(["k8s", "--name", "x", "--image", "img", *argv, "/app/train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], err
