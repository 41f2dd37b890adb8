"""Per-namespace L2 keys: where they live (kvpersist/config/key_paths.py), which key a launch
uses and what shred destroys (kvpersist/l2/keys/plan.py, pure), and the key files themselves
on real directories (kvpersist/l2/keys/store.py: adoption, destruction, tombstones, lookup)."""

from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path

import pytest

from kvpersist.config.key_paths import (
    is_namespace_key,
    namespace_key_path,
    root_key_path,
    tombstone_path,
)
from kvpersist.l2.keys import store as keys
from kvpersist.l2.keys.plan import (
    ADOPT,
    CREATE,
    EXPLICIT,
    USE,
    LaunchKeyFacts,
    plan_launch_key,
    plan_shred_keys,
    root_key_users,
)

NS_A, NS_B, NS_C = ("kvp-" + c * 32 for c in "abc")


# --------------------------------------------------------------------------- paths


def test_paths() -> None:
    assert root_key_path("/s") == "/s/keys/l2-master.key"
    assert namespace_key_path("/s", NS_A) == f"/s/keys/{NS_A}/l2-master.key"
    assert tombstone_path("/s", NS_A) == f"/s/keys/{NS_A}/shredded.json"
    assert is_namespace_key("/s", NS_A, f"/s/keys/{NS_A}/l2-master.key")
    assert not is_namespace_key("/s", NS_A, "/run/credentials/kvp/l2-key")
    assert not is_namespace_key("/s", NS_A, root_key_path("/s"))


@pytest.mark.parametrize("bad", ["", "a/b", ".hidden", "..", "x y", "a\nb"])
def test_a_name_that_is_not_a_namespace_is_no_key_directory(bad: str) -> None:
    with pytest.raises(ValueError):
        namespace_key_path("/s", bad)
    assert not is_namespace_key("/s", bad, f"/s/keys/{bad}/l2-master.key")


def test_the_default_key_file_is_the_namespaces_own() -> None:
    from kvpersist.config.deployment import with_namespace_key
    from kvpersist.config.settings import DeploymentSettings

    s = DeploymentSettings(cache_root="/c", served_model_name="m", model_path="/m",
                           state_dir="/s", l1_size_gb=1, lmcache_host="127.0.0.1",
                           lmcache_port=1, lmcache_http_host="127.0.0.1", lmcache_http_port=2)
    assert with_namespace_key(s, NS_A).serde_key_file == namespace_key_path("/s", NS_A)
    explicit = with_namespace_key(s.__class__(**{**s.__dict__, "serde_key_file": "/k"}), NS_A)
    assert explicit.serde_key_file == "/k"  # the operator's file wins


# --------------------------------------------------------------------------- launch plan


def facts(**kw: bool) -> LaunchKeyFacts:
    base = dict(explicit=False, own_key=False, shredded=False, root_key=False,
                has_files=False, has_manifest=False, root_fingerprint_recorded=True)
    return LaunchKeyFacts(**{**base, **kw})


def test_launch_plan_table() -> None:
    assert plan_launch_key(facts()).action == CREATE  # a new namespace, no root key
    assert plan_launch_key(facts(root_key=True)).action == CREATE  # root key, not ours
    assert plan_launch_key(facts(root_key=True, has_files=True)).action == ADOPT
    assert plan_launch_key(facts(root_key=True, has_manifest=True)).action == ADOPT
    installed = facts(root_key=True, root_fingerprint_recorded=False)
    assert plan_launch_key(installed).action == ADOPT  # e.g. the role's serde_key_b64
    assert plan_launch_key(facts(has_files=True)).action == CREATE  # no root key to adopt


def test_launch_plan_precedence() -> None:
    """Every combination: explicit > own key > tombstone > adoption > a new key; a shredded
    namespace never adopts the root key again."""
    names = ["explicit", "own_key", "shredded", "root_key", "has_files", "has_manifest",
             "root_fingerprint_recorded"]
    for values in itertools.product((False, True), repeat=len(names)):
        f = facts(**dict(zip(names, values, strict=True)))
        got = plan_launch_key(f).action
        if f.explicit:
            assert got == EXPLICIT
        elif f.own_key:
            assert got == USE
        elif f.shredded:
            assert got == CREATE
        else:
            adopt = f.root_key and (f.has_files or f.has_manifest
                                    or not f.root_fingerprint_recorded)
            assert got == (ADOPT if adopt else CREATE), f


# --------------------------------------------------------------------------- shred plan


def test_root_key_users() -> None:
    fps = {NS_A: "r", NS_B: "x"}
    # A's key is a copy of the root key; C has files but no key yet (it would adopt)
    assert root_key_users(NS_A, "r", fps, set(), {NS_A, NS_B, NS_C}) == (NS_C,)
    assert root_key_users(NS_B, "r", fps, set(), {NS_C}) == (NS_A, NS_C)
    assert root_key_users(NS_B, "r", fps, {NS_C}, {NS_C}) == (NS_A,)  # C was shredded
    assert root_key_users(NS_A, None, fps, set(), {NS_C}) == ()  # no root key


def test_shred_plan_of_a_new_namespace_destroys_its_key_only() -> None:
    p = plan_shred_keys(NS_B, "/s", own_key="/s/keys/b/k", own_fp="x", root_key="/s/r",
                        root_fp="r", users=(NS_A,), shredded=False)
    assert p.destroy == ("/s/keys/b/k",) and not p.migrated and p.root_key_kept == ""


def test_shred_plan_of_a_migrated_namespace() -> None:
    last = plan_shred_keys(NS_A, "/s", own_key="/s/a", own_fp="r", root_key="/s/r",
                           root_fp="r", users=(), shredded=False)
    assert last.migrated and last.destroy == ("/s/a", "/s/r")  # its own copy first
    shared = plan_shred_keys(NS_A, "/s", own_key="/s/a", own_fp="r", root_key="/s/r",
                             root_fp="r", users=(NS_C,), shredded=False)
    assert shared.destroy == ("/s/a",) and shared.root_key_kept == "/s/r"
    assert shared.root_key_users == (NS_C,) and NS_C in shared.notes[0]
    # never launched since per-namespace keys: its key IS the root key
    pending = plan_shred_keys(NS_A, "/s", own_key=None, own_fp=None, root_key="/s/r",
                              root_fp="r", users=(), shredded=False)
    assert pending.migrated and pending.destroy == ("/s/r",)
    done = plan_shred_keys(NS_A, "/s", own_key=None, own_fp=None, root_key="/s/r",
                           root_fp="r", users=(), shredded=True)
    assert done.destroy == () and "already shredded" in done.notes[0]


# --------------------------------------------------------------------------- key files


def root_key(state: Path, data: bytes = b"r" * 32) -> Path:
    p = Path(root_key_path(str(state)))
    p.parent.mkdir(parents=True, mode=0o700)
    p.write_bytes(data)
    p.chmod(0o600)
    keys.record_fingerprint(str(state), keys.fingerprint(data))  # as launch did before
    return p


def test_adoption_copies_the_root_key(tmp_path: Path) -> None:
    state = tmp_path / "state"
    root = root_key(state)
    manifest = state / "manifests" / f"{NS_A}.json"
    got = keys.prepare_launch_key(str(state), NS_A, namespace_key_path(str(state), NS_A),
                                  has_files=True, manifest_file=str(manifest))
    own = Path(got.info.path)
    assert got.plan.action == ADOPT and own.read_bytes() == root.read_bytes()
    assert stat.S_IMODE(own.stat().st_mode) == 0o600
    assert stat.S_IMODE(own.parent.stat().st_mode) == 0o700
    assert own.stat().st_ino != root.stat().st_ino  # a copy, not a link
    assert keys.recorded_fingerprint(str(state), NS_A) == got.info.fingerprint
    assert not any(b"r" * 32 in n.encode() for n in got.notes)
    # a new namespace beside it: its own new key
    new = keys.prepare_launch_key(str(state), NS_B, namespace_key_path(str(state), NS_B),
                                  has_files=False, manifest_file=str(state / "none.json"))
    assert new.plan.action == CREATE and new.info.fingerprint != got.info.fingerprint
    again = keys.prepare_launch_key(str(state), NS_A, got.info.path, has_files=True,
                                    manifest_file=str(manifest))
    assert again.plan.action == USE and again.notes == ()


def test_destroy_tombstone_and_relaunch(tmp_path: Path) -> None:
    state = tmp_path / "state"
    root_key(state)
    path = namespace_key_path(str(state), NS_A)
    keys.prepare_launch_key(str(state), NS_A, path, has_files=True,
                            manifest_file=str(state / "m.json"))
    before = keys.state_keys(str(state))
    assert before.fingerprints[NS_A] == before.root_fp  # migrated
    gone = keys.destroy_key(path)
    assert not os.path.lexists(path) and gone.fingerprint == before.root_fp
    keys.write_tombstone(str(state), NS_A, [gone])
    doc = keys.read_tombstone(str(state), NS_A)
    assert doc is not None and doc["destroyed"][0]["fingerprint"] == gone.fingerprint
    assert keys.key_lookup(str(state))(NS_A) is None  # no root-key fallback after a shred
    assert keys.key_lookup(str(state))(NS_C) == b"r" * 32  # a namespace not migrated yet
    # the next launch: a new key, never the root key again
    nxt = keys.prepare_launch_key(str(state), NS_A, path, has_files=True,
                                  manifest_file=str(state / "m.json"))
    assert nxt.plan.action == CREATE and nxt.info.fingerprint != before.root_fp
    assert any("changed" in n for n in nxt.notes)


def test_destroy_refuses_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target.key"
    target.write_bytes(b"t" * 32)
    target.chmod(0o600)
    link = tmp_path / "keys" / "link.key"
    link.parent.mkdir(mode=0o700)
    link.symlink_to(target)
    with pytest.raises(keys.KeyError_):
        keys.destroy_key(str(link))
    assert target.read_bytes() == b"t" * 32 and link.is_symlink()


# --------------------------------------------------------------------------- the command


def chunk(root: Path, ns: str, i: int) -> Path:
    p = root / f"{ns}_01000100_0_{i:064x}.bin"
    p.write_bytes(b"\xaa" * 4096)
    return p


def test_shred_command_on_a_real_tree(tmp_path: Path) -> None:
    """``kvp-admin shred`` on files and keys laid out as a launch leaves them (no server):
    a bad name is a usage error; the dry run deletes nothing; --apply destroys A's key and
    its files, leaves B's; a second shred finds nothing more to destroy."""
    import json

    from tests.cli import kvp_in_process

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    state = tmp_path / ".kvpersist" / "cache"
    for ns in (NS_A, NS_B):
        keys.ensure_key(namespace_key_path(str(state), ns))
    files_a = [chunk(root, NS_A, i) for i in range(3)]
    files_b = [chunk(root, NS_B, i) for i in range(2)]

    bad = kvp_in_process("shred", "--root", str(root), "--namespace", "../x", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout)["schema"] == "kvpersist.error/1"

    dry = kvp_in_process("shred", "--root", str(root), "--namespace", NS_A, "--json")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert doc["dry_run"] and doc["keys_to_destroy"] == [namespace_key_path(str(state), NS_A)]
    assert doc["data"]["deleted"] == {"files": 3, "bytes": 3 * 4096} and doc["steps"] == []
    assert all(p.exists() for p in files_a) and os.path.exists(doc["keys_to_destroy"][0])

    run = kvp_in_process("shred", "--root", str(root), "--namespace", NS_A, "--apply")
    assert run.returncode == 0, run.stderr
    assert "1. destroyed key" in run.stdout and "3. then the data" in run.stdout
    assert not any(p.exists() for p in files_a) and all(p.exists() for p in files_b)
    assert not os.path.lexists(namespace_key_path(str(state), NS_A))
    assert os.path.exists(namespace_key_path(str(state), NS_B))
    assert keys.read_tombstone(str(state), NS_A) is not None

    again = kvp_in_process("shred", "--root", str(root), "--namespace", NS_A, "--json")
    assert json.loads(again.stdout)["keys_to_destroy"] == []
