"""Pods on one machine, run from generated manifests the way a kubelet, the Job controller,
the JobSet controller and the StatefulSet controller would run them; for end-to-end tests
and `benchmarks/pods.py`. There is no Kubernetes cluster here; this is the closest this
machine allows (docs/kubernetes.md, "What was shown here").

What each pod gets (`Cluster.start_pod`):
- a network namespace of its own on one bridge, with an address that is new each time a pod
  is created: a recreated pod comes back with another IP;
- its own mount namespace: the cluster's whole root dir is covered with an empty read-only
  tmpfs, and only this pod's volumes are bound back, at their mountPaths: its emptyDirs
  (fresh, so a recreated pod has an empty disk), its Secrets as files (mode 0400), and the
  volumes that outlive pods (a PVC or hostPath: the checkpoint volume; a StatefulSet's
  volumeClaimTemplates, per pod name);
- a UTS namespace with the pod's hostname, and an /etc/hosts of its own
  (/etc/netns/<ns>/hosts) with its own name and the headless services' names of every live
  pod (`<hostname>.<subdomain>` and the `.svc.cluster.local` form), rewritten in place when a
  pod comes or goes, so that peers re-resolve a recreated pod's name;
- the environment its controllers set: the container's `env` with the downward API
  (`fieldRef`: metadata.name, namespace, uid, labels['...'], annotations['...'],
  status.podIP, spec.nodeName), `JOB_COMPLETION_INDEX` from the Job controller, `HOSTNAME`;
  `$(VAR)` in env values, command and args expanded as Kubernetes does (`$$` escapes);
- JobSet's labels and annotations (jobset-name, jobset-uid, replicatedjob-name, job-index,
  restart-attempt) and the Job's completion-index label and annotation.

Deletions: `delete` is a pod deletion (SIGTERM to the container's first process, then
SIGKILL to every process of the pod after terminationGracePeriodSeconds); `delete(force=True)`
is a force deletion or a node loss (SIGKILL to every process at once; the pod gets the
`DisruptionTarget` condition, as the taint manager or the pod GC would set it).

The controllers interpret the manifest's own rules, nothing hard-coded: a Job's
`podFailurePolicy` (first matching rule: onExitCodes In/NotIn, onPodConditions; FailJob,
FailIndex, Ignore, Count), `backoffLimit`, `completions`; a JobSet's `failurePolicy`
(maxRestarts, rules by onJobFailureReasons and targetReplicatedJobs) and `successPolicy`
(All or Any of targetReplicatedJobs); a Job's own `successPolicy` (succeededIndexes,
succeededCount), after which its other pods are ended. A failed pod that is to be replaced is recreated
`scheduling_delay` seconds after it ended (what a scheduler and a kubelet take).

What is not emulated: the scheduler and node placement, image pulls (the "image" is this
checkout's venv), the CNI (one bridge), a DNS server (hosts files), the API server, probes,
resource limits.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netns import ISOLATE, _claim_bridge, _ip, unavailable  # noqa: F401 - unavailable: for callers

VENV_BIN = Path(sys.executable).parent
CLUSTER_DOMAIN = "svc.cluster.local"
JOBSET = "jobset.sigs.k8s.io/"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined VAR is replaced, an undefined one is left as
    it is, and `$$` is a literal `$`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


def exit_code(returncode: int) -> int:
    """A container's exit code as the kubelet reports it (a signal: 128 + its number)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Pod:
    """One incarnation of a pod: its name, address, process and end."""

    name: str
    hostname: str
    subdomain: str | None
    namespace: str
    uid: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ip: str
    netns: str
    dir: Path
    grace: float
    container: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deleted: float | None = None  # when a deletion was asked for
    ended: float | None = None
    code: int | None = None  # the container's exit code
    conditions: set[str] = field(default_factory=set)
    output: Path | None = None

    @property
    def fqdn(self) -> str | None:
        if not self.subdomain:
            return None
        return f"{self.hostname}.{self.subdomain}.{self.namespace}.{CLUSTER_DOMAIN}"

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output and self.output.exists() else ""


class Cluster:
    """The pods' network, names and disks; a context manager. `volumes` maps a PVC's
    claimName or a hostPath's path to the one shared dir standing in for it; `secrets`
    maps a Secret's name to its data (key -> text)."""

    def __init__(self, root: Path, namespace: str = "default",
                 volumes: dict[str, Path] | None = None,
                 secrets: dict[str, dict[str, str]] | None = None) -> None:
        self.root = Path(root).resolve()
        self.namespace = namespace
        self.volumes = dict(volumes or {})
        self.secrets = dict(secrets or {})
        self.pods: list[Pod] = []  # every incarnation, in creation order
        self._n: int | None = None
        self._hosts = itertools.count(10)
        self._lock = threading.RLock()

    # ------------------------------------------------------------ network
    def _subnet(self, last: int) -> str:
        return f"10.{self._n >> 8}.{self._n & 0xFF}.{last}"

    @property
    def bridge(self) -> str:
        return f"ubr{self._n:04x}"

    def __enter__(self) -> Cluster:
        self._n = _claim_bridge()
        try:
            _ip("link", "set", self.bridge, "up")
            _ip("addr", "add", f"{self._subnet(1)}/24", "dev", self.bridge)
            (self.root / "pods").mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            live = [p for p in self.pods if p.ended is None]
        for pod in live:
            self._kill(pod)
        for pod in self.pods:
            self._remove_netns(pod)
        _ip("link", "del", self.bridge, check=False)
        with suppress(OSError):
            os.rmdir("/etc/netns")

    def _hosts_file(self, pod: Pod) -> Path:
        return Path("/etc/netns", pod.netns, "hosts")

    def _records(self) -> list[str]:
        lines = []
        for pod in self.pods:
            if pod.ended is None and pod.subdomain:
                lines.append(f"{pod.ip} {pod.fqdn} {pod.hostname}.{pod.subdomain}")
        return lines

    def _write_hosts(self) -> None:
        """Every live pod's /etc/hosts, rewritten in place (the same inode, which `ip netns
        exec` bound over its processes' /etc/hosts): they resolve the change at once."""
        records = self._records()
        for pod in self.pods:
            if pod.ended is not None:
                continue
            names = [pod.fqdn, f"{pod.hostname}.{pod.subdomain}"] if pod.subdomain else []
            own = " ".join([pod.ip, *names, pod.hostname])
            text = "\n".join(["127.0.0.1 localhost", "::1 localhost ip6-localhost", own,
                              *[r for r in records if not r.startswith(f"{pod.ip} ")]]) + "\n"
            path = self._hosts_file(pod)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a+") as f:
                f.seek(0)
                f.truncate()
                f.write(text)

    def _add_netns(self, pod: Pod) -> None:
        k = int(pod.ip.rsplit(".", 1)[1])
        veth = f"ub{self._n:04x}p{k}"
        _ip("netns", "add", pod.netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", pod.netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", "eth0")
        _ip("-n", pod.netns, "link", "set", "eth0", "up")
        _ip("-n", pod.netns, "link", "set", "lo", "up")

    def _remove_netns(self, pod: Pod) -> None:
        k = int(pod.ip.rsplit(".", 1)[1])
        _ip("link", "del", f"ub{self._n:04x}p{k}", check=False)
        _ip("netns", "del", pod.netns, check=False)
        shutil.rmtree(self._hosts_file(pod).parent, ignore_errors=True)

    # ------------------------------------------------------------ pods
    def start_pod(self, name: str, template: dict[str, Any], *, hostname: str | None = None,
                  subdomain: str | None = None, labels: dict[str, str] | None = None,
                  annotations: dict[str, str] | None = None, injected: dict[str, str] | None = None,
                  claims: dict[str, Path] | None = None) -> Pod:
        """Create and start a pod from a pod template (its `metadata` and `spec`) with one
        container. `injected`: what a controller adds to the container's env
        (JOB_COMPLETION_INDEX); `claims`: a StatefulSet's claim dirs, by volume name."""
        spec = template["spec"]
        meta = template.get("metadata") or {}
        (container,) = spec["containers"]
        with self._lock:
            last = next(self._hosts)
            if last > 250:
                raise RuntimeError("the emulated cluster ran out of pod addresses")
            pod = Pod(
                name=name, hostname=spec.get("hostname") or hostname or name,
                subdomain=spec.get("subdomain") or subdomain, namespace=self.namespace,
                uid=str(uuid.uuid4()), labels={**meta.get("labels", {}), **(labels or {})},
                annotations={**meta.get("annotations", {}), **(annotations or {})},
                ip=self._subnet(last), netns=f"ub{self._n:04x}-p{last}",
                dir=self.root / "pods" / f"{name}-{last}",
                grace=float(spec.get("terminationGracePeriodSeconds", 30)),
                container=container["name"])
            pod.dir.mkdir(parents=True)
            self._add_netns(pod)
            self.pods.append(pod)
            self._write_hosts()
        pod.env = self._env(pod, container, injected or {})
        binds = self._binds(pod, spec, container, claims or {})
        argv = [expand(a, pod.env) for a in [*container.get("command", []),
                                             *container.get("args", [])]]
        argv[0] = shutil.which(argv[0], path=pod.env["PATH"]) or argv[0]
        cwd = container.get("workingDir", "/")
        pod.output = pod.dir / "container.log"
        with open(pod.output, "wb") as out:
            pod.proc = subprocess.Popen(
                ["ip", "netns", "exec", pod.netns, sys.executable, "-I", "-c", ISOLATE,
                 pod.hostname, str(self.root), cwd, *binds, "--", *argv],
                stdout=out, stderr=subprocess.STDOUT, env=pod.env, start_new_session=True)
        pod.started = time.monotonic()
        return pod

    def _env(self, pod: Pod, container: dict, injected: dict[str, str]) -> dict[str, str]:
        env = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": os.environ.get("HOME", "/root"), "HOSTNAME": pod.hostname,
               "LANG": "C.UTF-8", **injected}
        fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
                  "metadata.uid": pod.uid, "status.podIP": pod.ip, "spec.nodeName": "emulated",
                  "status.hostIP": self._subnet(1)}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(str(var["value"]), env)
                continue
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if found:
                source = pod.labels if found[1] == "labels" else pod.annotations
                env[var["name"]] = source.get(found[2], "")
            elif path in fields:
                env[var["name"]] = fields[path]
            else:
                raise ValueError(f"the emulation has no downward API field {path!r}")
        return env

    def _binds(self, pod: Pod, spec: dict, container: dict, claims: dict[str, Path]) -> list[str]:
        sources: dict[str, Path] = {}
        for volume in spec.get("volumes", []):
            name = volume["name"]
            if "emptyDir" in volume:
                sources[name] = pod.dir / "volumes" / name
                sources[name].mkdir(parents=True)
            elif "secret" in volume:
                data = self.secrets.get(volume["secret"]["secretName"])
                if data is None:
                    raise ValueError(f"no Secret {volume['secret']['secretName']!r} in the "
                                     "emulated cluster (a real pod would not start)")
                sources[name] = pod.dir / "secrets" / name
                sources[name].mkdir(parents=True)
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    path = sources[name] / item["path"]
                    path.write_text(data[item["key"]])
                    path.chmod(0o400)
            elif "persistentVolumeClaim" in volume:
                sources[name] = self.volumes[volume["persistentVolumeClaim"]["claimName"]]
            elif "hostPath" in volume:
                sources[name] = self.volumes[volume["hostPath"]["path"]]
        sources.update(claims)
        binds = []
        for mount in container.get("volumeMounts", []):
            source = sources[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            binds.append(f"{source}={mount['mountPath']}{':ro' if mount.get('readOnly') else ''}")
        return binds

    # ------------------------------------------------------------ ends
    def poll(self, pod: Pod) -> bool:
        """Has the pod ended? (its container's first process exited, and with it, as the
        kubelet does, every other process of the pod is killed)."""
        if pod.ended is not None:
            return True
        if pod.proc is None or pod.proc.poll() is None:
            if pod.deleted is not None and time.monotonic() - pod.deleted > pod.grace:
                self._kill(pod)  # the grace period is over
            return False
        self._end(pod, exit_code(pod.proc.returncode))
        return True

    def _end(self, pod: Pod, code: int) -> None:
        """The pod is gone: its processes, its address (peers' connects now fail as to a
        vanished pod's), and its names in every other pod's hosts file."""
        self._kill_netns(pod)
        with self._lock:
            if pod.ended is None:
                pod.code, pod.ended = code, time.monotonic()
                self._remove_netns(pod)
                self._write_hosts()

    def _kill_netns(self, pod: Pod) -> None:
        for _ in range(50):
            pids = _ip("netns", "pids", pod.netns, check=False).stdout.split()
            if not pids:
                return
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)

    def _kill(self, pod: Pod) -> None:
        self._kill_netns(pod)
        if pod.proc is not None:
            with suppress(subprocess.TimeoutExpired):
                pod.proc.wait(timeout=10)
            if pod.ended is None:
                self._end(pod, exit_code(pod.proc.returncode if pod.proc.returncode is not None
                                         else -signal.SIGKILL))

    def delete(self, pod: Pod, force: bool = False) -> None:
        """A pod deletion: SIGTERM to the container's first process, SIGKILL to the rest
        after the grace period (`poll` enforces it). `force`: a force deletion or a node
        loss: every process killed at once, and the DisruptionTarget condition."""
        if pod.ended is not None:
            return
        if force:
            pod.conditions.add("DisruptionTarget")
            pod.deleted = time.monotonic()
            self._kill(pod)
            return
        pod.deleted = time.monotonic()
        with suppress(ProcessLookupError):
            os.kill(pod.proc.pid, signal.SIGTERM)


# ---------------------------------------------------------------- controllers
def failure_action(rules: list[dict], container: str, code: int, conditions: set[str]) -> str:
    """The action of a Job's podFailurePolicy for a pod that failed (pure): the first rule
    that matches, else Count (Kubernetes' own default)."""
    for rule in rules:
        by_code = rule.get("onExitCodes")
        if by_code is not None:
            if by_code.get("containerName") not in (None, container):
                continue
            inside = code in by_code["values"]
            if inside == (by_code["operator"] == "In"):
                return rule["action"]
            continue
        for cond in rule.get("onPodConditions", []):
            if cond["type"] in conditions and cond.get("status", "True") == "True":
                return rule["action"]
    return "Count"


@dataclass
class _Job:
    rjob: str
    index: int  # the job's index within its replicated job
    spec: dict
    failed: int = 0
    succeeded: set[int] = field(default_factory=set)
    failed_indexes: set[int] = field(default_factory=set)
    pods: dict[int, Pod] = field(default_factory=dict)  # completion index -> live pod
    due: dict[int, float] = field(default_factory=dict)  # completion index -> when to create
    failure: str | None = None  # the Failed condition's reason

    @property
    def complete(self) -> bool:
        """The Job's success: its `successPolicy` met (a rule's succeededIndexes all
        succeeded, or succeededCount of them, or of any index), else every completion."""
        rules = (self.spec.get("successPolicy") or {}).get("rules")
        if not rules:
            return len(self.succeeded) >= int(self.spec.get("completions", 1))
        for rule in rules:
            indexes = _index_set(rule["succeededIndexes"]) if "succeededIndexes" in rule else None
            done = self.succeeded & indexes if indexes is not None else self.succeeded
            need = rule.get("succeededCount", len(indexes) if indexes is not None else 1)
            if len(done) >= need:
                return True
        return False


def _index_set(text: str) -> set[int]:
    """`1,3-5` as {1, 3, 4, 5} (a Job's index ranges)."""
    found: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


class JobSetRun:
    """A JobSet applied to the cluster: its Jobs, their pods, and the JobSet's end. A
    thread drives it (`start`); `delete_pod`, `restart` and `wait` are for the caller."""

    def __init__(self, cluster: Cluster, jobset: dict, scheduling_delay: float = 0.0,
                 uid: str | None = None, on_event: Callable[[str], None] | None = None) -> None:
        self.cluster = cluster
        self.jobset = jobset
        self.name = jobset["metadata"]["name"]
        self.uid = uid or str(uuid.uuid4())
        self.delay = scheduling_delay
        self.restarts = 0
        self.status: str | None = None  # Completed or Failed
        self.reason: str | None = None
        self.log: list[tuple[float, str]] = []
        self._say = on_event or (lambda line: None)
        self._jobs: list[_Job] = []
        self.created: list[Pod] = []  # every pod this JobSet made, in order
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"jobset-{self.name}")

    def event(self, what: str) -> None:
        self.log.append((time.monotonic(), what))
        self._say(f"[jobset {self.name}] {what}")

    # ------------------------------------------------------------ jobs and pods
    def _create_jobs(self) -> None:
        self._jobs = []
        now = time.monotonic()
        for rjob in self.jobset["spec"]["replicatedJobs"]:
            for k in range(int(rjob.get("replicas", 1))):
                job = _Job(rjob["name"], k, rjob["template"]["spec"])
                job.due = {i: now for i in range(int(job.spec.get("completions", 1)))}
                self._jobs.append(job)

    def _create_pod(self, job: _Job, index: int) -> None:
        spec = self.jobset["spec"]
        subdomain = (spec.get("network") or {}).get("subdomain") or self.name
        hostname = f"{self.name}-{job.rjob}-{job.index}-{index}"
        labels = {JOBSET + "jobset-name": self.name, JOBSET + "jobset-uid": self.uid,
                  JOBSET + "replicatedjob-name": job.rjob, JOBSET + "job-index": str(job.index),
                  JOBSET + "restart-attempt": str(self.restarts), COMPLETION_INDEX: str(index)}
        pod = self.cluster.start_pod(
            f"{hostname}-{uuid.uuid4().hex[:5]}", job.spec["template"], hostname=hostname,
            subdomain=subdomain, labels=labels, annotations=dict(labels),
            injected={"JOB_COMPLETION_INDEX": str(index)})
        job.pods[index] = pod
        self.created.append(pod)
        self.event(f"pod {pod.name} created ({pod.ip})")

    def pod(self, rjob: str, index: int, job_index: int = 0) -> Pod:
        """The live pod of a replicated job's completion index (waits for its creation)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with self._lock:
                for job in self._jobs:
                    if (job.rjob, job.index) == (rjob, job_index) and index in job.pods:
                        return job.pods[index]
            time.sleep(0.05)
        raise AssertionError(f"no pod of {rjob} index {index} within 120s")

    def incarnations(self, rjob: str, index: int) -> list[Pod]:
        """Every pod this JobSet created for a completion index, oldest first."""
        prefix = f"{self.name}-{rjob}-0-{index}-"
        return [p for p in self.created if p.name.startswith(prefix)]

    def delete_pod(self, pod: Pod, force: bool = False) -> None:
        self.event(f"pod {pod.name} {'force-' if force else ''}deleted")
        self.cluster.delete(pod, force)

    # ------------------------------------------------------------ the loop
    def start(self) -> JobSetRun:
        self.event(f"applied (uid {self.uid})")
        with self._lock:
            self._create_jobs()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                if self.status is None:
                    self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        for job in self._jobs:
            for index, pod in list(job.pods.items()):
                if self.cluster.poll(pod):
                    del job.pods[index]
                    self._pod_ended(job, index, pod)
            if job.complete:  # its success policy is met: no new pods, the rest ended
                job.due.clear()
                for pod in job.pods.values():
                    if pod.deleted is None:
                        self.event(f"pod {pod.name} ended: job {job.rjob} succeeded")
                        self.cluster.delete(pod)
            for index, when in list(job.due.items()):
                if job.failure is None and now >= when:
                    del job.due[index]
                    self._create_pod(job, index)
        failed = [j for j in self._jobs if j.failure is not None]
        if failed:
            self._jobset_failure(failed[0])
        elif self._succeeded():
            self._finish("Completed", "SuccessPolicy")

    def _pod_ended(self, job: _Job, index: int, pod: Pod) -> None:
        conditions = ",".join(sorted(pod.conditions)) or "-"
        if pod.code == 0:
            job.succeeded.add(index)
            self.event(f"pod {pod.name} succeeded")
            return
        rules = (job.spec.get("podFailurePolicy") or {}).get("rules", [])
        action = failure_action(rules, pod.container, pod.code, pod.conditions)
        self.event(f"pod {pod.name} failed: exit {pod.code}, conditions {conditions}: {action}")
        if action == "FailJob":
            job.failure = "PodFailurePolicy"
        elif action == "FailIndex":
            job.failed_indexes.add(index)
        elif action == "Ignore":
            job.due[index] = time.monotonic() + self.delay
        else:
            job.failed += 1
            if job.failed > int(job.spec.get("backoffLimit", 6)):
                job.failure = "BackoffLimitExceeded"
            else:
                job.due[index] = time.monotonic() + self.delay
        if job.failure is not None:
            self.event(f"job {job.rjob}-{job.index} failed: {job.failure}")

    def _succeeded(self) -> bool:
        policy = self.jobset["spec"].get("successPolicy") or {"operator": "All"}
        targets = policy.get("targetReplicatedJobs") or [r["name"] for r in
                                                         self.jobset["spec"]["replicatedJobs"]]
        jobs = [j for j in self._jobs if j.rjob in targets]
        done = [j.complete for j in jobs]
        return all(done) if policy.get("operator", "All") == "All" else any(done)

    def _jobset_failure(self, job: _Job) -> None:
        policy = self.jobset["spec"].get("failurePolicy") or {}
        action = "RestartJobSet"
        for rule in policy.get("rules", []):
            reasons = rule.get("onJobFailureReasons") or []
            targets = rule.get("targetReplicatedJobs") or []
            if (not reasons or job.failure in reasons) and (not targets or job.rjob in targets):
                action = rule["action"]
                break
        limit = int(policy.get("maxRestarts", 0))
        if action == "FailJobSet" or (action == "RestartJobSet" and self.restarts >= limit):
            self._finish("Failed", job.failure if action == "FailJobSet" else "ReachedMaxRestarts")
            return
        if action == "RestartJobSet":
            self.restarts += 1
        self.event(f"restart {self.restarts} ({action})")
        self._delete_all()
        self._create_jobs()

    def _delete_all(self) -> None:
        """Delete every live pod (SIGTERM, grace) and wait for them to end (bounded by
        their grace periods)."""
        live = [p for j in self._jobs for p in j.pods.values()]
        for pod in live:
            self.cluster.delete(pod)
        deadline = time.monotonic() + max([p.grace for p in live] + [0]) + 15
        while any(not self.cluster.poll(p) for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pod in live:
            self.cluster._kill(pod)

    def _finish(self, status: str, reason: str) -> None:
        self._delete_all()
        self.status, self.reason = status, reason
        self.event(f"{status} ({reason})")

    def restart(self) -> None:
        """A JobSet restart of this same instance (what its failurePolicy does): every pod
        deleted, then every Job created again, with the restart-attempt label one higher."""
        with self._lock:
            self.restarts += 1
            self.event(f"restart {self.restarts} (asked)")
            self._delete_all()
            self._create_jobs()

    def wait(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while self.status is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"JobSet {self.name} did not end within {timeout}s:\n"
                                     + "\n".join(w for _, w in self.log[-30:]))
            time.sleep(0.1)
        return self.status

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            if self.status is None:
                self._delete_all()


class StatefulSetRun:
    """A StatefulSet's pods: `<name>-<i>`, stable names in the headless service's subdomain,
    each with its claim dirs that outlive it; a pod that ends is created again (its
    restartPolicy is Always) after the scheduling delay."""

    def __init__(self, cluster: Cluster, sts: dict, scheduling_delay: float = 0.0) -> None:
        self.cluster = cluster
        self.sts = sts
        self.name = sts["metadata"]["name"]
        self.delay = scheduling_delay
        self.pods: dict[int, Pod] = {}
        self._due: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"sts-{self.name}")

    def start(self) -> StatefulSetRun:
        self._due = {i: 0.0 for i in range(int(self.sts["spec"]["replicas"]))}
        self._thread.start()
        return self

    def _create(self, i: int) -> None:
        name = f"{self.name}-{i}"
        claims = {}
        for tmpl in self.sts["spec"].get("volumeClaimTemplates", []):
            claims[tmpl["metadata"]["name"]] = self.cluster.root / "claims" / f"{tmpl['metadata']['name']}-{name}"
            claims[tmpl["metadata"]["name"]].mkdir(parents=True, exist_ok=True)
        self.pods[i] = self.cluster.start_pod(
            name, self.sts["spec"]["template"], hostname=name,
            subdomain=self.sts["spec"]["serviceName"],
            labels={"apps.kubernetes.io/pod-index": str(i),
                    "statefulset.kubernetes.io/pod-name": name}, claims=claims)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for i, pod in list(self.pods.items()):
                if self.cluster.poll(pod):
                    del self.pods[i]
                    self._due[i] = now + self.delay
            for i, when in list(self._due.items()):
                if now >= when:
                    del self._due[i]
                    self._create(i)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for pod in list(self.pods.values()):
            self.cluster._kill(pod)
