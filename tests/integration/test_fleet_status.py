"""``kvp-admin fleet status`` against a real redis-server (ACL user and password): records of
three hosts written by kvpersist's own writer (kvpersist.l2.fleet.host.write, the one launch
and health call; for the host that lapses, the record and index writer under it with a
1 s TTL), read back through the real CLI in a subprocess.

No lmcache server is started: the writer needs only the deployment's config, its serde key
and the store.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvpersist.config.deployment import Deployment, shared_tier_of
from kvpersist.config.loader import load_deployment
from kvpersist.config.shared_tier import SharedSecret
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.records import serde_fingerprint
from kvpersist.l2.fleet.store import write_record
from kvpersist.l2.inventory import size_deployment
from kvpersist.l2.keys import store as keys
from kvpersist.l2.shared.store import connect

from ..conftest import free_port
from ..fullstack._stack import Stack
from ._redis import start_redis
from .test_shared_tier import host, share_key

pytestmark = pytest.mark.integration


def chunk_files(root: Path, ns: str, n: int) -> None:
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    for i in range(n):
        (root / f"{ns}_00000000_0_{i:016x}.bin").write_bytes(b"x" * 1000)


def test_status_shows_live_gone_and_a_disagreeing_key_and_exits_1(tmp_path: Path) -> None:
    t0 = time.monotonic()
    store = start_redis(tmp_path / "store")
    try:
        a, b, c = (host(tmp_path, n, store) for n in "abc")
        dep: dict[str, Deployment] = {s.config + n: load_deployment(s.config, environ=s.env)
                                      for n, s in zip("abc", (a, b, c), strict=True)}
        da, db, dc = dep["cpu-demoa"], dep["cpu-demob"], dep["cpu-democ"]
        ns = da.namespace
        assert db.namespace == dc.namespace == ns  # one identity, three hosts (state dirs)
        keys.ensure_key(da.settings.serde_key_file)
        keys.ensure_key(dc.settings.serde_key_file)  # its own key: disagrees
        chunk_files(a.root, ns, 3)

        # hosts a and c: launched (since, the launch's scan of each root: 3 files on a's)
        launched = fleet.write(da, launched=True, nvme=fleet.nvme_use(size_deployment(da), ns))
        assert launched.action == "written", launched
        first = json.loads(store.nodes[0].cli("get", launched.key))
        assert fleet.write(dc, launched=True,
                           nvme=fleet.nvme_use(size_deployment(dc), ns)).action == "written"
        # host b, a's key: its record lapses after 1 s (the store expires it) ...
        share_key(a, b)
        tier = shared_tier_of(db.settings)
        assert tier is not None
        st = connect(tier, SharedSecret("kvp-fleet", store.password))
        rec_b = replace(fleet.own_record(db), ttl_s=1)
        write_record(st, ns, rec_b.host_id, rec_b.encode(), rec_b.ttl_s)
        st.close()
        # ... while the health runs of a and c refresh theirs (and give the index their TTL
        # again: a write sets the index's TTL to its record's)
        assert fleet.write(da, health="healthy").action == "written"
        assert fleet.write(dc, health="degraded").action == "written"
        time.sleep(1.5)
        assert store.nodes[0].cli("exists", rec_b.key).strip() == "0"
        assert rec_b.host_id in store.nodes[0].cli("smembers", f"kvpersist-fleet:{ns}")

        r = a.kvp("fleet", "status", "--config", a.config, "--json", timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["schema"] == "kvpersist.fleet-status/1" and doc["exit_code"] == 1
        assert doc["disagree"] == [ns] and doc["agree"] is False
        [row] = doc["namespaces"]
        assert row["namespace"] == ns and row["configured"] == ["cpu-demo"]
        assert row["agreement"] == "disagree" and row["live"] == 2
        hosts = {h["host_id"]: h for h in row["hosts"]}
        id_a = launched.key.rsplit(":", 1)[1]
        id_c = fleet.own_record(dc).host_id
        assert {k: h["state"] for k, h in hosts.items()} == {id_a: "live", id_c: "live",
                                                             rec_b.host_id: "gone"}
        ha, hc = hosts[id_a], hosts[id_c]
        assert ha["since"] == first["since"] < ha["health"]["at"]  # kept by the refresh
        assert ha["health"]["status"] == "healthy" and hc["health"]["status"] == "degraded"
        assert (ha["nvme"]["files"], ha["nvme"]["bytes"]) == (3, 3000)
        assert (hc["nvme"]["files"], hc["nvme"]["bytes"]) == (0, 0)
        key_a = Path(da.settings.serde_key_file).read_bytes()
        key_c = Path(dc.settings.serde_key_file).read_bytes()
        assert ha["serde_key_fingerprint"] == serde_fingerprint(key_a)
        assert hc["serde_key_fingerprint"] == serde_fingerprint(key_c)
        assert {g["serde_key_fingerprint"]: g["hosts"] for g in row["fingerprints"]} == {
            serde_fingerprint(key_a): [id_a], serde_fingerprint(key_c): [id_c]}
        assert hosts[rec_b.host_id]["deployment"] is None

        text = a.kvp("fleet", "status", "--config", a.config, timeout=60)
        assert text.returncode == 1, text.stderr
        assert "KEYS DISAGREE" in text.stdout and "2 live host(s)" in text.stdout
        lines = {ln.split()[0]: ln for ln in text.stdout.splitlines() if ln.strip()}
        assert lines[rec_b.host_id].rstrip().endswith("gone")
        assert "healthy" in lines[id_a] and "3 files" in lines[id_a]
        assert lines[id_a].rstrip().endswith("live")
        for out in (r, text):
            both = out.stdout + out.stderr
            assert store.password not in both
            assert key_a.hex() not in both and key_c.hex() not in both

        # the store unreachable: exit 2, the error document
        d = tmp_path / "d"
        d.mkdir(mode=0o700)
        down = Stack(d, KVP_SHARED_TIER=f"valkey://127.0.0.1:{free_port()}",
                     KVP_SHARED_TIER_SECRET_FILE=str(store.write_secret(d / "s.secret")))
        r = down.kvp("fleet", "status", "--config", down.config, "--json", timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert err["schema"] == "kvpersist.error/1" and err["exit_code"] == 2
        assert store.password not in r.stdout + r.stderr
    finally:
        store.stop()
    assert time.monotonic() - t0 < 40
