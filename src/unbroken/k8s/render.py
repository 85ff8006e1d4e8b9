"""A `K8sSpec` into Kubernetes objects, in apply order, and those objects into YAML: one
stream for stdout, or one file per object in a directory.

Apply order: the etcd Service and StatefulSet (control plane `etcd`), the
ClusterTrainingRuntime before its TrainJob, the workload, then the metrics objects. No
Secret is ever rendered: the job's secret is made by `pod.secret_command`.
"""

from __future__ import annotations

import re
from pathlib import Path

from unbroken.errors import UserError
from unbroken.k8s import etcd, jobset, observability, pod, pytorchjob, trainer
from unbroken.k8s.spec import ControlPlane, K8sSpec, Workload
from unbroken.k8s.yaml_io import pyyaml

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")

# Strings that some YAML reader takes for a number, a boolean or null, though PyYAML (YAML
# 1.1) writes them unquoted: kubectl's reader (go-yaml) reads `3e-4` and `0o17` as numbers
# and `y`, `n` as booleans, and a number in `args` fails the apply. Such strings are quoted.
NOT_A_STRING = re.compile(r"[-+]?(\.[0-9][0-9_]*|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?"
                          r"|0[xXoObB][0-9a-fA-F_]+|[-+]?\.(inf|nan)"
                          r"|y|n|yes|no|on|off|true|false|null|~", re.IGNORECASE)


def render(spec: K8sSpec) -> list[dict]:
    """Every object the job needs, in the order `kubectl apply` should create them."""
    objs: list[dict] = []
    if spec.irsa_role_arn:
        objs.append(pod.service_account(spec))
    if spec.control_plane == ControlPlane.ETCD:
        objs += [etcd.service(spec), etcd.statefulset(spec), etcd.disruption_budget(spec)]
    if spec.workload == Workload.JOBSET:
        objs.append(jobset.jobset(spec))
    elif spec.workload == Workload.TRAINJOB:
        objs += [trainer.cluster_training_runtime(spec), trainer.train_job(spec)]
    else:
        objs.append(pytorchjob.pytorchjob(spec))
    return objs + observability.objects(spec)


def to_yaml(objs: list[dict]) -> str:
    """One YAML stream, `---` between objects, keys in the order rendered (apiVersion, kind,
    metadata, spec); multi-line strings (the dashboard) as literal blocks, strings that look
    like numbers or booleans to any YAML reader quoted; no aliases."""
    yaml = pyyaml()

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, data: str) -> object:
        style = "|" if "\n" in data else "'" if NOT_A_STRING.fullmatch(data) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(objs, Dumper=Dumper, sort_keys=False, default_flow_style=False,
                         width=10_000, allow_unicode=True)


def file_name(index: int, obj: dict) -> str:
    """`NN-<kind>-<name>.yaml`: NN keeps the apply order in `kubectl apply -f DIR`."""
    return f"{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_dir(objs: list[dict], directory: str | Path) -> list[Path]:
    """One file per object in `directory` (made if missing). A directory that already
    holds other manifests is refused: `kubectl apply -f` would apply them too."""
    directory = Path(directory)
    wanted = [directory / file_name(i, obj) for i, obj in enumerate(objs)]
    if directory.exists() and not directory.is_dir():
        raise UserError(f"-o {directory} is a file, not a directory")
    stale = sorted(p.name for p in directory.glob("*")
                   if p.suffix in MANIFEST_SUFFIXES and p not in wanted) if directory.exists() else []
    if stale:
        raise UserError(f"-o {directory} already holds other manifests ({', '.join(stale[:3])}"
                        f"{', ...' if len(stale) > 3 else ''}) that `kubectl apply -f` would "
                        "apply too: use an empty or new directory")
    directory.mkdir(parents=True, exist_ok=True)
    for path, obj in zip(wanted, objs, strict=True):
        path.write_text(to_yaml([obj]))
    return wanted
