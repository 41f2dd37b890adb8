"""monitoring/ against real processes: a real Prometheus (temp data dir, free loopback port)
loads monitoring/kvpersist-rules.yml and scrapes a real ``lmcache server`` (restarted on a
cache root that already holds chunks, then driven through LMCache's client) and a real
node_exporter whose textfile collector reads ``kvp-admin metrics --textfile``. Every panel
query of monitoring/grafana/kvpersist-dashboard.json must run, every rule must evaluate
without error on that data, every metric name must exist, and the PromQL of
docs/observability.md must answer."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from ..promql_names import (
    documented_names,
    exposition_names,
    grafana_to_promql,
    metric_names,
    vllm_metric_names,
)
from ._lmcache_server import start_lmcache_server

RULES = REPO / "monitoring" / "kvpersist-rules.yml"
DASHBOARD = REPO / "monitoring" / "grafana" / "kvpersist-dashboard.json"
DOC = REPO / "docs" / "observability.md"
MODEL = "test-model"  # the model name ``lmcache bench server`` stores under


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=clean_env(),
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Monitoring:
    prometheus: str  #: base URL
    lmcache_exposition: str  #: of both server processes
    node_exposition: str
    root: Path

    def query(self, expr: str) -> requests.Response:
        return requests.post(f"{self.prometheus}/api/v1/query", data={"query": expr},
                             timeout=10)

    def result(self, expr: str) -> list[dict[str, Any]]:
        r = self.query(expr)
        assert r.status_code == 200, f"{expr}\n{r.text}"
        body = r.json()
        assert body["status"] == "success", body
        return list(body["data"]["result"])


def _wait(what: str, check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def mon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitoring]:
    for exe in ("prometheus", "prometheus-node-exporter"):
        assert shutil.which(exe), f"{exe} is missing: bash scripts/setup.sh installs it"
    tmp = tmp_path_factory.mktemp("monitoring")
    root = tmp / "cache"
    procs: list[subprocess.Popen[bytes]] = []
    # chunks written by a first server process, then a restart: lookups hit them in L2
    first = start_lmcache_server(root)
    try:
        first.bench(start=0, end=2)
        # LMCache creates some series on first use: this run stores to L2, the next only reads
        first_text = requests.get(f"{first.http_url}/metrics", timeout=5).text
    finally:
        first.stop()
    srv = start_lmcache_server(root)
    try:
        srv.bench(start=0, end=2)
        textfiles = tmp / "textfile"
        textfiles.mkdir()
        cp = kvp("metrics", "--root", str(root), "--textfile", str(textfiles))
        assert cp.returncode == 0, cp.stderr
        node_port = free_port()
        procs.append(_start([
            "prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{node_port}",
            "--collector.disable-defaults", "--collector.textfile",
            f"--collector.textfile.directory={textfiles}"], tmp / "node-exporter.log"))
        prom_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "node", "static_configs": [
                    {"targets": [f"127.0.0.1:{node_port}"]}]},
                {"job_name": "lmcache", "static_configs": [
                    {"targets": [f"127.0.0.1:{srv.http_port}"]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        procs.append(_start([
            "prometheus", f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}"], tmp / "prometheus.log"))
        url = f"http://127.0.0.1:{prom_port}"
        node_text = _wait("node_exporter", lambda: requests.get(
            f"http://127.0.0.1:{node_port}/metrics", timeout=5).text)
        m = Monitoring(url, first_text + requests.get(f"{srv.http_url}/metrics",
                                                      timeout=5).text, node_text, root)
        _wait("prometheus ready", lambda: requests.get(f"{url}/-/ready", timeout=5).ok)
        _wait("both targets scraped", lambda: len(m.result("up == 1")) == 2
              and m.result("lmcache_mp_lookup_hit_l2_tokens_total")
              and m.result("kvpersist_namespace_bytes"))
        yield m
    finally:
        for proc in reversed(procs):
            _stop(proc)
        srv.stop()


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def template_selectors() -> list[str]:
    """The series selectors inside the dashboard variables' ``label_values(SELECTOR, label)``."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] == "datasource":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert query.startswith("label_values(") and query.endswith(")"), query
        out.append(query[len("label_values("):-1].rsplit(",", 1)[0])
    return out


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r.get("alert") or r["record"]: r["expr"]
            for g in doc["groups"] for r in g["rules"]}


def test_dashboard_is_importable_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"namespace", "config", "instance"} <= set(variables)
    # provisioned from a file (no import to fill __inputs), this variable resolves it
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert p["targets"], p["title"]


def test_every_dashboard_query_runs_on_prometheus(mon: Monitoring) -> None:
    queries = dashboard_queries() + template_selectors()
    assert len(queries) > 20
    for expr in queries:
        mon.result(grafana_to_promql(expr))


def test_a_bad_query_is_refused(mon: Monitoring) -> None:
    """The check above would notice a parse error: Prometheus answers 400."""
    assert mon.query("sum by (namespace (kvpersist_namespace_bytes)").status_code == 400


def test_dashboard_metrics_come_from_kvpersist_lmcache_or_vllm(mon: Monitoring) -> None:
    known = (documented_names(DOC) | exposition_names(mon.lmcache_exposition)
             | vllm_metric_names())
    used: set[str] = set()
    for expr in dashboard_queries() + template_selectors():
        used |= metric_names(grafana_to_promql(expr))
    assert used - known == set()
    assert {n.split("_")[0] for n in used} >= {"kvpersist", "lmcache", "vllm:prefix"}


def test_rule_metrics_come_from_kvpersist_lmcache_or_node_exporter(mon: Monitoring) -> None:
    exprs = rule_exprs()
    known = (documented_names(DOC) | exposition_names(mon.lmcache_exposition)
             | exposition_names(mon.node_exposition) | {n for n in exprs if ":" in n})
    used = set().union(*(metric_names(e) for e in exprs.values()))
    assert used - known == set()


def test_rules_evaluate_without_errors_on_real_data(mon: Monitoring) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = requests.get(f"{mon.prometheus}/api/v1/rules", timeout=5).json()["data"]
        rules = [r for g in groups["groups"] for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
        return rules if done and len(rules) == len(rule_exprs()) else []

    rules = _wait("every rule evaluated", evaluated)
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # nothing on this healthy root fires (a few lookups, and they hit L2)
    firing = [r["name"] for r in rules if r["type"] == "alerting" and r["alerts"]]
    assert firing == []


def test_node_exporter_serves_the_textfiles_the_stale_alert_watches(mon: Monitoring) -> None:
    stale = rule_exprs()["KvpersistMetricsStale"]
    selector = stale[stale.index("node_textfile_mtime_seconds"):].split("}")[0] + "}"
    files = mon.result(selector)
    assert files and all("kvpersist-root-" in s["metric"]["file"] for s in files)
    assert [s["value"][1] for s in mon.result("node_textfile_scrape_error")] == ["0"]


def test_docs_promql_how_much_nvme_a_model_uses(mon: Monitoring) -> None:
    doc = DOC.read_text()
    expr = "kvpersist_namespace_bytes * on(namespace) group_left(model_id) kvpersist_namespace_info"
    assert expr in doc
    [series] = mon.result(expr)
    assert series["metric"]["namespace"] == MODEL
    on_disk = sum(p.stat().st_size for p in mon.root.glob(f"{MODEL}_*.bin"))
    assert float(series["value"][1]) == on_disk > 0


def test_docs_promql_did_the_restart_hit_from_disk(mon: Monitoring) -> None:
    expr = ('sum by (namespace) (label_replace(lmcache_mp_lookup_hit_l2_tokens_total, '
            '"namespace", "$1", "model_name", "(.+)"))')
    assert expr in DOC.read_text()
    [series] = mon.result(expr)
    assert series["metric"]["namespace"] == MODEL
    assert float(series["value"][1]) > 0
