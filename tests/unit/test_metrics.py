"""kvp-admin metrics: the exposition equals the report, parses with prometheus_client's own
parser and promtool, and the textfile output is atomic, readable by node_exporter and split per
root and per deployment; verify and prune record their runs; health groups checks into
components."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpersist.actions.metrics import textfile_name_for_root
from kvpersist.l2 import runs
from kvpersist.l2.layout import ChunkName, temp_name
from kvpersist.stack.health import Check, component_of, component_status

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from ..l2_roots import read_runs_at, record_run_at

NS = "kvp-" + "ab" * 16
OTHER = "kvp-" + "cd" * 16
DEMO_NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # configs/cpu-demo


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value, parsed by prometheus_client's own parser."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(doc: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    hits = [v for (n, lab), v in doc.items()
            if n == name and all((k, w) in lab for k, w in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def names(doc: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {n for n, _ in doc}


def chunk_file(root: Path, ns: str, i: int, size: int, age_s: float = 0) -> Path:
    p = root / ChunkName(ns, 0x01000100, 0, f"{i:064x}").filename()
    p.write_bytes(b"k" * size)
    if age_s:
        t = time.time() - age_s
        os.utime(p, (t, t))
    return p


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "cache"
    r.mkdir(mode=0o700)
    for i in range(3):
        chunk_file(r, NS, i, 1000, age_s=7200 * (i + 1))
    chunk_file(r, OTHER, 9, 500)
    tmp = r / temp_name(ChunkName(NS, 0x01000100, 0, "f" * 64), "0123abcd" * 4)
    tmp.write_bytes(b"t" * 10)
    old = time.time() - 5000
    os.utime(tmp, (old, old))
    (r / "notes.txt").write_text("an operator's file\n")
    q = r / ".kvpersist" / "quarantine"
    q.mkdir(parents=True)
    (q / ChunkName(NS, 0x01000100, 0, "e" * 64).filename()).write_bytes(b"q" * 77)
    return r


def test_metrics_equal_the_report(root: Path) -> None:
    rep = kvp("report", "--root", str(root), "--json")
    assert rep.returncode == 0, rep.stderr
    doc = json.loads(rep.stdout)
    res = kvp("metrics", "--root", str(root))
    assert res.returncode == 0, res.stderr
    m = samples(res.stdout)
    r = str(root.resolve())
    for row in doc["namespaces"]:
        ns = row["namespace"]
        assert value(m, "kvpersist_namespace_bytes", namespace=ns, root=r) == row["bytes"]
        assert value(m, "kvpersist_namespace_files", namespace=ns, root=r) == row["files"]
        assert value(m, "kvpersist_namespace_allocated_bytes", namespace=ns,
                     root=r) == row["allocated_bytes"]
        assert value(m, "kvpersist_namespace_info", namespace=ns, root=r) == 1
        assert value(m, "kvpersist_namespace_active", namespace=ns, root=r) == 0
    assert value(m, "kvpersist_namespace_bytes", namespace=NS) == 3000
    oldest = value(m, "kvpersist_namespace_oldest_chunk_timestamp_seconds", namespace=NS)
    newest = value(m, "kvpersist_namespace_newest_chunk_timestamp_seconds", namespace=NS)
    assert time.time() - oldest == pytest.approx(3 * 7200, abs=120)
    assert time.time() - newest == pytest.approx(7200, abs=120)
    assert value(m, "kvpersist_temp_files", root=r) == 1 == doc["temp"]["files"]
    assert value(m, "kvpersist_temp_bytes", root=r) == 10
    assert time.time() - value(m, "kvpersist_temp_oldest_timestamp_seconds") == \
        pytest.approx(5000, abs=120)
    assert value(m, "kvpersist_foreign_files", root=r) == 1 == doc["foreign"]["files"]
    assert value(m, "kvpersist_quarantined_files", root=r) == 1
    assert value(m, "kvpersist_quarantined_bytes", root=r) == 77
    assert doc["quarantine"] == {"files": 1, "bytes": 77}
    assert value(m, "kvpersist_l2_used_bytes", root=r) == doc["chunk_bytes"] + 10
    assert value(m, "kvpersist_filesystem_size_bytes",
                 root=r) == doc["filesystem"]["total_bytes"]
    assert value(m, "kvpersist_scan_entries", root=r) == doc["entries"] >= 8
    assert value(m, "kvpersist_scan_errors", root=r) == 0
    assert abs(value(m, "kvpersist_metrics_timestamp_seconds", root=r) - time.time()) < 60
    # never run: no sample (an alert can tell "never" from "long ago" with absent())
    assert "kvpersist_last_verify_timestamp_seconds" not in names(m)
    assert "kvpersist_last_prune_timestamp_seconds" not in names(m)
    # no deployment on this root: no budget figure, no health series
    assert "kvpersist_l2_budget_bytes" not in names(m)
    assert not any(n.startswith("kvpersist_deployment_") for n in names(m))


def test_the_exposition_passes_promtool(root: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is installed by scripts/setup.sh"
    res = kvp("metrics", "--root", str(root))
    assert res.returncode == 0, res.stderr
    chk = subprocess.run([promtool, "check", "metrics"], input=res.stdout, text=True,
                         capture_output=True, timeout=60)
    assert chk.returncode == 0, chk.stdout + chk.stderr


def demo_env(root: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
                "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
                **extra})
    return env


def test_textfiles_per_root_and_per_deployment(tmp_path: Path, root: Path) -> None:
    chunk_file(root, DEMO_NS, 1, 4096)
    out = tmp_path / "textfile"
    out.mkdir()
    env = demo_env(root)
    res = kvp("metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5", "--textfile", str(out),
              env=env, umask=0o077)
    assert res.returncode == 0, res.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([textfile_name_for_root(str(root.resolve())),
                            "kvpersist-deployment-cpu-demo.prom"]), files
    for p in out.iterdir():
        # node_exporter runs as another user: the files are world-readable whatever the umask
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    r = samples((out / textfile_name_for_root(str(root.resolve()))).read_text())
    d = samples((out / "kvpersist-deployment-cpu-demo.prom").read_text())
    # no series in both files (node_exporter rejects duplicates across files)
    assert not set(r) & set(d)
    assert value(r, "kvpersist_namespace_active", namespace=DEMO_NS) == 1
    assert value(r, "kvpersist_namespace_active", namespace=NS) == 0
    info = [lab for (n, lab) in r if n == "kvpersist_namespace_info"
            and ("namespace", DEMO_NS) in lab]
    assert dict(info[0])["model_id"] == "kvpersist/cpu-demo-llama"
    assert dict(info[0])["config"] == "cpu-demo"
    assert dict(info[0])["tensor_parallel_size"] == "1"
    assert value(r, "kvpersist_l2_budget_bytes") > 0
    assert value(r, "kvpersist_l2_limit_bytes") <= value(r, "kvpersist_l2_budget_bytes")
    assert value(r, "kvpersist_l2_reserve_bytes") > 0
    # the cache server is not running: down, and no vLLM series with --no-vllm
    assert value(d, "kvpersist_deployment_health", config="cpu-demo", namespace=DEMO_NS) == 2
    assert value(d, "kvpersist_cache_server_up", config="cpu-demo") == 0
    assert value(d, "kvpersist_component_health", component="cache_server") == 2
    assert value(d, "kvpersist_component_health", component="cache_root") == 0
    assert "kvpersist_vllm_up" not in names(d)
    # the same again: files replaced, nothing else left behind
    assert kvp("metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5", "--textfile", str(out),
               env=env).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == files


def test_a_missing_root_still_exports_health_and_exits_1(tmp_path: Path) -> None:
    out = tmp_path / "textfile"
    out.mkdir()
    env = demo_env(tmp_path / "no-such-root")
    res = kvp("metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5", "--textfile", str(out),
              env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "no such directory" in res.stderr
    assert [p.name for p in out.iterdir()] == ["kvpersist-deployment-cpu-demo.prom"]
    d = samples((out / "kvpersist-deployment-cpu-demo.prom").read_text())
    assert value(d, "kvpersist_component_health", component="cache_root") == 2
    assert not (tmp_path / "no-such-root").exists()


def test_a_missing_textfile_directory_is_a_clean_error(tmp_path: Path, root: Path) -> None:
    """A usage error naming the option (exit 2, issue 40: every usage error is 2)."""
    res = kvp("metrics", "--root", str(root), "--textfile", str(tmp_path / "nope"))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "--textfile" in res.stderr
    assert not (tmp_path / "nope").exists()


def test_a_textfile_directory_that_is_a_symlink_is_refused(tmp_path: Path, root: Path) -> None:
    """Decided (issue 40): kvpersist writes no file through a symbolic link, the textfile
    directory included (before, ``--textfile LINK`` wrote into the link's target). The
    directory itself, named by its real path, is written as before."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "textfiles"
    link.symlink_to(target)
    res = kvp("metrics", "--root", str(root), "--textfile", str(link))
    assert res.returncode == 2 and "symbolic link" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and list(target.iterdir()) == []
    ok = kvp("metrics", "--root", str(root), "--textfile", str(target))
    assert ok.returncode == 0, ok.stderr
    files = list(target.iterdir())
    assert len(files) == 1 and files[0].name.startswith("kvpersist-root-")
    assert files[0].stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- runs


def test_runs_round_trip_and_metrics(root: Path) -> None:
    assert read_runs_at(root) == ({}, [])
    assert record_run_at(root, "verify", ok=False, counts={"findings": 3}, mode="check",
                           finished_ns=1_700_000_000 * 10**9) is None
    assert record_run_at(root, "prune", ok=True, counts={"deleted_bytes": 4096},
                           mode="apply") is None
    got, problems = read_runs_at(root)
    assert problems == [] and set(got) == {"verify", "prune"}
    assert got["verify"]["ok"] is False and got["verify"]["counts"] == {"findings": 3}
    d = root / ".kvpersist" / "runs"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "verify.json").stat().st_mode) == 0o600
    assert sorted(p.name for p in d.iterdir()) == ["prune.json", "verify.json"]
    m = samples(kvp("metrics", "--root", str(root)).stdout)
    assert value(m, "kvpersist_last_verify_timestamp_seconds") == 1_700_000_000
    assert value(m, "kvpersist_last_verify_success") == 0
    assert value(m, "kvpersist_last_verify_findings") == 3
    assert value(m, "kvpersist_last_verify_moved") == 0  # a run recorded without the count
    assert value(m, "kvpersist_last_prune_success") == 1
    assert value(m, "kvpersist_last_prune_deleted_bytes") == 4096
    assert abs(value(m, "kvpersist_last_prune_timestamp_seconds") - time.time()) < 60


def test_runs_are_never_written_through_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / ".kvpersist").symlink_to(elsewhere)
    warning = record_run_at(root, "verify", ok=True, counts={})
    assert warning and "symbolic link" in warning
    assert list(elsewhere.iterdir()) == []
    assert read_runs_at(root)[0] == {}


@pytest.mark.parametrize("bad", ["garbage", "dir", "fifo", "symlink", "wrong-kind", "huge"])
def test_a_record_that_is_not_ours_is_ignored(tmp_path: Path, root: Path, bad: str) -> None:
    d = root / ".kvpersist" / "runs"
    d.mkdir(parents=True)
    target = d / "verify.json"
    if bad == "garbage":
        target.write_text("{not json")
    elif bad == "dir":
        target.mkdir()
    elif bad == "fifo":
        os.mkfifo(target)
    elif bad == "symlink":
        secret = tmp_path / "secret.json"
        secret.write_text(json.dumps(runs.run_record("verify", ok=True, finished_ns=1,
                                                     counts={})))
        target.symlink_to(secret)
    elif bad == "wrong-kind":
        target.write_text(json.dumps(runs.run_record("prune", ok=True, finished_ns=1,
                                                     counts={})))
    else:
        target.write_text(" " * (1 << 17))
    got, problems = read_runs_at(root)
    assert "verify" not in got and len(problems) == 1, problems
    res = kvp("metrics", "--root", str(root))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "kvpersist_last_verify_timestamp_seconds" not in names(samples(res.stdout))


def test_verify_and_prune_record_their_runs(tmp_path: Path, root: Path) -> None:
    from kvpersist.l2.keys.store import ensure_key

    env = demo_env(root)
    # the deployment's key, where its default state dir keeps it (beside the root)
    ensure_key(tmp_path / ".kvpersist" / "cache" / "keys" / "l2-master.key")
    v = kvp("verify", "cpu-demo", "--json", env=env)
    assert v.returncode in (0, 1), v.stderr
    got, _ = read_runs_at(root)
    assert got["verify"]["mode"] == "check"
    assert got["verify"]["counts"]["files"] == json.loads(v.stdout)["files"]
    assert got["verify"]["ok"] is (v.returncode == 0)
    # a dry-run prune is not a prune
    assert kvp("prune", "--root", str(root), "--namespace", OTHER).returncode == 0
    assert "prune" not in read_runs_at(root)[0]
    p = kvp("prune", "--root", str(root), "--namespace", OTHER, "--apply", "--json")
    assert p.returncode == 0, p.stderr
    rec = read_runs_at(root)[0]["prune"]
    assert rec["ok"] is True and rec["counts"]["deleted_bytes"] == 500
    assert rec["counts"]["deleted_files"] == 1


def test_a_root_this_user_cannot_write_still_verifies(tmp_path: Path) -> None:
    """Recording is best effort: the run stands, a warning says it was not recorded."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    (root / ".kvpersist").mkdir(mode=0o755)
    assert record_run_at(root, "prune", ok=True, counts={}) is None
    os.chmod(root / ".kvpersist" / "runs", 0o555)
    try:
        if os.geteuid() == 0:
            # root writes anywhere: take the write bit away from a directory it cannot open
            os.chmod(root / ".kvpersist" / "runs", 0o000)
            # the use case opened the root (its handle), then records as another user
            res = subprocess.run(
                [sys.executable, "-c",
                 "import os; from kvpersist.l2 import runs; "
                 "from kvpersist.l2.tree import open_root; "
                 f"r = open_root({str(root)!r}); "
                 "os.setgroups([]); os.setresgid(65534, 65534, 65534); "
                 "os.setresuid(65534, 65534, 65534); "
                 "print(runs.record_run(r, 'prune', ok=True, counts={}))"],
                capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=60)
            assert res.returncode == 0, res.stderr
            assert "not recorded" in res.stdout
        else:
            warning = record_run_at(root, "prune", ok=True, counts={})
            assert warning and "not recorded" in warning
    finally:
        os.chmod(root / ".kvpersist" / "runs", 0o700)


# --------------------------------------------------------------------------- components


@pytest.mark.parametrize(("check", "component"), [
    ("lmcache.healthcheck", "cache_server"), ("lmcache.listen", "cache_server"),
    ("l2.serde", "cache_server"),
    ("cache_root", "cache_root"), ("cache_root.budget", "cache_root"),
    ("vllm", "vllm"), ("vllm.health", "vllm"), ("vllm.models", "vllm"),
    ("vllm.kv_transfer", "wiring"), ("vllm.persistence", "wiring"),
    ("network.lmcache", "wiring"),
])
def test_component_of(check: str, component: str) -> None:
    assert component_of(check) == component


def test_component_status_is_the_worst_check() -> None:
    checks = [Check("lmcache.healthcheck", "ok", ""), Check("lmcache.run_script", "degraded", ""),
              Check("cache_root.permissions", "ok", ""), Check("vllm", "skipped", ""),
              Check("vllm.persistence", "down", ""), Check("vllm.kv_transfer", "ok", "")]
    assert component_status(checks) == {"cache_server": "degraded", "cache_root": "ok",
                                        "vllm": "skipped", "wiring": "down"}
    assert component_status([]) == {}


def test_health_json_has_the_components(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    res = kvp("health", "cpu-demo", "--json", "--no-vllm", "--timeout", "0.5",
              env=demo_env(root))
    doc: dict[str, Any] = json.loads(res.stdout)
    assert res.returncode == 2
    assert doc["components"] == {"cache_server": "down", "cache_root": "ok", "vllm": "skipped"}


# --------------------------------------------------------------------------- shared tier

STORE = "10.0.0.7:6379"


def store_text(facts: Any) -> str:
    from prometheus_client import generate_latest

    from kvpersist.actions.metrics import Exposition, store_families

    exp = Exposition()
    store_families(exp, facts, 1_800_000_000.0)
    return generate_latest(exp.registry()).decode()


def up_store(active: frozenset[str] = frozenset()) -> Any:
    from kvpersist.actions.metrics import StoreFacts
    from kvpersist.l2.shared.store import NodeMemory, SharedUsage, StoreMeasurement, StoreProbe
    from kvpersist.l2.shared.wire import plan_store_budget

    nodes = (NodeMemory("10.0.0.7:6379", 700, 1000, "allkeys-lru", 12),
             NodeMemory("10.0.0.8:6379", 50, 0, "noeviction", 0))
    usage = SharedUsage({NS: [3, 3 * 4096], OTHER: [1, 77]}, other_keys=2)
    probe = StoreProbe(True, True, 1.5, plan_store_budget([1000, 0], [700, 50],
                                                          ["allkeys-lru", "noeviction"]),
                       nodes=nodes)
    return StoreFacts(STORE, StoreMeasurement(probe, usage, 0.25), active)


def test_store_series_are_the_measurement() -> None:
    active_ns = "kvp-" + "ef" * 16  # a configured namespace with no keys yet: 0, not absent
    m = samples(store_text(up_store(frozenset({NS, active_ns}))))
    assert value(m, "kvpersist_shared_tier_up", store=STORE) == 1
    assert value(m, "kvpersist_shared_tier_reachable", store=STORE) == 1
    assert value(m, "kvpersist_shared_tier_probe_latency_seconds", store=STORE) == 0.0015
    assert value(m, "kvpersist_shared_tier_namespace_keys", namespace=NS) == 3
    assert value(m, "kvpersist_shared_tier_namespace_bytes", namespace=NS) == 3 * 4096
    assert value(m, "kvpersist_shared_tier_namespace_keys", namespace=OTHER) == 1
    assert value(m, "kvpersist_shared_tier_namespace_bytes", namespace=OTHER) == 77
    assert value(m, "kvpersist_shared_tier_namespace_keys", namespace=active_ns) == 0
    assert value(m, "kvpersist_shared_tier_namespace_bytes", namespace=active_ns) == 0
    assert value(m, "kvpersist_shared_tier_other_keys", store=STORE) == 2
    assert value(m, "kvpersist_shared_tier_scan_duration_seconds", store=STORE) == 0.25
    # per node: memory, maxmemory, the policy as an info series, evictions as a counter
    a, b = {"store": STORE, "node": "10.0.0.7:6379"}, {"store": STORE, "node": "10.0.0.8:6379"}
    assert value(m, "kvpersist_shared_tier_used_memory_bytes", **a) == 700
    assert value(m, "kvpersist_shared_tier_maxmemory_bytes", **a) == 1000
    assert value(m, "kvpersist_shared_tier_maxmemory_bytes", **b) == 0
    assert value(m, "kvpersist_shared_tier_node_info", maxmemory_policy="allkeys-lru", **a) == 1
    assert value(m, "kvpersist_shared_tier_node_info", maxmemory_policy="noeviction", **b) == 1
    assert value(m, "kvpersist_shared_tier_evicted_keys_total", **a) == 12
    assert value(m, "kvpersist_metrics_timestamp_seconds", store=STORE, root="",
                 config="") == 1_800_000_000
    # every series of the store carries its label, and nothing else carries a root or config
    for (name, labels), _ in m.items():
        assert ("store", STORE) in labels, name
        assert not {k for k, v in labels if k in ("root", "config") and v}, name


@pytest.mark.parametrize("case", ["down", "refused", "unreadable_secret", "scan_failed"])
def test_a_store_that_cannot_be_measured_exports_up_0_and_no_figures(case: str) -> None:
    from kvpersist.actions.metrics import StoreFacts
    from kvpersist.l2.shared.store import StoreMeasurement, StoreProbe

    measured = {
        "down": StoreMeasurement(StoreProbe(False, False, error="connection refused")),
        "refused": StoreMeasurement(StoreProbe(True, False, error="WRONGPASS")),
        "unreadable_secret": None,
        "scan_failed": StoreMeasurement(up_store().measured.probe, error="scan failed: timeout"),
    }[case]
    facts = StoreFacts(STORE, measured, frozenset({NS}), "why")
    assert not facts.complete
    m = samples(store_text(facts))
    up = 1 if case == "scan_failed" else 0
    assert value(m, "kvpersist_shared_tier_up", store=STORE) == up
    reachable = {"down": [0.0], "refused": [1.0], "unreadable_secret": [],
                 "scan_failed": [1.0]}[case]
    assert [v for (n, _), v in m.items() if n == "kvpersist_shared_tier_reachable"] == reachable
    assert "kvpersist_shared_tier_namespace_keys" not in names(m)
    assert "kvpersist_shared_tier_namespace_bytes" not in names(m)
    assert "kvpersist_shared_tier_other_keys" not in names(m)
    assert "kvpersist_shared_tier_scan_duration_seconds" not in names(m)
    assert ("kvpersist_shared_tier_probe_latency_seconds" in names(m)) is (case == "scan_failed")
    assert value(m, "kvpersist_metrics_timestamp_seconds", store=STORE) == 1_800_000_000


def test_the_store_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is installed by scripts/setup.sh"
    chk = subprocess.run([promtool, "check", "metrics"], input=store_text(up_store()),
                         text=True, capture_output=True, timeout=60)
    assert chk.returncode == 0, chk.stdout + chk.stderr
    assert chk.stdout + chk.stderr == ""


def test_a_store_that_is_down_writes_up_0_and_the_other_files_and_exits_1(
        tmp_path: Path, root: Path) -> None:
    """Nothing listens on the store's port (a real refused connection): the run still writes
    every file, the store's with up 0, says why and exits 1 as for a root it cannot measure;
    the password is in no output."""
    from kvpersist.actions.metrics import textfile_name_for_store

    password = "s3cret-" + os.urandom(8).hex()
    secret = tmp_path / "shared.secret"
    secret.write_text(f"username=kvp-fleet\npassword={password}\n")
    secret.chmod(0o600)
    port = free_port()
    env = demo_env(root, KVP_SHARED_TIER=f"valkey://127.0.0.1:{port}",
                   KVP_SHARED_TIER_SECRET_FILE=str(secret))
    out = tmp_path / "textfile"
    out.mkdir()
    res = kvp("metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5", "--textfile", str(out),
              env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"shared tier 127.0.0.1:{port}" in res.stderr and "up 0" in res.stderr
    store_file = out / textfile_name_for_store(f"127.0.0.1:{port}")
    assert sorted(p.name for p in out.iterdir()) == sorted([
        textfile_name_for_root(str(root.resolve())), store_file.name,
        "kvpersist-deployment-cpu-demo.prom"])
    s = samples(store_file.read_text())
    assert value(s, "kvpersist_shared_tier_up", store=f"127.0.0.1:{port}") == 0
    assert value(s, "kvpersist_shared_tier_reachable") == 0
    d = samples((out / "kvpersist-deployment-cpu-demo.prom").read_text())
    assert value(d, "kvpersist_component_health", component="shared_tier") == 1
    assert value(d, "kvpersist_deployment_shared_tier_info", store=f"127.0.0.1:{port}",
                 adapter="resp", config="cpu-demo", namespace=DEMO_NS) == 1
    r = samples((out / textfile_name_for_root(str(root.resolve()))).read_text())
    assert value(r, "kvpersist_namespace_bytes", namespace=NS) == 3000
    # stdout too: the same exit, up 0 in the exposition
    res2 = kvp("metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5", env=env)
    assert res2.returncode == 1
    assert value(samples(res2.stdout), "kvpersist_shared_tier_up") == 0
    for text in [res.stdout, res.stderr, res2.stdout, res2.stderr,
                 *(p.read_text() for p in out.iterdir())]:
        assert password not in text


def test_an_unreadable_secret_file_is_not_a_traceback(tmp_path: Path, root: Path) -> None:
    secret = tmp_path / "shared.secret"
    secret.write_text("username=kvp-fleet\npassword=pw\n")
    secret.chmod(0o644)  # readable by others: refused, the store is not contacted
    env = demo_env(root, KVP_SHARED_TIER=f"valkey://127.0.0.1:{free_port()}",
                   KVP_SHARED_TIER_SECRET_FILE=str(secret))
    res = kvp("metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5", env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "readable by others" in res.stderr
    m = samples(res.stdout)
    assert value(m, "kvpersist_shared_tier_up") == 0
    assert "kvpersist_shared_tier_reachable" not in names(m)
