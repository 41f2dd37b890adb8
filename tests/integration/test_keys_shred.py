"""Per-namespace keys and crypto-shredding with real parts: stock ``lmcache server``
processes started by ``kvp-admin launch`` (aesgcm serde), driven by LMCache's own MP client
(kvpersist.demo.kvdriver), ``kvp-admin shred`` through the CLI and the shred action.

* two namespaces at one root get different keys; after ``shred --apply`` of one (the key
  destroyed before any file is removed, shown by a hook between the steps) its lookups miss,
  even for copies of its files put back (as a flash page or a backup would keep them), and
  verify names those copies; the other namespace still hits;
* migration: a root prepared as before per-namespace keys (one root key, files written with
  it) still hits after a launch with per-namespace keys, which adopts the root key; shred's
  dry run names the root key as destroyed with it (no other namespace uses it);
* with a shared tier (a real redis-server), shred removes the namespace's keys there too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvpersist.config.key_paths import namespace_key_path, root_key_path, tombstone_path
from kvpersist.demo.kvdriver import connect
from kvpersist.l2.keys import store as keys

from ..conftest import REPO
from ..fullstack._stack import Stack
from ._redis import Redis
from .test_shared_tier import host

pytestmark = pytest.mark.integration


def other_config(tmp: Path) -> Path:
    """configs/cpu-demo with another max length: another namespace."""
    d = tmp / "other"
    shutil.copytree(REPO / "configs" / "cpu-demo", d)
    env = d / "identity.env"
    env.write_text(env.read_text().replace("KVP_MAX_MODEL_LEN=4096", "KVP_MAX_MODEL_LEN=2048"))
    return d


def store(s: Stack, ns: str, seq: int) -> list[str]:
    with connect(s.rpc, s.http, ns) as d:
        return d.store(seq)


def fetch(s: Stack, ns: str, seq: int) -> tuple[int, list[str] | None]:
    with connect(s.rpc, s.http, ns) as d:
        lk, got = d.lookup_and_retrieve(seq, prefix=True)
        return lk.hit_chunks, got


def test_two_namespaces_own_keys_and_shred_of_one(tmp_path: Path) -> None:
    from kvpersist.actions.shred import ShredOutcome, shred

    a = Stack(tmp_path)
    b = Stack(tmp_path, config=str(other_config(tmp_path)), root=a.root,
              KVP_LOG_DIR=str(tmp_path / "logs-b"))
    try:
        ns_a, ns_b = a.render()["namespace"], b.render()["namespace"]
        assert ns_a != ns_b
        a.launch("--no-vllm")
        b.launch("--no-vllm")
        state = str(a.state_dir)
        key_a, key_b = namespace_key_path(state, ns_a), namespace_key_path(state, ns_b)
        fp_a, fp_b = keys.recorded_fingerprint(state, ns_a), keys.recorded_fingerprint(state,
                                                                                       ns_b)
        assert fp_a and fp_b and fp_a != fp_b  # one key per namespace
        assert keys.fingerprint(Path(key_a).read_bytes()) == fp_a
        assert not os.path.lexists(root_key_path(state))  # no root key is created any more
        stored_a, stored_b = store(a, ns_a, 1), store(b, ns_b, 2)
        a.stop()
        b.stop()
        files_a = a.chunk_files(ns_a + "_")
        assert len(files_a) == 4 and len(a.chunk_files(ns_b + "_")) == 4
        copies = tmp_path / "copies"  # what a flash translation layer or a backup keeps
        copies.mkdir()
        for f in files_a:
            shutil.copy2(f, copies / f.name)

        # the dry run: cpu-demo is configured on this root (active) -> refused without --force
        refused = a.kvp("shred", "--root", str(a.root), "--namespace", ns_a)
        assert refused.returncode == 2 and "--force" in refused.stderr
        assert "Traceback" not in refused.stderr
        dry = a.kvp_json("shred", "--root", str(a.root), "--namespace", ns_a, "--force")
        assert dry["schema"] == "kvpersist.shred/1" and dry["dry_run"] is True
        assert dry["keys_to_destroy"] == [key_a]
        assert dry["data"]["deleted"] == {"files": 4, "bytes": sum(f.stat().st_size
                                                                   for f in files_a)}
        assert os.path.exists(key_a) and a.chunk_files(ns_a + "_") == files_a  # nothing gone

        seen: dict[str, object] = {}

        def between(out: ShredOutcome) -> None:  # after the keys, before any data
            seen["key_gone"] = not os.path.lexists(key_a)
            seen["tombstone"] = os.path.exists(tombstone_path(state, ns_a))
            seen["files_left"] = len(a.chunk_files(ns_a + "_"))
            seen["steps"] = [s for s, _ in out.steps]

        out = shred(ns_a, str(a.root), (), apply=True, between=between)
        assert seen == {"key_gone": True, "tombstone": True, "files_left": 4,
                        "steps": ["keys", "tombstone"]}
        doc = out.to_dict()
        assert [s["step"] for s in doc["steps"]] == ["keys", "tombstone", "data"]
        assert doc["destroyed"][0]["fingerprint"] == fp_a
        assert doc["destroyed"][0]["destroyed_at_ns"] <= doc["steps"][2]["at_ns"]
        assert doc["data"]["deleted"]["files"] == 4 and a.chunk_files(ns_a + "_") == []
        assert os.path.exists(key_b) and len(a.chunk_files(ns_b + "_")) == 4

        # the old files come back (a copy the shred could not reach): still misses
        for f in copies.iterdir():
            shutil.copy2(f, a.root / f.name)
        a.launch("--no-vllm")
        b.launch("--no-vllm")
        assert keys.recorded_fingerprint(state, ns_a) not in (None, fp_a)  # a new key
        hits, _ = fetch(a, ns_a, 1)
        assert hits == 0, "a shredded namespace's old chunks must not authenticate"
        hits_b, got_b = fetch(b, ns_b, 2)
        assert hits_b == 4 and got_b == stored_b  # the other namespace is untouched
        assert stored_a  # what A stored existed (4 chunks) before the shred
        ver = a.kvp_json("verify", a.config, check=False)
        assert len(ver["findings"]) == 4  # the copies fail authentication: verify names them
    finally:
        a.cleanup()
        b.cleanup()


def test_a_root_with_the_old_single_key_keeps_its_chunks(tmp_path: Path) -> None:
    s = Stack(tmp_path)
    try:
        ns = s.render()["namespace"]
        state = str(s.state_dir)
        root_key = root_key_path(state)
        # as before per-namespace keys: the key at <state>/keys/l2-master.key, its
        # fingerprint recorded beside it, every chunk written with it
        s.env["KVP_SERDE_KEY_FILE"] = root_key
        s.launch("--no-vllm")
        stored = store(s, ns, 1)
        s.stop()
        shutil.rmtree(Path(state) / "keys" / ns)  # nothing per namespace existed then
        keys.record_fingerprint(state, keys.fingerprint(Path(root_key).read_bytes()))
        del s.env["KVP_SERDE_KEY_FILE"]

        s.launch("--no-vllm")
        own = namespace_key_path(state, ns)
        assert Path(own).read_bytes() == Path(root_key).read_bytes()  # adopted (a copy)
        assert os.stat(own).st_ino != os.stat(root_key).st_ino
        hits, got = fetch(s, ns, 1)
        assert hits == 4 and got == stored  # every old chunk still hits
        s.stop()
        dry = s.kvp_json("shred", "--root", str(s.root), "--namespace", ns, "--force")
        assert dry["keys_to_destroy"] == [own, root_key]  # no other namespace uses it
        [plan] = [p for p in dry["keys"] if p["state_dir"] == state]
        assert plan["migrated"] is True and plan["root_key_users"] == []
        assert os.path.exists(root_key) and os.path.exists(own)  # a dry run
    finally:
        s.cleanup()


def test_shred_with_a_shared_tier_removes_its_keys_there_too(tmp_path: Path,
                                                             redis: Redis) -> None:
    """Through the CLI: ``shred --config CONFIG --apply --force`` on a deployment with a
    shared tier destroys the key, then the files and the namespace's keys on the store."""
    s = host(tmp_path, "a", redis)
    try:
        ns = s.render()["namespace"]
        s.launch("--no-vllm")
        store(s, ns, 1)
        s.stop()
        assert len(redis.scan_keys(f"{ns}@*")) == 4 and len(s.chunk_files(ns + "_")) == 4
        key = namespace_key_path(str(s.state_dir), ns)
        dry = s.kvp_json("shred", "--config", s.config, "--namespace", ns, "--force")
        assert dry["tier"] == "all" and dry["data"]["shared"]["deleted_keys"] == 4
        assert len(redis.scan_keys(f"{ns}@*")) == 4 and os.path.exists(key)  # a dry run
        out = s.kvp_json("shred", "--config", s.config, "--namespace", ns, "--force",
                         "--apply")
        assert [st["step"] for st in out["steps"]] == ["keys", "tombstone", "data"]
        assert out["destroyed"][0]["path"] == key and not os.path.lexists(key)
        assert redis.scan_keys(f"{ns}@*") == [] and s.chunk_files(ns + "_") == []
        s.launch("--no-vllm")  # a new key: nothing of the old namespace's data is readable
        hits, _ = fetch(s, ns, 1)
        assert hits == 0
    finally:
        s.cleanup()
