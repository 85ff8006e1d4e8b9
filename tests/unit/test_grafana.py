"""The Grafana dashboard (package data: src/unbroken/telemetry/grafana/) and the Prometheus
rules (src/unbroken/telemetry/prometheus/rules.yml, deploy/prometheus/unbroken-rules.yml)
query only declared metric names, with the suffixes their kinds expose, declared recording
rules and declared goodput categories. Structural checks, no Grafana or Prometheus needed
(promtool runs the rules: tests/integration/test_prometheus.py)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from unbroken.telemetry.categories import Category
from unbroken.telemetry.metric_names import DEPRECATED, Metric, RecordingRule

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "src" / "unbroken" / "telemetry" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "src" / "unbroken" / "telemetry" / "grafana" / "unbroken.json"
METRIC_NAMES_SRC = ROOT / "src" / "unbroken" / "telemetry" / "metric_names.py"

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RECORDED_RE = re.compile(r"\bjob:unbroken_[a-z_0-9]+:[a-z_0-9]+")
_METRIC_RE = re.compile(r"unbroken_[a-z_]+")


class _Metrics:
    """The metric names in an expression, recorded series' names left out."""

    @staticmethod
    def findall(expr: str) -> list[str]:
        return _METRIC_RE.findall(RECORDED_RE.sub("", expr))


METRIC_RE = _Metrics()
SUFFIXES = {"Gauge": ("",), "Counter": ("_total",), "Histogram": ("_bucket", "_sum", "_count")}
CATEGORY_MATCHER_RE = re.compile(r'\bcategory\s*(?:=~|!~|!=|=)\s*"([^"]*)"')


def metric_kinds() -> dict[str, str]:
    """Each declared metric's kind, the first word of the docstring under its member in
    metric_names.py, so the kinds cannot drift from the declarations."""
    tree = ast.parse(METRIC_NAMES_SRC.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Metric"]
    kinds = {}
    for node, doc in zip(cls.body, cls.body[1:], strict=False):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
            continue
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), (
            f"{ast.unparse(node)} has no docstring saying its kind")
        kinds[node.value.value] = re.match(r"[A-Za-z]+", doc.value.value).group()
    assert set(kinds) == {m.value for m in Metric}
    assert set(kinds.values()) <= set(SUFFIXES), kinds
    return kinds


def exposed_names() -> dict[str, str]:
    """Every series name Prometheus holds for the declared metrics, mapped to its metric."""
    return {name + suffix: name
            for name, kind in metric_kinds().items() for suffix in SUFFIXES[kind]}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def alerts() -> dict:
    return yaml.safe_load(RULES.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in query_panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def alert_rules(alerts: dict) -> dict[str, dict]:
    return {rule["alert"]: rule for group in alerts["groups"] for rule in group["rules"]
            if "alert" in rule}


def recording_rules(alerts: dict) -> dict[str, dict]:
    return {rule["record"]: rule for group in alerts["groups"] for rule in group["rules"]
            if "record" in rule}


def test_dashboard_is_importable(dashboard):
    assert dashboard["title"] == "unbroken: goodput and recovery"
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] and dashboard["id"] is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and job["datasource"] == DATASOURCE
    assert job["query"]["query"] == job["definition"] == "label_values(unbroken_node_info, job)"


def test_every_panel_has_an_id_a_title_the_datasource_and_targets(dashboard):
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), ids
    assert all(isinstance(i, int) for i in ids)
    for panel in query_panels(dashboard):
        assert panel["title"].strip(), panel["id"]
        assert panel["type"] in {"stat", "timeseries", "bargauge", "piechart", "heatmap"}
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]


def test_every_query_selects_the_chosen_run(dashboard):
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            selectors = re.findall(r"unbroken_[a-z_0-9:]+\{([^}]*)\}", expr)
            assert len(selectors) == len(METRIC_RE.findall(expr)) + len(
                RECORDED_RE.findall(expr)), (panel["title"], expr)
            assert all('job="$job"' in s for s in selectors), (panel["title"], expr)


def test_the_panels_fit_the_grid_without_overlapping(dashboard):
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_the_goodput_stat_is_a_percentage_with_red_yellow_green_thresholds(dashboard):
    (panel,) = [p for p in query_panels(dashboard) if p["title"] == "Goodput ratio"]
    assert panel["type"] == "stat"
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "percentunit"
    steps = [(s["color"], s["value"]) for s in defaults["thresholds"]["steps"]]
    assert steps == [("red", None), ("yellow", 0.8), ("green", 0.95)]


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_queried_metric_names_are_declared_with_their_kinds_suffixes(source, dashboard, alerts):
    exprs = (dashboard_exprs(dashboard) if source == "dashboard"
             else [r["expr"] for g in alerts["groups"] for r in g["rules"]])
    recorded = {name for expr in exprs for name in RECORDED_RE.findall(expr)}
    assert recorded <= {r.value for r in RecordingRule}, recorded
    exposed = exposed_names()
    kinds = metric_kinds()
    names = {name for expr in exprs for name in METRIC_RE.findall(expr)}
    assert names
    for name in names:
        assert name in exposed, (
            f"{name} ({source}) is not a declared Metric with a suffix its kind exposes; "
            f"these are: {sorted(exposed)}")
    for expr in exprs:
        if "histogram_quantile" in expr:
            assert all(n.endswith("_bucket") for n in METRIC_RE.findall(expr)), expr
        for name in re.findall(r"\b(?:rate|increase)\((unbroken_[a-z_]+)", expr):
            assert kinds[exposed[name]] in ("Counter", "Histogram"), (
                f"rate/increase of the gauge {name}: {expr}")


def test_every_declared_metric_and_rule_is_on_the_dashboard_or_in_the_rules(dashboard, alerts):
    exposed = exposed_names()
    exprs = dashboard_exprs(dashboard) + [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    used = {exposed[n] for e in exprs for n in METRIC_RE.findall(e)}
    assert used == {m.value for m in Metric} - {m.value for m in DEPRECATED}
    assert set(recording_rules(alerts)) == {r.value for r in RecordingRule}
    on_dashboard = {n for e in dashboard_exprs(dashboard) for n in RECORDED_RE.findall(e)}
    assert {RecordingRule.GOODPUT, RecordingRule.RANK_SECONDS_RATE,
            RecordingRule.STEPS_RATE} <= on_dashboard


def test_category_matchers_and_overrides_name_declared_categories(dashboard):
    declared = {c.value for c in Category}
    used = set()
    for expr in dashboard_exprs(dashboard):
        for value in CATEGORY_MATCHER_RE.findall(expr):
            used.update(v for v in value.split("|") if v)
    for panel in query_panels(dashboard):
        if not any("category" in t["expr"] for t in panel["targets"]):
            continue
        assert all(t["legendFormat"] == "{{category}}" for t in panel["targets"]), panel["title"]
        for override in panel["fieldConfig"]["overrides"]:
            assert override["matcher"]["id"] == "byName", panel["title"]
            used.add(override["matcher"]["options"])
    assert used, "the dashboard names no category"
    assert used <= declared, used - declared


def test_alert_rules(alerts):
    """The alerts query the recorded series where one says what they need; each groups by
    the run (`job`); their firing is promtool's to show (deploy/prometheus/)."""
    rules = alert_rules(alerts)
    assert set(rules) == {"UnbrokenFault", "UnbrokenGoodputLow", "UnbrokenFrequentFaults",
                          "UnbrokenNoStepProgress"}
    for name, rule in rules.items():
        assert rule["annotations"]["summary"] and rule["labels"]["severity"], name
        assert "by (job" in rule["expr"] or "job:" in rule["expr"], name
    assert "for" not in rules["UnbrokenFault"]  # at once
    assert rules["UnbrokenGoodputLow"]["for"] == "15m"
    assert re.search(r"job:unbroken_goodput:ratio_rate5m\s*<\s*0\.8\b",
                     rules["UnbrokenGoodputLow"]["expr"])
    assert re.search(r"floor\(sum by \(job\) \(job:unbroken_faults:increase1h\)\)\s*>\s*3\b",
                     rules["UnbrokenFrequentFaults"]["expr"])
    assert re.search(r"rate\(unbroken_node_steps_total\[10m\]\)\)\s*==\s*0\b",
                     rules["UnbrokenNoStepProgress"]["expr"])


def test_the_deploy_rules_file_is_the_packaged_one():
    shipped = ROOT / "deploy" / "prometheus" / "unbroken-rules.yml"
    assert shipped.resolve() == RULES.resolve()
