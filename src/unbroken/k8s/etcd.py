"""The job's own etcd cluster (control plane `etcd`): a headless Service, a StatefulSet
`<name>-etcd` and its PodDisruptionBudget; members find each other, and the agents find them, by their stable
names `<name>-etcd-<i>.<name>-etcd`.

Every flag used is accepted by etcd 3.4 (Debian's etcd-server) and 3.5 (the image). The
members start together (podManagementPolicy Parallel: a member waits for a quorum of its
peers, so an ordered start would never finish) and keep their data on a 1Gi volume of
their own, deleted with the StatefulSet. With `etcd_tls_secret`, clients and peers speak
https with client-certificate authentication, from a Secret holding ca.crt, tls.crt and
tls.key whose certificate names `*.<name>-etcd` (and `*.<name>-etcd.<namespace>.svc`).
Without it, etcd is plain http inside the namespace: the agents sign their messages with
the job's secret all the same.
"""

from __future__ import annotations

from unbroken.k8s import names
from unbroken.k8s.spec import K8sSpec

IMAGE = "quay.io/coreos/etcd:v3.5.17"
METRICS_PORT = 2381
"""Plain http, for the probes (`/health`) and Prometheus: the client port may demand a
client certificate, which the kubelet's probes cannot present."""
USER = 65532  # the image's distroless `nonroot`
RESOURCES = {"cpu": "500m", "memory": "512Mi"}
"""Each member's, requests = limits: an idle job's keys fit in tens of MiB."""
DATA_MOUNT = "/var/lib/etcd"
DATA_SIZE = "1Gi"
TLS_DIR = "/etc/etcd/tls"
COMPONENT = "etcd"


def _selector(spec: K8sSpec) -> dict[str, str]:
    return names.labels(spec, COMPONENT)


def service(spec: K8sSpec) -> dict:
    """The headless Service that gives each member its DNS name, ready or not (a member is
    not ready before a quorum forms, and cannot form one without its peers' names)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": names.meta(spec, names.etcd_service(spec), COMPONENT),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": _selector(spec),
                     "ports": [{"name": "client", "port": names.ETCD_CLIENT_PORT,
                                "targetPort": "client", "protocol": "TCP"},
                               {"name": "peer", "port": names.ETCD_PEER_PORT,
                                "targetPort": "peer", "protocol": "TCP"}]}}


def command(spec: K8sSpec) -> list[str]:
    """The member's command line; $(POD_NAME) is its own name, `<name>-etcd-<i>`."""
    scheme, svc = names.etcd_scheme(spec), names.etcd_service(spec)
    cluster = ",".join(f"{names.etcd_member(spec, i)}={scheme}://{names.etcd_host(spec, i)}:"
                       f"{names.ETCD_PEER_PORT}" for i in range(spec.etcd_replicas))
    out = ["etcd", "--name=$(POD_NAME)", f"--data-dir={DATA_MOUNT}/data",
           f"--listen-client-urls={scheme}://0.0.0.0:{names.ETCD_CLIENT_PORT}",
           f"--advertise-client-urls={scheme}://$(POD_NAME).{svc}:{names.ETCD_CLIENT_PORT}",
           f"--listen-peer-urls={scheme}://0.0.0.0:{names.ETCD_PEER_PORT}",
           f"--initial-advertise-peer-urls={scheme}://$(POD_NAME).{svc}:{names.ETCD_PEER_PORT}",
           f"--initial-cluster={cluster}", "--initial-cluster-state=new",
           f"--initial-cluster-token={svc}",
           # the agents' keys churn for as long as the job trains: keep one hour of history
           "--auto-compaction-retention=1",
           f"--listen-metrics-urls=http://0.0.0.0:{METRICS_PORT}"]
    if spec.etcd_tls_secret:
        out += ["--client-cert-auth", f"--trusted-ca-file={TLS_DIR}/ca.crt",
                f"--cert-file={TLS_DIR}/tls.crt", f"--key-file={TLS_DIR}/tls.key",
                "--peer-client-cert-auth", f"--peer-trusted-ca-file={TLS_DIR}/ca.crt",
                f"--peer-cert-file={TLS_DIR}/tls.crt", f"--peer-key-file={TLS_DIR}/tls.key"]
    return out


def statefulset(spec: K8sSpec) -> dict:
    """The members: `etcd_replicas` pods, spread over nodes where the cluster allows."""
    container: dict = {
        "name": "etcd", "image": IMAGE, "command": command(spec),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "client", "containerPort": names.ETCD_CLIENT_PORT, "protocol": "TCP"},
                  {"name": "peer", "containerPort": names.ETCD_PEER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # Ready once the member is healthy (in a quorum); alive while its client port
        # answers: a member waiting for its peers' quorum at start is not restarted for it.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"},
                           "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": "client"}, "initialDelaySeconds": 10,
                          "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": dict(RESOURCES), "limits": dict(RESOURCES)},
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "data", "mountPath": DATA_MOUNT}]}
    pod_spec: dict = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER,
                            "fsGroup": USER, "fsGroupChangePolicy": "OnRootMismatch",
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {
                "labelSelector": {"matchLabels": _selector(spec)},
                "topologyKey": "kubernetes.io/hostname"}}]}},
        "containers": [container]}
    if spec.etcd_tls_secret:
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        pod_spec["volumes"] = [{"name": "tls", "secret": {"secretName": spec.etcd_tls_secret,
                                                          "defaultMode": 0o400}}]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": names.meta(spec, names.etcd_service(spec), COMPONENT),
            "spec": {
                "serviceName": names.etcd_service(spec), "replicas": spec.etcd_replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": _selector(spec)},
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete",
                                                         "whenScaled": "Retain"},
                "template": {"metadata": {"labels": _selector(spec)}, "spec": pod_spec},
                "volumeClaimTemplates": [{
                    "metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": DATA_SIZE}}}}]}}


def disruption_budget(spec: K8sSpec) -> dict:
    """At most one member evicted at a time (a drain, an upgrade): the quorum stays. The
    training pods get none: their agents hand their ranks over on SIGTERM."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": names.meta(spec, names.etcd_service(spec), COMPONENT),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(spec)}}}
