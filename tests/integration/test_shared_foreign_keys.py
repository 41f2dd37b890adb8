"""Keys of the wrong type on the shared tier, with real parts: Debian's redis-server
(standalone and a 3-primary cluster, tests/integration/_redis.py), the deployments' ACL user
with exactly the recommended rules, and ``kvp-admin`` in subprocesses.

Planted by the test's own (full-rights) client: chunk-named keys that are a list, a hash and a
set; keys the namespace's SCAN pattern matches that are not chunk keys; a namespace's fleet
index that is a string, another's that is a hash; a fleet record that is a hash; a prune lock
that is a hash; and chunk keys whose salt holds a newline or bytes that are not UTF-8.

What it shows: ``report``, ``prune`` (dry run and ``--apply``), ``health`` and ``metrics``
answer without a traceback; the foreign keys are counted, named (escaped) and skipped; a
prune deletes exactly the keys that parse as the namespace's chunk keys and are strings,
whatever their salt holds; every other key is byte for byte as it was (``DUMP``, no TTL);
a record behind a foreign index is still found (the namespace stays active); writing and
deleting this host's record leave a foreign index as it was; no command was refused by the
ACL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.loader import load_deployment
from kvpersist.config.shared_tier import ACL_CLUSTER_RULES, ACL_RULES
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.records import FleetRecord, host_id

from ._redis import Redis, start_redis
from .test_metrics_shared_tier import client, config_dir, kvp, namespace_of, pick, samples
from .test_shared_tier import acl_refusals

pytestmark = pytest.mark.integration

NS = "kvp-" + "ab" * 16  # pruned (no config here uses it)
KEEP = "kvp-" + "cd" * 16  # served by another host, whose record sits behind a foreign index
LOCKED = "kvp-" + "ef" * 16  # its prune lock's name holds a hash
OTHER_HOST = host_id("other-host", "m" * 32, "/var/lib/kvp")


def chunk(ns: str, h: str, salt: bytes = b"") -> bytes:
    return f"{ns}@01000100@0@{h}".encode() + (b"@" + salt if salt else b"")


#: the chunk keys of NS a prune deletes (strings; two salts a terminal or a decoder chokes on)
NS_CHUNKS = [chunk(NS, f"{i:064x}") for i in range(3)] + [
    chunk(NS, "a" * 64, b"line\nbreak\x1b[2J"), chunk(NS, "b" * 64, b"\xff\xfe")]


@pytest.fixture(params=[False, True], ids=["standalone", "cluster"])
def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Redis]:
    acl = f"{ACL_RULES} {ACL_CLUSTER_RULES}" if request.param else ACL_RULES
    r = start_redis(tmp_path / "store", cluster=request.param, acl=acl)
    try:
        yield r
    finally:
        r.stop()


def plant(c: Any, own_ns: str) -> None:
    for k in NS_CHUNKS:
        c.set(k, b"v" * 100)
    c.set(chunk(KEEP, "c" * 64), b"k" * 50)
    c.rpush(chunk(NS, "d1" * 32), "a", "b")          # chunk-named, a list
    c.hset(chunk(NS, "d2" * 32), "f", "v")           # a hash
    c.sadd(chunk(NS, "d3" * 32), "m")                # a set
    c.rpush(chunk(KEEP, "d4" * 32), "x")             # another namespace's, a list
    c.set(f"{NS}@not-a-chunk", "x")                  # the SCAN pattern matches, no parse
    c.set(f"{NS}@01000100@0@nothex", "x")
    c.set(f"kvpersist-fleet:{NS}", "a string where a set belongs")
    c.hset(f"kvpersist-fleet:{NS}:{OTHER_HOST}", "f", "v")  # a record that is a hash
    c.hset(f"kvpersist-fleet:{KEEP}", "f", "v")      # an index that is a hash
    c.set(f"kvpersist-fleet:{own_ns}", "the running deployment's index, a string")
    rec = FleetRecord(namespace=KEEP, host="other-host", host_id=OTHER_HOST,
                      deployment="d", version="0", serde="none", serde_key_fingerprint="",
                      updated_at=time.time())
    c.set(rec.key, rec.encode())  # a live record, no TTL (the snapshot compares TTLs)
    c.hset(f"kvpersist-lock:prune:{LOCKED}", "f", "v")
    c.set(chunk(LOCKED, "e" * 64), "x")


def keys_of(c: Any, redis: Redis) -> list[bytes]:
    if redis.cluster:
        return sorted(c.scan_iter(count=500, target_nodes=c.PRIMARIES))  # type: ignore[no-any-return]
    return sorted(c.scan_iter(count=500))


def snapshot(c: Any, redis: Redis) -> dict[bytes, tuple[Any, int]]:
    """Every key: its DUMP (type and value) and TTL."""
    return {k: (c.dump(k), c.pttl(k)) for k in keys_of(c, redis)}


def ok(r: Any) -> Any:
    assert "Traceback" not in r.stderr and "WRONGTYPE" not in r.stderr + r.stdout, r.stderr
    return r


def test_wrong_typed_keys_are_counted_skipped_and_never_touched(tmp_path: Path,
                                                                 redis: Redis) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    cfg = config_dir(tmp_path, "host-a", redis, root, KVP_L2_SERDE="none")  # no key to make
    own_ns = namespace_of(cfg)
    c = client(redis)
    try:
        plant(c, own_ns)
        before = snapshot(c, redis)

        rep = ok(kvp("report", "--tier", "shared", "--config", str(cfg), "--json"))
        assert rep.returncode == 0, rep.stderr
        doc = json.loads(rep.stdout)
        rows = {r["namespace"]: (r["keys"], r["bytes"], r["active"]) for r in doc["namespaces"]}
        assert rows[NS] == (5, 500, False) and rows[KEEP] == (1, 50, True), rows
        skipped = doc["skipped_keys"]
        assert skipped["count"] == 4 and len(skipped["kinds"]) == 1, skipped
        [kind] = skipped["kinds"].values()
        assert sorted(kind["first"]) == sorted(
            k.decode() for k in (chunk(NS, "d1" * 32), chunk(NS, "d2" * 32),
                                 chunk(NS, "d3" * 32), chunk(KEEP, "d4" * 32)))
        assert any("not a string" in p and OTHER_HOST in p
                   for p in doc["fleet_record_problems"]), doc["fleet_record_problems"]
        human = ok(kvp("report", "--tier", "shared", "--config", str(cfg)))
        assert human.returncode == 0 and "4 keys skipped as foreign" in human.stdout
        assert "\x1b" not in human.stdout

        dry = ok(kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace", NS,
                     "--json"))
        assert dry.returncode == 0, dry.stderr
        [res] = json.loads(dry.stdout)["namespaces"]
        assert (res["deleted_keys"], res["deleted_bytes"]) == (5, 500)
        kinds = {k: v["count"] for k, v in res["skipped_keys"]["kinds"].items()}
        assert sorted(kinds.values()) == [2, 3], kinds
        assert snapshot(c, redis) == before  # a dry run changes nothing

        done = ok(kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace", NS,
                      "--apply"))
        assert done.returncode == 0, done.stderr
        assert "deleted 5 keys" in done.stdout and "3 keys skipped as foreign" in done.stdout
        after = snapshot(c, redis)
        assert sorted(before.keys() - after.keys()) == sorted(NS_CHUNKS)
        assert all(after[k] == before[k] for k in after), "a key outside the selection changed"
        again = json.loads(ok(kvp("prune", "--tier", "shared", "--config", str(cfg),
                                  "--namespace", NS, "--apply", "--json")).stdout)
        assert again["deleted_keys"] == 0

        # KEEP's index is a hash: its live record is still found, so KEEP is active
        refused = ok(kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace",
                         KEEP, "--apply"))
        assert refused.returncode == 2 and "1 host(s) serve it" in refused.stderr, refused
        locked = ok(kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace",
                        LOCKED, "--apply", "--json"))
        assert locked.returncode == 1 and "a key of another type" in locked.stderr, locked

        health = ok(kvp("health", str(cfg), "--no-vllm", "--json"))
        shared = json.loads(health.stdout)["shared_tier"]
        assert shared["reachable"] and shared["auth_ok"], shared
        assert any("holds another type than a set" in p for p in shared["fleet"]["problems"])
        metrics = ok(kvp("metrics", str(cfg), "--no-vllm", "--timeout", "2"))
        m = samples(metrics.stdout)
        assert pick(m, "kvpersist_shared_tier_up") == [1]
        for ns in (KEEP, LOCKED):
            assert pick(m, "kvpersist_shared_tier_namespace_keys", namespace=ns) == [1], ns
        # not chunk keys: 3 (two names that do not parse, the lock), the 4 of another type,
        # the 5 fleet keys
        assert pick(m, "kvpersist_shared_tier_other_keys") == [12]

        # this host's record: written (its own key), not indexed; the index left as it was
        dep = load_deployment(str(cfg))
        wrote = fleet.write(dep)
        assert not wrote.ok and "holds another type than a set" in wrote.detail, wrote
        assert fleet.delete(dep).action == "deleted"
        assert snapshot(c, redis) == after
        assert acl_refusals(redis) == set()
    finally:
        c.close()
