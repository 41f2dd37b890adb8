"""``kvp-admin metrics`` on the shared tier, with real parts: Debian's redis-server with an ACL
user and a password (tests/integration/_redis.py: standalone and a 3-primary cluster), two
deployment configs pointing at the same store, and node_exporter's textfile collector scraped
by a real Prometheus that loads monitoring/kvpersist-rules.yml (tests/integration/_prometheus.py).

What it shows: the keys and bytes per namespace are exactly what was stored (and what
``report --tier shared`` says); two deployments on one store measure it once (the store's own
command statistics count one scan); per-node memory, maxmemory and policy come from each
primary; with the store killed the run still writes every file, the store's with up 0, exits 1,
and KvpersistSharedTierDown fires; the password is in no output and no file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpersist.actions.metrics import textfile_name_for_store

from ..cli import kvp
from ..conftest import REPO, free_port
from ..promql_names import grafana_to_promql
from ._prometheus import monitoring, short_for_rules
from ._redis import ACL_USER, Redis, start_redis

pytestmark = pytest.mark.integration

DEMO = REPO / "configs" / "cpu-demo"
DASHBOARD = REPO / "monitoring" / "grafana" / "kvpersist-dashboard.json"
OTHER_NS = "kvp-" + "5e" * 16  # a namespace no config here uses (another host's)


def config_dir(tmp: Path, name: str, redis: Redis, root: Path, **extra: str) -> Path:
    """A copy of configs/cpu-demo named ``name`` on ``root``, using ``redis`` as shared tier."""
    d = tmp / name
    d.mkdir()
    (d / "chat_template.jinja").write_bytes((DEMO / "chat_template.jinja").read_bytes())
    values = {"KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
              "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
              "KVP_SHARED_TIER": redis.url,
              "KVP_SHARED_TIER_SECRET_FILE": str(redis.write_secret(tmp / f"{name}.secret")),
              **extra}
    lines = []
    for line in (DEMO / "identity.env").read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}='{values.pop(key)}'" if key in values else line)
    (d / "identity.env").write_text("\n".join([*lines, *(f"{k}='{v}'" for k, v in
                                                         values.items())]) + "\n")
    return d


def namespace_of(config: Path) -> str:
    r = kvp("render", str(config), "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["namespace"])


def client(redis: Redis) -> Any:
    import redis as redis_py
    from redis.cluster import ClusterNode, RedisCluster

    if redis.cluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port)  # type: ignore[no-untyped-call]
                                           for n in redis.nodes],
                            username=ACL_USER, password=redis.password)
    return redis_py.Redis(port=redis.nodes[0].port, username=ACL_USER, password=redis.password)


def store_chunks(redis: Redis, layout: dict[str, list[int]]) -> dict[str, tuple[int, int]]:
    """Write chunk keys in LMCache's wire format (``ns@rank@group@hash``), ``layout[ns]`` the
    value sizes; two keys that are not chunk keys. Returns ns -> (keys, bytes) stored."""
    c = client(redis)
    try:
        for ns, sizes in layout.items():
            for i, size in enumerate(sizes):
                c.set(f"{ns}@01000100@0@{i:064x}", os.urandom(size))
        c.set("kvpersist-lock:prune:" + OTHER_NS, "some-host:1:abcd")
        c.set("an-operators-key", "x")
    finally:
        c.close()
    return {ns: (len(sizes), sum(sizes)) for ns, sizes in layout.items()}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def pick(doc: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
         **labels: str) -> list[float]:
    return [v for (n, lab), v in doc.items()
            if n == name and all((k, w) in lab for k, w in labels.items())]


def panel_exprs(title: str) -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    [panel] = [p for p in doc["panels"] if p.get("title") == title]
    return [str(t["expr"]) for t in panel["targets"]]


def scan_calls(redis: Redis) -> int:
    total = 0
    for n in redis.nodes:
        for line in n.cli("info", "commandstats").splitlines():
            if line.startswith("cmdstat_scan:"):
                total += int(line.split("calls=", 1)[1].split(",", 1)[0])
    return total


def reset_stats(redis: Redis) -> None:
    for n in redis.nodes:
        n.cli("config", "resetstat")


def test_store_figures_in_prometheus_and_a_killed_store(tmp_path: Path, redis: Redis) -> None:
    t0 = time.monotonic()
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    a = config_dir(tmp_path, "host-a", redis, root)
    # another identity (max model length): another namespace on the same store
    b = config_dir(tmp_path, "host-b", redis, root, KVP_MAX_MODEL_LEN="2048")
    ns_a, ns_b = namespace_of(a), namespace_of(b)
    assert ns_a != ns_b
    stored = store_chunks(redis, {ns_a: [4096 + i for i in range(5)], ns_b: [1000] * 3,
                                  OTHER_NS: [7, 9]})
    store = f"127.0.0.1:{redis.nodes[0].port}"

    # report --tier shared: the reference figures, and the scan calls of one measurement
    reset_stats(redis)
    rep = kvp("report", "--tier", "shared", "--config", str(a), "--json")
    assert rep.returncode == 0, rep.stderr
    one_scan = scan_calls(redis)
    assert one_scan >= 1
    report = {r["namespace"]: (r["keys"], r["bytes"]) for r in json.loads(rep.stdout)["namespaces"]}
    assert report == stored

    rules = short_for_rules(tmp_path / "rules.yml")
    with monitoring(tmp_path / "mon", rules=rules) as mon:
        reset_stats(redis)
        r = kvp("metrics", str(a), str(b), "--no-vllm", "--timeout", "2", "--textfile",
                str(mon.textfile_dir))
        assert r.returncode == 0, r.stderr
        # two deployments, one store: measured once
        assert scan_calls(redis) == one_scan
        store_file = mon.textfile_dir / textfile_name_for_store(store)
        files = sorted(p.name for p in mon.textfile_dir.iterdir())
        assert store_file.name in files and "kvpersist-deployment-host-a.prom" in files \
            and "kvpersist-deployment-host-b.prom" in files and len(files) == 4, files
        m = samples(store_file.read_text())
        for ns, (keys, size) in stored.items():
            assert pick(m, "kvpersist_shared_tier_namespace_keys", store=store,
                        namespace=ns) == [keys]
            assert pick(m, "kvpersist_shared_tier_namespace_bytes", store=store,
                        namespace=ns) == [size]
        assert pick(m, "kvpersist_shared_tier_other_keys", store=store) == [2]
        assert pick(m, "kvpersist_shared_tier_up", store=store) == [1]
        node = {"store": store, "node": store}
        assert pick(m, "kvpersist_shared_tier_maxmemory_bytes", **node) == [512 * 2**20]
        assert pick(m, "kvpersist_shared_tier_node_info", maxmemory_policy="allkeys-lru",
                    **node) == [1]
        [used] = pick(m, "kvpersist_shared_tier_used_memory_bytes", **node)
        assert used > sum(size for _, size in stored.values())
        assert pick(m, "kvpersist_shared_tier_evicted_keys_total", **node) == [0]
        [latency] = pick(m, "kvpersist_shared_tier_probe_latency_seconds", store=store)
        [scan_s] = pick(m, "kvpersist_shared_tier_scan_duration_seconds", store=store)
        assert 0 < latency < 2 and 0 < scan_s < 2
        for cfg, ns in (("host-a", ns_a), ("host-b", ns_b)):
            d = samples((mon.textfile_dir / f"kvpersist-deployment-{cfg}.prom").read_text())
            assert pick(d, "kvpersist_deployment_shared_tier_info", store=store,
                        namespace=ns, adapter="resp") == [1]
            assert pick(d, "kvpersist_component_health", component="shared_tier") == [0]

        # Prometheus scrapes them through node_exporter
        got = mon.wait_value(f'kvpersist_shared_tier_namespace_bytes{{namespace="{ns_a}"}}',
                             lambda v: True, what="the shared tier's bytes scraped")
        assert got == stored[ns_a][1]
        assert mon.values(f'kvpersist_shared_tier_namespace_keys{{namespace="{ns_b}"}}') == [3]
        assert mon.values("node_textfile_scrape_error") == [0]
        # healthy tier: past every `for:` (2 s here), no shared-tier alert pending or firing
        # (the deployments are down, no cache server runs: that is another alert's business)
        time.sleep(4)
        assert mon.query('ALERTS{alertname=~"KvpersistSharedTier.*"}') == []
        # the dashboard's panel, every variable at All: the stored bytes per namespace
        [expr] = panel_exprs("Bytes on the shared tier per namespace")
        panel = {s["metric"]["namespace"]: float(s["value"][1])
                 for s in mon.query(grafana_to_promql(expr))}
        assert panel == {ns: float(size) for ns, (_, size) in stored.items()}

        # the store is killed: the run still writes every file, the store's with up 0
        redis.kill()
        killed_at = time.time()
        r2 = kvp("metrics", str(a), str(b), "--no-vllm", "--timeout", "2", "--textfile",
                 str(mon.textfile_dir))
        assert r2.returncode == 1 and "Traceback" not in r2.stderr, r2.stderr
        assert f"shared tier {store}" in r2.stderr
        assert sorted(p.name for p in mon.textfile_dir.iterdir()) == files
        m2 = samples(store_file.read_text())
        assert pick(m2, "kvpersist_shared_tier_up", store=store) == [0]
        assert pick(m2, "kvpersist_shared_tier_reachable", store=store) == [0]
        assert pick(m2, "kvpersist_shared_tier_namespace_keys") == []
        d = samples((mon.textfile_dir / "kvpersist-deployment-host-a.prom").read_text())
        assert pick(d, "kvpersist_component_health", component="shared_tier") == [1]
        # the root's figures are still there, and from this run
        [root_file] = [p for p in mon.textfile_dir.iterdir()
                       if p.name.startswith("kvpersist-root-")]
        rs = samples(root_file.read_text())
        assert pick(rs, "kvpersist_l2_used_bytes") == [0]
        [when] = pick(rs, "kvpersist_metrics_timestamp_seconds")
        assert when >= killed_at

        mon.wait_value(f'kvpersist_shared_tier_up{{store="{store}"}}', lambda v: v == 0,
                       what="up 0 scraped")
        mon.wait_for('ALERTS{alertname="KvpersistSharedTierDown",alertstate="firing"}',
                     lambda res: len(res) == 1, timeout=30, what="KvpersistSharedTierDown")
        [alert] = mon.firing("KvpersistSharedTierDown")
        assert alert["store"] == store and alert["severity"] == "warning"
        bad = [(x["name"], x.get("lastError")) for x in mon.rules() if x["health"] != "ok"]
        assert bad == [], bad

        texts = [rep.stdout, rep.stderr, r.stdout, r.stderr, r2.stdout, r2.stderr,
                 *(p.read_text() for p in mon.textfile_dir.iterdir())]
        assert not [t for t in texts if redis.password in t]
    assert time.monotonic() - t0 < 120


def test_a_cluster_is_measured_per_primary(tmp_path: Path) -> None:
    redis = start_redis(tmp_path / "store", cluster=True)
    try:
        root = tmp_path / "cache"
        root.mkdir(mode=0o700)
        a = config_dir(tmp_path, "host-a", redis, root)
        ns = namespace_of(a)
        stored = store_chunks(redis, {ns: [2048] * 30})
        r = kvp("metrics", str(a), "--no-vllm", "--timeout", "2")
        assert r.returncode == 0, r.stderr
        m = samples(r.stdout)
        store = ",".join(sorted(f"127.0.0.1:{n.port}" for n in redis.nodes))
        assert pick(m, "kvpersist_shared_tier_up", store=store) == [1]
        assert pick(m, "kvpersist_shared_tier_namespace_keys", namespace=ns) == [30]
        assert pick(m, "kvpersist_shared_tier_namespace_bytes", namespace=ns) == \
            [stored[ns][1]]
        # one series per primary, each node named by its own address
        nodes = {dict(lab)["node"] for (n, lab) in m
                 if n == "kvpersist_shared_tier_used_memory_bytes"}
        assert nodes == {f"127.0.0.1:{n.port}" for n in redis.nodes}
        assert len(pick(m, "kvpersist_shared_tier_node_info",
                        maxmemory_policy="allkeys-lru")) == 3
        assert pick(m, "kvpersist_deployment_shared_tier_info", store=store,
                    adapter="valkey") == [1]
        assert redis.password not in r.stdout + r.stderr
    finally:
        redis.stop()
