"""``kvp-admin metrics`` proven against real parts: a real ``lmcache server`` launched for the
relocated cpu-demo deployment and driven through LMCache's own client under the deployment's
namespace, node_exporter's textfile collector serving what ``kvp-admin metrics --textfile``
wrote, and Prometheus scraping both and evaluating monitoring/kvpersist-rules.yml.

What it shows: the bytes Prometheus holds for the namespace are ``report``'s; LMCache's lookup
counters carry the same namespace as ``model_name``; the hit-ratio rule over them, and the
dashboard's hit-ratio panel, give the ratio of the lookups driven; and on a healthy deployment
no alert fires. (The degraded alert, which needs vLLM serving, is in
tests/fullstack/test_persistence_e2e.py.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpersist.demo.kvdriver import connect

from ..conftest import REPO
from ..fullstack._stack import Stack, wait_until
from ._prometheus import RULES, monitoring, short_for_rules

pytestmark = pytest.mark.integration

#: tokens per lookup of the driver (1024 + 1 tokens: 4 full chunks of 256)
TOKENS = 1024
HIT_RATIO_RULE = "namespace:lmcache_mp_lookup_hit:ratio_rate5m"
DASHBOARD = REPO / "monitoring" / "grafana" / "kvpersist-dashboard.json"
HIT_RATIO_PANEL = "Lookup hit ratio per namespace"


def _rule_expr(record: str) -> str:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == record:
                return str(rule["expr"])
    raise AssertionError(f"no recording rule {record} in {RULES}")


def _dashboard_exprs(title: str) -> list[str]:
    """The PromQL of the dashboard panel ``title`` (its targets, in order)."""
    def panels(ps: list[Any]) -> Any:
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    doc = json.loads(DASHBOARD.read_text())
    for panel in panels(doc["panels"]):
        if panel.get("title") == title:
            return [str(t["expr"]) for t in panel["targets"]]
    raise AssertionError(f"no panel {title!r} in {DASHBOARD}")


def _flushed(stack: Stack, ns: str, files: int) -> bool:
    """All ``files`` chunk files of ``ns`` renamed into place, no write in flight."""
    temp = [p for p in stack.root.iterdir() if ".tmp." in p.name]
    return len(stack.chunk_files(ns + "_")) == files and not temp


def test_namespace_bytes_lookup_counters_and_hit_ratio_in_prometheus(stack: Stack,
                                                                     tmp_path: Path) -> None:
    t0 = time.monotonic()
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        assert [len(d.store(seq)) for seq in (1, 2)] == [4, 4]
        # one lookup before Prometheus starts: LMCache's per-namespace counters exist from its
        # first scrape on, so that rate() sees only the lookups below as the increase
        assert d.lookup(1).hit_chunks == 4

    rules = short_for_rules(tmp_path / "rules.yml")
    with monitoring(tmp_path / "mon", lmcache=[stack.http], rules=rules) as mon:
        ns_sel = f'model_name="{ns}"'
        requested = f"lmcache_mp_lookup_requested_tokens_total{{{ns_sel}}}"
        hits = f"lmcache_mp_lookup_hit_tokens_total{{{ns_sel}}}"
        mon.wait_value(requested, lambda v: v == TOKENS, what="the first LMCache scrape")

        with connect(stack.rpc, stack.http, ns) as d:
            driven = [d.lookup(1), d.lookup(2), d.lookup(3)]  # 3 was never stored: a miss
        assert [lk.hit_chunks for lk in driven] == [4, 4, 0]
        hit_tokens = sum(lk.hit_chunks for lk in driven) * 256
        req_tokens = sum(lk.total_chunks for lk in driven) * 256
        assert (hit_tokens, req_tokens) == (2 * TOKENS, 3 * TOKENS)

        # kvp-admin metrics, as its timer runs it, once the files are on disk
        assert wait_until(lambda: _flushed(stack, ns, 8), 30), stack.chunk_files()
        r = stack.kvp("metrics", stack.config, "--no-vllm", "--textfile",
                      str(mon.textfile_dir), timeout=120)
        assert r.returncode == 0, r.stderr
        written = sorted(p.name for p in mon.textfile_dir.iterdir())
        assert len(written) == 2 and written[0] == f"kvpersist-deployment-{stack.config}.prom" \
            and written[1].startswith("kvpersist-root-"), written
        report: Any = stack.kvp_json("report", "--root", str(stack.root),
                                     "--config", stack.config)
        [mine] = [n for n in report["namespaces"] if n["namespace"] == ns]
        assert mine["files"] == 8 and mine["active"] and mine["bytes"] > 0

        # 1. the namespace's bytes, through node_exporter, are report's
        got = mon.wait_value(f'kvpersist_namespace_bytes{{namespace="{ns}"}}',
                             lambda v: True, what="kvpersist_namespace_bytes scraped")
        assert got == mine["bytes"]
        assert mon.values(f'kvpersist_namespace_files{{namespace="{ns}"}}') == [8]
        assert mon.values(f'kvpersist_cache_server_up{{namespace="{ns}",'
                          f'config="{stack.config}"}}') == [1]
        assert mon.values(f'kvpersist_deployment_health{{namespace="{ns}"}}') == [0]
        assert mon.query("node_textfile_scrape_error") and \
            mon.values("node_textfile_scrape_error") == [0]

        # 2. LMCache's own counters for the same namespace, all lookups counted
        mon.wait_value(requested, lambda v: v == TOKENS + req_tokens,
                       what="the lookups scraped")
        assert mon.values(hits) == [TOKENS + hit_tokens]
        assert mon.values(f"lmcache_mp_lookups_requests_total{{{ns_sel}}}") == [4]

        # 3. the hit ratio per namespace (the recording rule the dashboard plots): the
        # lookups' hits / requested tokens. Wait for 6 samples in the window, so rate()'s
        # extrapolation is the same for numerator and denominator.
        expected = hit_tokens / req_tokens
        mon.wait_value(f"count_over_time({requested}[5m])", lambda v: v >= 6, timeout=30,
                       what="six LMCache scrapes")
        ratio_expr = _rule_expr(HIT_RATIO_RULE)
        direct = [s for s in mon.query(ratio_expr) if s["metric"].get("namespace") == ns]
        assert len(direct) == 1, (ratio_expr, mon.query(ratio_expr))
        assert float(direct[0]["value"][1]) == pytest.approx(expected, rel=1e-9)
        # the dashboard's panel, with its variables as Grafana would fill them for this
        # namespace: L1+L2 (all the lookups' hits were in L1), then L2 alone (none)
        l1l2, l2 = (e.replace("$namespace", ns).replace("$__rate_interval", "5m")
                    for e in _dashboard_exprs(HIT_RATIO_PANEL))
        assert "lmcache_mp_lookup_hit_tokens_total" in l1l2 and "hit_l2_tokens" in l2
        panel = {s["metric"]["namespace"]: float(s["value"][1]) for s in mon.query(l1l2)}
        assert panel.keys() == {ns} and panel[ns] == pytest.approx(expected, rel=1e-9)
        assert mon.values(l2) == [0]
        recorded = mon.wait_value(f'{HIT_RATIO_RULE}{{namespace="{ns}"}}',
                                  lambda v: v == pytest.approx(expected, rel=1e-9),
                                  what="the recorded hit ratio")
        assert recorded == pytest.approx(2 / 3, rel=1e-9)
        # the namespace joins kvpersist's series with LMCache's
        joined = mon.query(f'{HIT_RATIO_RULE} * on(namespace) group_left(config) '
                           f'kvpersist_namespace_info{{namespace="{ns}"}}')
        assert [s["metric"].get("config") for s in joined] == [stack.config]

        # 4. every rule evaluates without error on these real series, and a healthy
        # deployment fires no alert (every `for:` is 2 s here)
        bad = [(r["name"], r.get("lastError")) for r in mon.rules() if r["health"] != "ok"]
        assert bad == [], bad
        assert mon.firing("KvpersistCacheServerDown") == []
        assert mon.query('ALERTS{alertstate="firing"}') == []
    assert time.monotonic() - t0 < 180
