"""A real Prometheus (Debian's, 2.42: `make install`) over a real two-node job, and promtool
over the shipped rules.

- promtool checks deploy/prometheus/unbroken-rules.yml and runs its unit tests
  (unbroken-rules.test.yml: every alert fires where it should and stays quiet where it
  should not; the recording rules over synthetic series).
- Two nodes that share nothing (network namespaces, tests/netns.py), each agent serving its
  own /metrics; a Prometheus of the test's own (its own TSDB in a temporary directory, a
  free port, 1 s scrape and evaluation intervals, the shipped rules) scrapes both. Both
  targets are up; a worker on node 1 is SIGKILLed: the fault counter summed over nodes
  reads 1 in Prometheus's query API, labelled node 1, the shipped alert whose `for:` is
  0 (`UnbrokenFault`) fires on it, the leader counts the capacity the job lost until the
  replacement joined, and the goodput rule gives a ratio over every node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import EXAMPLE, REPO, TINY, finish_on, free_port, go_file, start_on, wait_for
from conftest import events_of as _events_of

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")

RULES_DIR = REPO / "deploy" / "prometheus"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
MISSING = "Debian's prometheus is not installed (make install installs it)"
MASTER_PORT, METRICS_PORT = "29500", 29464  # each host is a namespace: free on each
SCRAPE_JOB = "ptest"


def test_the_shipped_rules_check_and_their_promtool_tests_pass():
    assert PROMTOOL, MISSING
    check = subprocess.run([PROMTOOL, "check", "rules", "unbroken-rules.yml"], cwd=RULES_DIR,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([PROMTOOL, "test", "rules", "unbroken-rules.test.yml"],
                           cwd=RULES_DIR, capture_output=True, text=True, timeout=120)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


class Prometheus:
    """`prometheus` of the test's own: scrapes `targets` every second, evaluates the shipped
    rules every second, keeps its TSDB under `root`; stopped (and waited for) on exit."""

    def __init__(self, root: Path, targets: list[str]) -> None:
        root.mkdir(parents=True)
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                             "scrape_timeout": "900ms"},
                  "rule_files": [str(RULES_DIR / "unbroken-rules.yml")],
                  "scrape_configs": [{"job_name": SCRAPE_JOB,
                                      "static_configs": [{"targets": targets}]}]}
        (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(root / "prometheus.log", "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.root = root

    def __enter__(self) -> Prometheus:
        wait_for(self._ready, 60, "Prometheus to be ready")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()

    def _ready(self) -> bool:
        assert self.proc.poll() is None, (self.root / "prometheus.log").read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                return True
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` gives now: [{"metric": {...}, "value": [t, "v"]}]."""
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The one sample `expr` gives now, or None."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None


def test_a_real_prometheus_scrapes_every_node_and_a_fault_on_node_1_fires_the_alert(
        isolated_hosts, tmp_path):
    assert PROMETHEUS, MISSING
    hosts = isolated_hosts
    go = go_file(hosts)
    targets = [f"{hosts.addr(i)}:{METRICS_PORT}" for i in (0, 1)]
    agents = []
    with Prometheus(tmp_path / "prometheus", targets) as prom:
        for k in (0, 1):
            agents.append(start_on(
                hosts, k, "--nnodes", "2", "--node-rank", str(k), "--master-addr",
                hosts.name(0), "--master-port", MASTER_PORT, "--nproc-per-node", "1",
                "--rdzv-timeout", "60", "--metrics-port", str(METRICS_PORT),
                "--metrics-addr", "0.0.0.0", "--max-restarts", "3",
                script=EXAMPLE, shared=[go.parent],
                args=["--steps", "1600", *TINY, "--step-sleep", "0.05",
                      "--sleep-until", str(go)]))
        run1 = hosts.node_dir(1) / "run"
        try:
            # Both targets up, each serving its node's series; steps counted on both.
            wait_for(lambda: prom.value(f'count(up{{job="{SCRAPE_JOB}"}} == 1)') == 2, 120,
                     "both agents scraped", explain=run1)
            wait_for(lambda: (prom.value(f'count(unbroken_node_steps_total{{job='
                                         f'"{SCRAPE_JOB}"}} > 5)') or 0) == 2,
                     120, "steps on both nodes", explain=run1)
            roles = {r["metric"]["node"]: r["metric"]["role"]
                     for r in prom.query('unbroken_node_info == 1')}
            assert roles == {"0": "leader", "1": "follower"}, roles
            assert prom.value(f'sum(unbroken_node_faults_total{{job="{SCRAPE_JOB}"}})') == 0
            assert not prom.query('ALERTS{alertname="UnbrokenFault"}')

            (worker,) = _events_of(run1, "workers_started")[0]["pids"].values()
            os.kill(worker, signal.SIGKILL)
            wait_for(lambda: prom.value(
                f'sum(unbroken_node_faults_total{{job="{SCRAPE_JOB}"}})') == 1,
                60, "the fault in Prometheus", explain=run1)
            by_node = {r["metric"]["node"]: float(r["value"][1]) for r in prom.query(
                f'sum by (node) (unbroken_node_faults_total{{job="{SCRAPE_JOB}",'
                'kind="crash"})')}
            assert by_node == {"0": 0.0, "1": 1.0}, by_node
            wait_for(lambda: prom.query(
                'ALERTS{alertname="UnbrokenFault",alertstate="firing",kind="crash"}'),
                60, "UnbrokenFault to fire", explain=run1)
            (alert,) = prom.query('ALERTS{alertname="UnbrokenFault",alertstate="firing"}')
            assert alert["metric"]["job"] == SCRAPE_JOB
            # The job ran short of node 1's rank until its replacement joined: the leader's
            # capacity counter, and the rule that adds it to every node's rank-seconds.
            wait_for(lambda: (prom.value(f'unbroken_job_capacity_lost_rank_seconds_total'
                                         f'{{job="{SCRAPE_JOB}"}}') or 0) > 0,
                     60, "the capacity lost", explain=run1)
            # Goodput by the recording rule, over every node's rank-seconds: a ratio as soon
            # as any rank-second is counted (start-up first, 0), productive once the steps'
            # seconds are settled (a loaded CI run read the 0 of the start-up alone).
            goodput = f'job:unbroken_goodput:ratio_rate5m{{job="{SCRAPE_JOB}"}}'
            wait_for(lambda: (prom.value(goodput) or 0) > 0, 90, "productive rank-seconds",
                     explain=run1)
            assert 0 < prom.value(goodput) < 1
        finally:
            go.touch()
            results = [finish_on(hosts, k, a, timeout=240) for k, a in enumerate(agents)]
    assert [r.code for r in results] == [0, 0], "\n".join(r.output for r in results)
    assert results[1].events("fault") and not results[0].events("restart")
