"""Hostile values on the shared tier, with real parts: Debian's redis-server (standalone,
tests/integration/_redis.py), the deployments' ACL user with exactly the recommended rules,
and ``kvp-admin`` run under the bounds of tests/hostile.py (512 MiB of address space, an
alarm, an output bound).

Planted by the test's own (full-rights) client, under fleet keys of one namespace ``NS``:
records nested 100,000 and 2,000 deep, records holding ``NaN``, ``Infinity`` and ``1e309``,
records whose fields have the wrong types (a host that is a number, ``ttl_s`` text, no
``ttl_s``), a record of 50 MB, and an index with members that are no host ids; the running
deployment's index is a set of 200,000 members, another namespace's (``KEEP``, served by a
host with a valid record) one of 5,000.

What it shows: ``report``, ``prune`` (dry run and ``--apply``), ``health`` and ``metrics``
answer within the bounds; every hostile record is counted and named (escaped) as foreign,
never used (``NS`` has no valid record, so it is not active); the 50 MB value and the large
sets are never fetched (the store sent less than 4 MB to all the commands together); a prune
deletes exactly ``NS``'s chunk keys; writing and deleting this host's record leave the
200,000-member index as it was; every other key is byte for byte as it was (``DUMP``, TTL);
no command was refused by the ACL. With the ACL recommended before ``+scard`` the reads stay
bounded, and the refused ``SCARD`` is the only entry of the ACL LOG.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.loader import load_deployment
from kvpersist.config.shared_tier import ACL_RULES
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.records import FleetRecord, host_id

from ..conftest import clean_env
from ..hostile import HostileRunner, Outcome, assert_all_bounded
from ._redis import SERVICE_USER, Redis, start_redis
from .test_metrics_shared_tier import client, config_dir, namespace_of, pick, samples
from .test_shared_foreign_keys import chunk, keys_of
from .test_shared_tier import acl_refusals

pytestmark = pytest.mark.integration

NS = "kvp-" + "a1" * 16  # every record of it is hostile: not active, pruned
KEEP = "kvp-" + "b2" * 16  # its index is too large; a valid record of another host serves it
OTHER_HOST = host_id("other-host", "m" * 32, "/var/lib/kvp")
BIG = 50 << 20
#: the store may send this much to all the commands together (the 50 MB value, the 200,000
#: members are never sent)
SENT_LIMIT = 4 << 20


def hid(i: int) -> str:
    return host_id(f"h{i}", "m", "/s")


def valid(ns: str, hid_: str, **change: Any) -> dict[str, Any]:
    rec = FleetRecord(namespace=ns, host="h", host_id=hid_, deployment="d", version="0",
                      serde="none", serde_key_fingerprint="", updated_at=time.time())
    return {**rec.to_dict(), **change}


def text(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


#: host id -> (value stored under its record key of NS, what the reason says)
HOSTILE: dict[str, tuple[bytes, str]] = {
    hid(0): (b"[" * 100_000, "100,000 bytes, more than the 4,096"),
    hid(1): (b"[" * 2000 + b"]" * 2000, "nested deeper than the 64 levels"),
    hid(2): (text(valid(NS, hid(2), updated_at=0)).replace(b'"updated_at": 0',
                                                           b'"updated_at": NaN'),
             "NaN is not a number JSON allows"),
    hid(3): (text(valid(NS, hid(3), updated_at=0)).replace(b'"updated_at": 0',
                                                           b'"updated_at": 1e309'),
             "out of range"),
    hid(4): (text(valid(NS, hid(4), host=7)), "host is a number, not text"),
    hid(5): (text(valid(NS, hid(5), ttl_s="1290")), "ttl_s is not a whole number"),
    hid(6): (text({k: v for k, v in valid(NS, hid(6)).items() if k != "ttl_s"}),
             "ttl_s is not a whole number"),
    hid(7): (text(valid(NS, hid(7), deployment="d\x1b[2J")), "deployment is not printable"),
    hid(8): (b"x" * BIG, f"{BIG:,} bytes, more than the 4,096 a fleet record may hold "
                         "(foreign, not read)"),
}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    r = start_redis(tmp_path / "store", acl=ACL_RULES)
    try:
        yield r
    finally:
        r.stop()


def plant(c: Any, own_ns: str) -> None:
    for host, (value, _) in HOSTILE.items():
        c.set(f"kvpersist-fleet:{NS}:{host}", value)
    c.sadd(f"kvpersist-fleet:{NS}", *HOSTILE, "not a host id!", "h" * 100)
    for i in range(3):
        c.set(chunk(NS, f"{i:064x}"), b"v" * 100)
    c.set(chunk(KEEP, "c" * 64), b"k" * 50)
    c.set(f"kvpersist-fleet:{KEEP}:{OTHER_HOST}", text(valid(KEEP, OTHER_HOST)))
    pipe = c.pipeline(transaction=False)
    pipe.sadd(f"kvpersist-fleet:{KEEP}", *(hid(i) for i in range(5000)))
    for start in range(0, 200_000, 20_000):
        pipe.sadd(f"kvpersist-fleet:{own_ns}", *(hid(i) for i in range(start, start + 20_000)))
    pipe.execute()


def snapshot(c: Any, r: Redis) -> dict[bytes, tuple[Any, int]]:
    """Every key: its value (a set's sorted members: its DUMP follows the order of a hash
    table that reads may rehash, a string's DUMP) and its TTL."""
    return {k: (sorted(c.smembers(k)) if c.type(k) == b"set" else c.dump(k), c.pttl(k))
            for k in keys_of(c, r)}


def sent_bytes(r: Redis) -> int:
    """What the store has sent to its clients since it started (``INFO stats``)."""
    line = [x for x in r.nodes[0].cli("info", "stats").splitlines()
            if x.startswith("total_net_output_bytes:")]
    return int(line[0].split(":")[1])


def test_hostile_records_are_foreign_and_never_fetched(tmp_path: Path, redis: Redis) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    cfg = config_dir(tmp_path, "host-a", redis, root, KVP_L2_SERDE="none")
    own_ns = namespace_of(cfg)
    c = client(redis)
    runs: list[Outcome] = []
    try:
        plant(c, own_ns)
        before = snapshot(c, redis)
        sent = sent_bytes(redis)
        with HostileRunner() as h:
            def kvp(*argv: str) -> Outcome:
                out = h.run(*argv, env=clean_env())
                runs.append(out)
                return out

            rep = kvp("report", "--tier", "shared", "--config", str(cfg), "--json")
            assert rep.code == 0, rep.stderr
            doc = json.loads(rep.stdout)
            rows = {r["namespace"]: (r["keys"], r["active"]) for r in doc["namespaces"]}
            assert rows[NS] == (3, False) and rows[KEEP] == (1, True), rows
            problems = doc["fleet_record_problems"]
            for host, (_, why) in HOSTILE.items():
                [named] = [p for p in problems if f"{NS}:{host}" in p]
                assert why in named and "foreign" in named, named
            assert len(problems) == len(HOSTILE) and "\x1b" not in rep.stdout
            human = kvp("report", "--tier", "shared", "--config", str(cfg))
            assert human.code == 0 and "\x1b" not in human.stdout, human.stderr

            dry = kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace", NS,
                      "--json")
            assert dry.code == 0 and json.loads(dry.stdout)["deleted_keys"] == 3, dry.stderr
            refused = kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace",
                          KEEP, "--apply")
            assert refused.code == 2 and "1 host(s) serve it" in refused.stderr, refused
            done = kvp("prune", "--tier", "shared", "--config", str(cfg), "--namespace", NS,
                       "--apply", "--json")
            assert done.code == 0 and json.loads(done.stdout)["deleted_keys"] == 3, done

            health = kvp("health", str(cfg), "--no-vllm", "--json")
            shared = json.loads(health.stdout)["shared_tier"]
            assert shared["reachable"] and shared["auth_ok"], shared
            assert any("is a set of 200,000 members, more than the 4,096" in p
                       for p in shared["fleet"]["problems"]), shared["fleet"]
            m = samples(kvp("metrics", str(cfg), "--no-vllm", "--timeout", "5").stdout)
            assert pick(m, "kvpersist_shared_tier_up") == [1]
            assert pick(m, "kvpersist_shared_tier_namespace_keys", namespace=KEEP) == [1]
        assert_all_bounded(runs)

        # launch's and health's record write: the record is written, not indexed; the
        # 200,000-member index is left as it is (members and TTL)
        dep = load_deployment(str(cfg))
        wrote = fleet.write(dep)
        assert not wrote.ok and "is a set of 200,000 members" in wrote.detail, wrote
        assert fleet.delete(dep).action == "deleted"
        assert sent_bytes(redis) - sent < SENT_LIMIT
        after = snapshot(c, redis)
        assert sorted(before.keys() - after.keys()) == [chunk(NS, f"{i:064x}")
                                                        for i in range(3)]
        changed = [k for k in after if after[k] != before[k]]
        assert not changed, f"keys outside the selection changed: {changed}"
        assert acl_refusals(redis) == set()

        # an ACL user created by the rules before +scard: still bounded, one refusal logged
        redis.nodes[0].cli("acl", "setuser", SERVICE_USER, "-scard")
        sent = sent_bytes(redis)
        with HostileRunner() as h:
            old = h.run("health", str(cfg), "--no-vllm", "--json", env=clean_env())
        assert_all_bounded([old])
        assert any("is a set of 200,000 members" in p for p in
                   json.loads(old.stdout)["shared_tier"]["fleet"]["problems"]), old.stdout
        assert sent_bytes(redis) - sent < SENT_LIMIT
        assert {(why, obj) for why, obj, _ in acl_refusals(redis)} == {("command", "scard")}
        assert snapshot(c, redis) == after
    finally:
        c.close()
