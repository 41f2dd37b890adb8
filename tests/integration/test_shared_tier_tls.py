"""The shared tier over TLS with the least-privilege ACL user (docs/fleet.md, "Secrets"): a
real TLS-only redis-server (plaintext port 0, a throwaway CA made by ``openssl``) whose
deployment user has exactly ``ACL_RULES``; two stock ``lmcache server`` processes started by
``kvp-admin launch`` (LMCache's valkey adapter, glide trusting the CA through the launcher's
in-process ``SSL_CERT_FILE``); ``report``, ``prune`` and ``health`` through redis-py with the
same CA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpersist.config.shared_tier import ACL_RULES
from kvpersist.demo.kvdriver import Lookup, connect

from ..fullstack._stack import wait_until
from ._redis import make_ca, make_tls, start_redis
from .test_shared_tier import acl_refusals, health, host, proc_as_nobody, share_key

pytestmark = pytest.mark.integration


def test_tls_and_least_privilege_acl(tmp_path: Path) -> None:
    r = start_redis(tmp_path / "store", tls=True, acl=ACL_RULES)
    a, b = host(tmp_path, "a", r), host(tmp_path, "b", r)
    try:
        assert r.tls is not None and "tls=1" in r.url
        shown = a.render()
        ns = shown["namespace"]
        tier = shown["shared_tier"]
        assert (tier["adapter"], tier["tls"], tier["tls_ca"]) == ("valkey", True, str(r.tls.ca))
        a.launch("--no-vllm")
        with connect(a.rpc, a.http, ns) as d:
            stored = {seq: d.store(seq) for seq in (1, 2)}
        assert wait_until(lambda: len(r.scan_keys(f"{ns}@*")) == 8, 60)
        a.stop()
        share_key(a, b)
        b.launch("--no-vllm")
        assert r.password.encode() not in proc_as_nobody()
        # launch wrote B's fleet record and its index entry with the narrowed user
        assert f"kvpersist-fleet:{ns}" in r.scan_keys("kvpersist-fleet:*")
        with connect(b.rpc, b.http, ns) as d:
            for seq, digests in stored.items():
                lk, got = d.lookup_and_retrieve(seq)
                assert (lk.hit_chunks, lk.total_chunks) == (4, 4)
                assert got == digests  # over TLS, through the aesgcm serde
        # a namespace outside the user's key patterns: the store refuses LMCache's writes
        # (NOPERM); the server keeps it on L1 and its NVMe
        outside = "other-" + "1" * 32
        with connect(b.rpc, b.http, outside) as d:
            assert len(d.store(3)) == 4
        assert wait_until(lambda: len(b.chunk_files(outside + "_")) == 4, 60)
        assert r.scan_keys("other-*") == []
        code, doc = health(b)
        assert code == 0 and doc["components"]["shared_tier"] == "ok", doc  # type: ignore[index]
        b.stop()

        rep = b.kvp_json("report", "--tier", "shared", "--config", b.config)
        assert [(x["namespace"], x["keys"]) for x in rep["namespaces"]] == [(ns, 8)]
        assert rep["store"]["eviction_policies"] == ["allkeys-lru"]
        dry = b.kvp_json("prune", "--tier", "shared", "--config", b.config, "--namespace", ns,
                         "--force")
        assert dry["dry_run"] and dry["deleted_keys"] == 8
        done = b.kvp_json("prune", "--tier", "shared", "--config", b.config, "--namespace", ns,
                          "--apply", "--force")
        assert done["deleted_keys"] == 8 and r.scan_keys(f"{ns}@*") == []
        assert r.scan_keys("kvpersist-lock:*") == []  # the lock was released
        # every command the adapters and kvpersist sent was allowed: the ACL log holds only
        # the refused keys of the namespace outside the patterns
        denials = acl_refusals(r)
        assert denials and all(reason == "key" and obj.startswith(outside) and user == r.user
                               for reason, obj, user in denials), denials
    finally:
        a.cleanup()
        b.cleanup()
        r.stop()


def test_a_wrong_ca_refuses_launch_and_later_degrades_health(tmp_path: Path) -> None:
    """At launch a CA that does not vouch for the store's certificate is refused (stock
    LMCache's valkey adapter would exit while starting: glide's "invalid peer certificate:
    UnknownIssuer"). Once running, a store certificate the CA does not vouch for (replaced
    by one of another CA) makes health degraded, never down: the server keeps serving from
    L1 and the NVMe."""
    r = start_redis(tmp_path / "store", tls=True)
    wrong, _ = make_ca(tmp_path / "wrong", "another CA")
    assert r.tls is not None
    b = host(tmp_path, "b", r)
    b.env["KVP_SHARED_TIER"] = r.url.replace(str(r.tls.ca), str(wrong))
    try:
        refused = b.kvp("launch", b.config, "--no-vllm")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "certificate not trusted" in refused.stderr and "tls_ca" in refused.stderr
        assert not b.pid_file.exists()
        b.env["KVP_SHARED_TIER"] = r.url
        b.launch("--no-vllm")
        ns = b.render()["namespace"]
        with connect(b.rpc, b.http, ns) as d:
            first = d.store(1)
        assert wait_until(lambda: len(r.scan_keys(f"{ns}@*")) == 4, 60)
        # the store comes back with a certificate of another CA
        right = r.tls
        r.stop()
        other = make_tls(tmp_path / "tls2")
        for n in r.nodes:
            n.tls = other
        r.restart()
        code, doc = health(b)
        assert code == 1 and doc["status"] == "degraded", doc
        assert doc["components"]["shared_tier"] == "degraded", doc  # type: ignore[index]
        assert doc["components"]["cache_server"] == "ok", doc  # type: ignore[index]
        assert "certificate not trusted" in json.dumps(doc["checks"])
        with connect(b.rpc, b.http, ns) as d:  # the server keeps storing to its NVMe
            assert len(d.store(2)) == 4
        assert wait_until(lambda: len(b.chunk_files(ns + "_")) == 8, 60)
        assert len(r.scan_keys(f"{ns}@*")) == 4  # nothing more reached the store
        # the store's own certificate again: healthy, and the shared tier serves again
        r.stop()
        for n in r.nodes:
            n.tls = right
        r.restart()
        code, doc = health(b)
        assert code == 0, doc
        with connect(b.rpc, b.http, ns) as d:
            assert wait_until(lambda: d.lookup_and_retrieve(1) == (Lookup(4, 4), first), 120,
                              interval=1)
        b.stop()
    finally:
        b.cleanup()
        r.stop()


def test_launch_refuses_a_ca_file_others_can_change(tmp_path: Path) -> None:
    r = start_redis(tmp_path / "store", tls=True)
    assert r.tls is not None
    b = host(tmp_path, "b", r)
    try:
        r.tls.ca.chmod(0o666)
        res = b.kvp("launch", b.config, "--no-vllm")
        assert res.returncode == 2, res.stdout + res.stderr
        assert "writable by group or others" in res.stderr and "tls_ca" in res.stderr
        r.tls.ca.chmod(0o644)
    finally:
        b.cleanup()
        r.stop()
