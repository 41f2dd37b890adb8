"""Fleet records on the shared tier with real parts: one Debian redis-server (ACL user and
password) for the module, and stock ``lmcache server`` processes started by
``kvp-admin launch`` with their own cache roots and state dirs, standing in for hosts.

Records: launch (and ``launch --foreground``, the systemd path) writes one per host, health
compares the serde keys and refreshes it, stop (and a clean systemd stop) deletes it, prune
treats a namespace another host serves as active, report names the hosts, and a launch with
the store down still succeeds (with a warning).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2.fleet.records import RECORD_TTL_S, FleetRecord, host_id, serde_fingerprint

from ..conftest import REPO
from ..fullstack._stack import KVP_ADMIN, Stack, wait_until
from ._redis import Redis, start_redis
from .test_shared_tier import host, share_key

pytestmark = pytest.mark.integration

OTHER_NS = "kvp-" + "c" * 32


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    r = start_redis(tmp_path_factory.mktemp("fleet") / "store")
    try:
        yield r
    finally:
        r.stop()


def health(s: Stack) -> tuple[int, dict[str, Any]]:
    r = s.kvp("health", s.config, "--no-vllm", "--json")
    return r.returncode, json.loads(r.stdout)


def check(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in doc["checks"] if c["name"] == name)


def index(ns: str) -> str:
    return f"kvpersist-fleet:{ns}"


def members(store: Redis, ns: str) -> list[str]:
    return sorted(store.nodes[0].cli("smembers", index(ns)).split())


def systemd_stop_env(returncode: int) -> dict[str, str]:
    """What systemd hands ``ExecStopPost`` after ``systemctl stop`` ended the main process
    with ``returncode`` (subprocess's: negative for a signal). SIGTERM, the unit's
    KillSignal, is a clean signal to systemd: SERVICE_RESULT stays ``success``."""
    if returncode >= 0:
        return {"SERVICE_RESULT": "success" if returncode == 0 else "exit-code",
                "EXIT_CODE": "exited", "EXIT_STATUS": str(returncode)}
    sig = signal.Signals(-returncode).name.removeprefix("SIG")
    return {"SERVICE_RESULT": "success" if sig in ("TERM", "INT", "HUP", "PIPE") else "signal",
            "EXIT_CODE": "killed", "EXIT_STATUS": sig}


def serving(s: Stack) -> bool:
    return bool(s.kvp_json("status", s.config, check=False)["lmcache"]["healthy"])


def launched_id(out: dict[str, Any]) -> str:
    """The host id of a launch's fleet record (``kvpersist-fleet:<ns>:<host id>``)."""
    rec = out["fleet_record"]
    assert rec["action"] == "written", out
    return str(rec["key"]).rsplit(":", 1)[1]


def test_records_compare_keys_guard_prune_and_go_at_stop(tmp_path: Path, store: Redis) -> None:
    a, b, c = (host(tmp_path, n, store) for n in "abc")
    try:
        ns = a.render()["namespace"]
        out_a = a.launch("--no-vllm")
        id_a = launched_id(out_a)
        share_key(a, b)  # the fleet's one key (the role distributes it)
        id_b = launched_id(b.launch("--no-vllm"))
        assert id_a != id_b  # one host each (own state dir)
        records = store.scan_keys(f"kvpersist-fleet:{ns}:*")
        assert records == sorted(f"kvpersist-fleet:{ns}:{i}" for i in (id_a, id_b))
        assert store.scan_keys("kvpersist-fleet:*") == sorted([*records, index(ns)])
        assert members(store, ns) == sorted([id_a, id_b])
        assert store.scan_keys(f"{ns}@*") == []  # never a chunk key
        doc = json.loads(store.nodes[0].cli("get", records[0]))
        assert doc["namespace"] == ns and doc["deployment"] == a.config
        rec_a = json.loads(store.nodes[0].cli("get", f"kvpersist-fleet:{ns}:{id_a}"))
        assert rec_a["since"] == rec_a["updated_at"] and "health" not in rec_a  # the launch's
        assert (rec_a["nvme"]["files"], rec_a["nvme"]["bytes"]) == (0, 0)  # a fresh root
        ttl = int(store.nodes[0].cli("ttl", records[0]))
        assert RECORD_TTL_S - 60 < ttl <= RECORD_TTL_S
        key_a = (a.state_dir / "keys" / ns / "l2-master.key").read_bytes()
        assert {json.loads(store.nodes[0].cli("get", k))["serde_key_fingerprint"]
                for k in records} == {serde_fingerprint(key_a)}
        assert key_a.hex() not in store.nodes[0].cli("get", records[0])

        # the same key on both hosts: healthy, and health refreshed b's record
        store.nodes[0].cli("expire", f"kvpersist-fleet:{ns}:{id_b}", "30")
        store.nodes[0].cli("sadd", index(ns), "gone-0a1b2c3d")  # its record lapsed
        code, doc = health(b)
        assert code == 0 and doc["components"]["shared_tier"] == "ok", doc
        same = check(doc, "shared_tier.serde_key")
        assert same["status"] == "ok" and id_a in same["detail"], same
        assert doc["fleet_record"]["action"] == "written"
        assert int(store.nodes[0].cli("ttl", f"kvpersist-fleet:{ns}:{id_b}")) > 60
        assert members(store, ns) == sorted([id_a, id_b])  # the writer dropped the lapsed one
        rec_b = json.loads(store.nodes[0].cli("get", f"kvpersist-fleet:{ns}:{id_b}"))
        assert rec_b["health"]["status"] == "healthy" and rec_b["nvme"]["files"] == 0
        assert rec_b["since"] < rec_b["updated_at"]  # the launch's time, kept by the refresh

        # host c has its own key and runs as under systemd (launch --foreground execs the
        # server): degraded on c and on a, naming the other host(s)
        fg = subprocess.Popen([*KVP_ADMIN, "launch", c.config, "--foreground"], env=c.env,
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert wait_until(lambda: serving(c), 90)
        id_c = next(k for k in store.scan_keys(f"kvpersist-fleet:{ns}:*")
                    if k.rsplit(":", 1)[1] not in (id_a, id_b)).rsplit(":", 1)[1]
        code, doc = health(c)
        assert code == 1 and doc["components"]["shared_tier"] == "degraded", doc
        assert doc["components"]["cache_server"] == "ok"
        differs = check(doc, "shared_tier.serde_key")
        assert differs["status"] == "degraded", differs
        ab = ", ".join(sorted((id_a, id_b)))
        assert differs["detail"].startswith(f"serde key differs from host {ab}: chunks "
                                            f"stored by {ab} miss here and vice versa")
        assert {h["host_id"] for h in doc["shared_tier"]["fleet"]["conflicts"]} == {id_a, id_b}
        code, doc = health(a)
        assert code == 1 and check(doc, "shared_tier.serde_key")["detail"].startswith(
            f"serde key differs from host {id_c}:"), doc
        text = a.kvp("health", a.config, "--no-vllm")
        assert text.returncode == 1 and f"differs from host {id_c}" in text.stdout

        # systemd stops c (SIGTERM), then ExecStopPost: a clean stop deletes c's record
        fg.terminate()
        code = fg.wait(timeout=60)
        assert b"fleet record kvpersist-fleet:" in (fg.stderr.read() if fg.stderr else b"")
        post = subprocess.run([*KVP_ADMIN, "stop", c.config, "--systemd-stop-post", "--json"],
                              env={**c.env, **systemd_stop_env(code)}, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        done = json.loads(post.stdout)
        assert done["clean"] == (code == 0)  # LMCache 0.5.6 ends by the SIGTERM here
        assert "deleted" in done["fleet_record"], (code, done)
        assert f"kvpersist-fleet:{ns}:{id_c}" not in store.scan_keys("kvpersist-fleet:*")
        assert id_c not in members(store, ns)
        assert health(a)[0] == 0  # the fleet agrees again

        # a namespace only another host serves: prune refuses it, names the host and age
        other = FleetRecord(namespace=OTHER_NS, host="gpu-9",
                            host_id=host_id("gpu-9", "x", "/var/lib/kvpersist/other"),
                            deployment="other-model", version="0.2.0", serde="aesgcm",
                            serde_key_fingerprint=serde_fingerprint(b"k" * 32),
                            updated_at=time.time() - 90)
        # as that host wrote it: its record (with a TTL) and its namespace's index
        store.nodes[0].cli("set", other.key, other.encode(), "ex", "600")
        store.nodes[0].cli("sadd", index(OTHER_NS), other.host_id)
        for i in range(3):
            store.nodes[0].cli("set", f"{OTHER_NS}@01000100@0@a{i}", "x" * 100)
        refused = a.kvp("prune", "--tier", "shared", "--config", a.config,
                        "--namespace", OTHER_NS, "--apply")
        assert refused.returncode == 2, refused.stderr
        assert OTHER_NS in refused.stderr and other.host_id in refused.stderr
        age = re.search(rf"{other.host_id} \(deployment other-model, refreshed (\d+) s ago",
                        refused.stderr)
        assert age and 90 <= int(age.group(1)) < 200, refused.stderr
        assert "--force" in refused.stderr
        assert len(store.scan_keys(f"{OTHER_NS}@*")) == 3  # nothing deleted
        also_all = a.kvp("prune", "--tier", "all", "--config", a.config,
                         "--namespace", OTHER_NS, "--apply")
        assert also_all.returncode == 2 and other.host_id in also_all.stderr

        # report names the hosts per namespace (JSON and text)
        rep = a.kvp_json("report", "--tier", "shared", "--config", a.config)
        rows = {r["namespace"]: r for r in rep["namespaces"]}
        assert {h["host_id"] for h in rows[ns]["hosts"]} == {id_a, id_b}
        assert rows[ns]["configured"] and rows[ns]["active"]
        assert [h["host_id"] for h in rows[OTHER_NS]["hosts"]] == [other.host_id]
        assert rows[OTHER_NS]["active"] and not rows[OTHER_NS]["configured"]
        assert rows[OTHER_NS]["keys"] == 3 and rep["fleet_records"] == 3
        assert rep["fleet_keys"] == 5  # and the two namespaces' indexes
        assert rep["other_keys"] == 0
        shown = a.kvp("report", "--tier", "shared", "--config", a.config)
        assert shown.returncode == 0 and "HOSTS" in shown.stdout
        line = next(x for x in shown.stdout.splitlines() if x.startswith(OTHER_NS))
        assert other.host_id in line and "active" in line

        forced = a.kvp_json("prune", "--tier", "shared", "--config", a.config,
                            "--namespace", OTHER_NS, "--apply", "--force")
        assert forced["deleted_keys"] == 3 and store.scan_keys(f"{OTHER_NS}@*") == []
        assert other.key in store.scan_keys("kvpersist-fleet:*")  # records are not chunks

        # kvp-admin stop deletes the host's record
        for s in (a, b):
            out = s.stop()
            assert out["fleet_record"]["action"] == "deleted", out
        assert store.scan_keys(f"kvpersist-fleet:{ns}*") == []  # records and index
    finally:
        for s in (a, b, c):
            s.cleanup()


@pytest.mark.parametrize("adapter", ["resp", "valkey"])
def test_launch_with_the_store_down_succeeds_with_a_warning(tmp_path: Path,
                                                           adapter: str) -> None:
    """The store is down when the host launches: the launch succeeds, warns and starts the
    cache server without the shared tier (LMCache's RESP client would close its socket twice
    and never connect later, its valkey adapter would abort the start: lmcache_exec); health
    stays degraded after the store is back, until the cache server restarts."""
    late = start_redis(tmp_path / "store")
    late.kill()
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    secret = late.write_secret(d / "shared.secret")
    s = Stack(d, KVP_SHARED_TIER=f"{late.url}?adapter={adapter}",
              KVP_SHARED_TIER_SECRET_FILE=str(secret))
    try:
        r = s.kvp("launch", s.config, "--no-vllm", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["fleet_record"]["action"] == "failed"
        assert "WARNING: fleet record" in r.stderr and "not updated" in r.stderr
        assert any(n.startswith("WARNING: fleet record") for n in out["notes"])
        assert "runs without the shared tier" in r.stderr
        assert any("runs without the shared tier" in n for n in out["notes"])
        assert late.password not in r.stderr + r.stdout
        code, doc = health(s)
        assert code == 1 and doc["components"]["shared_tier"] == "degraded", doc
        assert doc["components"]["cache_server"] == "ok"

        late.restart()  # the store answers now; the running cache server does not use it
        code, doc = health(s)
        assert check(doc, "shared_tier.store")["status"] == "ok", doc
        server = check(doc, "shared_tier.server")
        assert server["status"] == "degraded" and "restart the cache server" in \
            server["detail"], server
        assert code == 1 and doc["components"]["shared_tier"] == "degraded"
        m = s.kvp("metrics", s.config, "--no-vllm")
        gauge = [ln for ln in m.stdout.splitlines()
                 if ln.startswith("kvpersist_cache_server_shared_tier{")]
        assert len(gauge) == 1 and gauge[0].endswith(" 0.0"), m.stdout

        stopped = s.stop()
        assert stopped["stopped"][-1]["how"] == "terminated"
        s.launch("--no-vllm")  # with the store up: the adapter is back, the record gone
        code, doc = health(s)
        assert code == 0 and not any(c["name"] == "shared_tier.server"
                                     for c in doc["checks"]), doc
        m = s.kvp("metrics", s.config, "--no-vllm")
        assert [ln.rsplit(" ", 1)[1] for ln in m.stdout.splitlines()
                if ln.startswith("kvpersist_cache_server_shared_tier{")] == ["1.0"], m.stdout
    finally:
        s.cleanup()
        late.stop()


def test_records_and_index_on_a_cluster(tmp_path: Path) -> None:
    """A 3-primary cluster: records of one namespace land on several nodes; the index reads
    them all without a scan, report's scan finds them, a lapsed one is dropped by the next
    write, a delete removes record and index entry."""
    from kvpersist.config.shared_tier import SharedSecret, parse_shared_tier
    from kvpersist.l2.fleet import store as fs
    from kvpersist.l2.fleet.host import read_keys, read_namespace
    from kvpersist.l2.shared import store as ss

    r = start_redis(tmp_path / "store", cluster=True)
    try:
        tier, problem = parse_shared_tier(r.url)
        assert tier is not None, problem
        st = ss.connect(tier, SharedSecret("kvp-fleet", r.password))
        recs = [FleetRecord(OTHER_NS, f"h{i}", host_id(f"h{i}", "m", f"/s{i}"), "demo",
                            "0.2.0", "aesgcm", serde_fingerprint(bytes([i + 1]) * 32),
                            time.time()) for i in range(6)]
        for rec in recs:
            fs.write_record(st, OTHER_NS, rec.host_id, rec.encode(), 60)
        per_node = [n.cli("--scan", "--pattern", "kvpersist-fleet:*").split() for n in r.nodes]
        assert sum(len(k) for k in per_node) == 7 and sum(1 for k in per_node if k) >= 2
        got, problems = read_namespace(st, OTHER_NS)
        assert sorted(got, key=lambda x: x.host_id) == sorted(recs, key=lambda x: x.host_id)
        assert problems == []
        found = ss.usage(st)
        assert (found.fleet_keys, found.fleet_records, found.other_keys) == (7, 6, 0)
        assert len(read_keys(st, found.record_keys)[0]) == 6
        assert fs.delete_record(st, OTHER_NS, recs[0].host_id)
        assert not fs.delete_record(st, OTHER_NS, recs[0].host_id)
        r.nodes[0].cli("-c", "del", recs[1].key)  # lapsed
        assert fs.write_record(st, OTHER_NS, recs[2].host_id, recs[2].encode(), 60) == 1
        left = {m for m in r.nodes[0].cli("-c", "smembers", f"kvpersist-fleet:{OTHER_NS}")
                .split()}
        assert left == {x.host_id for x in recs[2:]}
        st.close()
    finally:
        r.stop()
