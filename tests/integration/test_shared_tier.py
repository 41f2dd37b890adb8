"""The shared tier with real parts: Debian's redis-server (ACL user + password) and two stock
``lmcache server`` processes started by ``kvp-admin launch`` with different cache roots,
standing in for two hosts. LMCache's own MP client stack drives them (kvpersist.demo.kvdriver).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests

from kvpersist.config.shared_tier import ACL_CLUSTER_RULES, ACL_RULES
from kvpersist.demo.kvdriver import connect

from ..fullstack._stack import Stack, wait_until
from ._redis import Redis, start_redis

pytestmark = pytest.mark.integration


def host(tmp: Path, name: str, redis: Redis) -> Stack:
    d = tmp / name
    d.mkdir(mode=0o700)
    secret = redis.write_secret(d / "shared.secret")
    return Stack(d, KVP_SHARED_TIER=redis.url, KVP_SHARED_TIER_SECRET_FILE=str(secret))


def share_key(a: Stack, b: Stack) -> None:
    """A's key of its namespace becomes B's (the role's serde_keys does this on a fleet)."""
    [src] = a.state_dir.glob("keys/kvp-*/l2-master.key")
    dst = b.state_dir / "keys" / src.parent.name / "l2-master.key"
    dst.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    dst.parent.mkdir(exist_ok=True, mode=0o700)
    b.state_dir.chmod(0o700)
    b.state_dir.parent.chmod(0o700)
    dst.write_bytes(src.read_bytes())
    dst.chmod(0o600)


def proc_as_nobody() -> bytes:
    """Every /proc/*/cmdline and /proc/*/environ that user 65534 can read, concatenated."""
    script = ("for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do cat \"$f\"; "
              "printf '\\n'; done 2>/dev/null; true")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "sh", "-c", script], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_chunks_stored_on_host_a_hit_on_host_b(tmp_path: Path) -> None:
    """Through LMCache's resp adapter, with a user that has exactly the recommended ACL."""
    redis = start_redis(tmp_path / "store", acl=ACL_RULES)
    a, b = host(tmp_path, "a", redis), host(tmp_path, "b", redis)
    try:
        ns = a.render()["namespace"]
        assert b.render()["namespace"] == ns  # the same identity on both hosts
        a.launch("--no-vllm")
        with connect(a.rpc, a.http, ns) as d:
            stored = {seq: d.store(seq) for seq in (1, 2)}
        a.stop()
        # the fleet shares one serde key (the role distributes it): B decrypts A's chunks
        share_key(a, b)
        keys = redis.scan_keys(f"{ns}@*")
        assert len(keys) == 8 and len(a.chunk_files(ns + "_")) == 8  # both tiers
        assert redis.scan_keys() == keys  # nothing outside the namespace's pattern

        b.launch("--no-vllm")
        assert b.chunk_files() == []  # host B's NVMe starts empty
        # the secret is nowhere another user can read while both kinds of process run
        seen = proc_as_nobody()
        assert redis.password.encode() not in seen
        assert b"kvpersist.stack.lmcache_exec" in seen  # the launcher is what runs
        with connect(b.rpc, b.http, ns) as d:
            for seq, digests in stored.items():
                lk, got = d.lookup_and_retrieve(seq)
                assert (lk.hit_chunks, lk.total_chunks) == (4, 4)
                assert got == digests  # the same bytes, through the aesgcm serde
        # resp reads the credentials from its process environment: not in GET /config
        assert redis.password not in requests.get(f"{b.http}/config", timeout=10).text
        with connect(b.rpc, b.http, "kvp-" + "0" * 32) as other:
            assert other.lookup(1).hit_chunks == 0  # another identity gets nothing
        for text in (b.server_log.read_text(errors="replace"),
                     a.server_log.read_text(errors="replace"),
                     json.dumps(b.render())):
            assert redis.password not in text
        b.stop()
        assert acl_refusals(redis) == set()  # every command the resp adapter sent
    finally:
        a.cleanup()
        b.cleanup()
        redis.stop()



def acl_refusals(r: Redis) -> set[tuple[str, str, str]]:
    """(reason, object, user) of every refusal in the ACL LOG of every node."""
    return {(e["reason"], e["object"], e["username"]) for n in r.nodes
            for e in json.loads(n.cli("--json", "acl", "log", "128") or "[]")}


def health(s: Stack) -> tuple[int, dict[str, object]]:
    r = s.kvp("health", s.config, "--no-vllm", "--json")
    return r.returncode, json.loads(r.stdout)


def test_store_down_degrades_recovers_report_and_prune(tmp_path: Path, redis: Redis) -> None:
    b = host(tmp_path, "b", redis)
    try:
        ns = b.render()["namespace"]
        b.launch("--no-vllm")
        code, doc = health(b)
        assert code == 0 and doc["components"]["shared_tier"] == "ok", doc  # type: ignore[index]
        with connect(b.rpc, b.http, ns) as d:
            first = d.store(1)
        assert wait_until(lambda: len(redis.scan_keys(f"{ns}@*")) == 4, 30)
        redis.kill()
        # the store is gone: the server keeps serving and storing on L1 and the NVMe
        with connect(b.rpc, b.http, ns) as d:
            assert len(d.store(2)) == 4
            lk, got = d.lookup_and_retrieve(1)
            assert lk.hit_chunks == 4 and got == first
        assert wait_until(lambda: len(b.chunk_files(ns + "_")) == 8, 30)  # nothing local lost
        code, doc = health(b)
        assert code == 1 and doc["status"] == "degraded", doc
        assert doc["components"] == {**doc["components"], "shared_tier": "degraded",  # type: ignore[dict-item]
                                     "cache_server": "ok"}, doc
        redis.restart()
        assert len(redis.scan_keys(f"{ns}@*")) == 4  # the store's AOF kept what it had
        code, doc = health(b)
        assert code == 0, doc
        # hits resume from the shared tier once the NVMe copy is gone
        for f in b.chunk_files(ns + "_"):
            f.unlink()
        b.stop()
        b.launch("--no-vllm")
        with connect(b.rpc, b.http, ns) as d:
            lk, got = d.lookup_and_retrieve(1)
            assert lk.hit_chunks == 4 and got == first

        # report and prune on the shared tier: per namespace, dry run first, then exactly it
        redis.nodes[0].cli("set", "kvp-" + "e" * 32 + "@01000100@0@ab", "x")
        redis.nodes[0].cli("set", "unrelated", "y")
        rep = b.kvp_json("report", "--tier", "shared", "--config", b.config)
        rows = {r["namespace"]: r for r in rep["namespaces"]}
        assert rows[ns]["keys"] == 4 and rows[ns]["active"] and rows[ns]["bytes"] > 4 * 65536
        assert rep["other_keys"] == 1 and rep["store"]["eviction_policies"] == ["allkeys-lru"]
        refused = b.kvp("prune", "--tier", "shared", "--config", b.config, "--namespace", ns,
                        "--apply")
        assert refused.returncode == 2 and "--force" in refused.stderr
        other = "kvp-" + "e" * 32
        dry = b.kvp_json("prune", "--tier", "shared", "--config", b.config,
                         "--namespace", other)
        assert dry["dry_run"] and dry["deleted_keys"] == 1
        assert len(redis.scan_keys(f"{other}@*")) == 1
        done = b.kvp_json("prune", "--tier", "shared", "--config", b.config,
                          "--namespace", other, "--apply")
        assert done["deleted_keys"] == 1 and redis.scan_keys(f"{other}@*") == []
        assert len(redis.scan_keys(f"{ns}@*")) == 4 and "unrelated" in redis.scan_keys()
        again = b.kvp_json("prune", "--tier", "shared", "--config", b.config,
                           "--namespace", other, "--apply")
        assert again["deleted_keys"] == 0  # idempotent
        # a lock held by another host refuses the prune
        redis.nodes[0].cli("set", f"kvpersist-lock:prune:{ns}", "hostX:1:ab", "px", "60000")
        locked = b.kvp("prune", "--tier", "shared", "--config", b.config, "--namespace", ns,
                       "--apply", "--force")
        assert locked.returncode == 1 and "hostX" in locked.stderr
        redis.nodes[0].cli("del", f"kvpersist-lock:prune:{ns}")
        b.stop()
    finally:
        b.cleanup()


def test_launch_refuses_a_store_that_would_not_evict(tmp_path: Path) -> None:
    r = start_redis(tmp_path / "store", policy="noeviction")
    try:
        b = host(tmp_path, "b", r)
        res = b.kvp("launch", b.config, "--no-vllm")
        assert res.returncode == 2, res.stderr
        assert "noeviction" in res.stderr and "allkeys-lru" in res.stderr
        assert r.password not in res.stderr + res.stdout
        b.cleanup()
    finally:
        r.stop()


def test_cluster_mode_through_the_valkey_adapter(tmp_path: Path) -> None:
    """A 3-primary cluster (redis-cli --cluster create): LMCache's valkey adapter with an ACL
    user (the launcher compensates 0.5.6's swapped credentials) that has exactly the
    recommended cluster ACL, keys spread over every node, report and prune by SCAN on each
    primary; no command was refused on any node."""
    r = start_redis(tmp_path / "store", cluster=True,
                    acl=f"{ACL_RULES} {ACL_CLUSTER_RULES}")
    a, b = host(tmp_path, "a", r), host(tmp_path, "b", r)
    try:
        shown = a.render()
        ns = shown["namespace"]
        assert shown["shared_tier"]["adapter"] == "valkey" and shown["shared_tier"]["cluster"]
        a.launch("--no-vllm")
        with connect(a.rpc, a.http, ns) as d:
            stored = {seq: d.store(seq) for seq in (1, 2, 3)}
        a.stop()
        share_key(a, b)
        per_node = [n.cli("--scan", "--pattern", f"{ns}@*").split() for n in r.nodes]
        assert sum(len(k) for k in per_node) == 12 and sum(1 for k in per_node if k) >= 2
        b.launch("--no-vllm")
        assert r.password.encode() not in proc_as_nobody()
        with connect(b.rpc, b.http, ns) as d:
            for seq, digests in stored.items():
                lk, got = d.lookup_and_retrieve(seq)
                assert lk.hit_chunks == 4 and got == digests
        code, doc = health(b)
        assert code == 0 and doc["shared_tier"]["budget"]["nodes"] == 3, doc  # type: ignore[index]
        # the known limit of LMCache's valkey adapter (docs/fleet.md, Secrets): its JSON
        # fields, credentials included, are shown by GET /config on the loopback admin port
        assert r.password in requests.get(f"{b.http}/config", timeout=10).text
        b.stop()
        rep = b.kvp_json("report", "--tier", "shared", "--config", b.config)
        assert [(x["namespace"], x["keys"]) for x in rep["namespaces"]] == [(ns, 12)]
        done = b.kvp_json("prune", "--tier", "shared", "--config", b.config, "--namespace", ns,
                          "--apply", "--force")
        assert done["deleted_keys"] == 12 and r.scan_keys(f"{ns}@*") == []
        assert acl_refusals(r) == set()
    finally:
        a.cleanup()
        b.cleanup()
        r.stop()
