"""Metrics on Kubernetes: a Service over the job's pods' metrics port, a ServiceMonitor
(monitoring.coreos.com/v1: the Prometheus Operator's, as kube-prometheus-stack installs
it) that scrapes it, a PrometheusRule with unbroken's recording rules and alerts, and a
ConfigMap holding unbroken's Grafana dashboard, labelled `grafana_dashboard: "1"` for the
Grafana sidecar to load.

Every agent serves /metrics (its node's series), so every endpoint the ServiceMonitor
selects is up. The rules and the dashboard have one copy each, package data
(`unbroken/telemetry/prometheus/rules.yml`, `unbroken/telemetry/grafana/unbroken.json`), so
that an installed wheel renders them too.
"""

from __future__ import annotations

from importlib import resources

from unbroken.k8s import names, pod
from unbroken.k8s.spec import K8sSpec
from unbroken.k8s.yaml_io import pyyaml

SERVICE_MONITOR_API = "monitoring.coreos.com/v1"
DASHBOARD_PACKAGE = "unbroken.telemetry"
DASHBOARD_FILE = "grafana/unbroken.json"
RULES_FILE = "prometheus/rules.yml"
DASHBOARD_LABEL = {"grafana_dashboard": "1"}  # kube-prometheus-stack's sidecar default
SCRAPE_INTERVAL = "15s"


def dashboard_json() -> str:
    """The Grafana dashboard, as shipped in the package."""
    return resources.files(DASHBOARD_PACKAGE).joinpath(DASHBOARD_FILE).read_text(encoding="utf-8")


def metrics_service(spec: K8sSpec) -> dict:
    """A headless Service `<name>-metrics` over the job's pods, port `metrics`."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": names.meta(spec, names.metrics_service(spec), "metrics"),
            "spec": {"clusterIP": "None", "selector": names.pod_selector(spec),
                     "ports": [{"name": pod.METRICS_PORT_NAME, "port": spec.metrics_port,
                                "targetPort": pod.METRICS_PORT_NAME, "protocol": "TCP"}]}}


def service_monitor(spec: K8sSpec) -> dict:
    """The ServiceMonitor that selects that Service by its labels and scrapes its `metrics`
    port. A Prometheus picks it up if its serviceMonitorSelector matches these labels
    (kube-prometheus-stack's default wants its release label: set
    serviceMonitorSelectorNilUsesHelmValues=false, or add the label)."""
    service = metrics_service(spec)
    return {"apiVersion": SERVICE_MONITOR_API, "kind": "ServiceMonitor",
            "metadata": names.meta(spec, names.metrics_service(spec), "metrics"),
            "spec": {"selector": {"matchLabels": dict(service["metadata"]["labels"])},
                     "namespaceSelector": {"matchNames": [spec.namespace]},
                     "endpoints": [{"port": pod.METRICS_PORT_NAME, "path": "/metrics",
                                    "interval": SCRAPE_INTERVAL}]}}


def prometheus_rule(spec: K8sSpec) -> dict:
    """The PrometheusRule `<name>-rules`: rules.yml's groups, as they are. A Prometheus loads
    it if its ruleSelector matches these labels (kube-prometheus-stack's default wants its
    release label, as for the ServiceMonitor)."""
    text = resources.files(DASHBOARD_PACKAGE).joinpath(RULES_FILE).read_text(encoding="utf-8")
    return {"apiVersion": SERVICE_MONITOR_API, "kind": "PrometheusRule",
            "metadata": names.meta(spec, names.prometheus_rule(spec), "metrics"),
            "spec": {"groups": pyyaml().safe_load(text)["groups"]}}


def dashboard_configmap(spec: K8sSpec) -> dict:
    """The ConfigMap `<name>-grafana-dashboard` holding unbroken.json."""
    metadata = names.meta(spec, names.dashboard_configmap(spec), "dashboard")
    metadata["labels"].update(DASHBOARD_LABEL)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
            "data": {"unbroken.json": dashboard_json()}}


def objects(spec: K8sSpec) -> list[dict]:
    """The metrics objects, in apply order; none without `spec.metrics`."""
    if not spec.metrics:
        return []
    return [metrics_service(spec), service_monitor(spec), prometheus_rule(spec),
            dashboard_configmap(spec)]
