"""``kvp-admin launch --check`` writes nothing, and the preflight verdict is pure.

The CLI test snapshots every path under a temp dir (type, mode, size, mtime) that holds the
config, the model, the cache root's parent (the root itself absent), the state and log dirs
and HOME, runs ``launch CONFIG --check`` (with and without ``--no-vllm``: the weights'
digest cache, the identity check and vLLM's own argument parser all run) and compares.
The verdict tests are table-driven on :func:`kvpersist.stack.preflight.judge`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from kvpersist.errors import KvpError
from kvpersist.l2.layout import display_name
from kvpersist.stack.preflight import PortFacts, PreflightFacts, RootFacts, judge
from kvpersist.stack.weights import WeightsCheck
from kvpersist.system.files import accessible_to_others, read_owner_only, readable_by_others

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from ..l2_roots import scan_at
from ..model_dirs import plain_dir

Snapshot = dict[str, tuple[str, int, int, int]]


def snapshot(top: Path) -> Snapshot:
    """Every path under ``top``: (type, mode, size, mtime_ns), symlinks not followed."""
    out: Snapshot = {}
    for d, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            p = os.path.join(d, name)
            st = os.lstat(p)
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode)
                    else "file" if stat.S_ISREG(st.st_mode) else "other")
            out[os.path.relpath(p, top)] = (kind, stat.S_IMODE(st.st_mode), st.st_size,
                                            st.st_mtime_ns)
    return out


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, str, dict[str, str]]:
    """A temp dir holding a copy of configs/cpu-demo, a demo model with a weights file, the
    (existing) parent of an absent cache root, and the places of the state dir, the logs and
    HOME; the config path and the environment of a launch there."""
    top = tmp_path / "t"
    top.mkdir(mode=0o700)
    shutil.copytree(REPO / "configs" / "cpu-demo", top / "configs" / "cpu-demo")
    model = plain_dir(top / "model")
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    (top / "srv").mkdir(mode=0o700)
    (top / "home").mkdir(mode=0o700)
    env = dict(clean_env(), KVP_CACHE_ROOT=str(top / "srv" / "cache"),
               KVP_MODEL_PATH=str(model), KVP_STATE_DIR=str(top / "srv" / "state"),
               KVP_LOG_DIR=str(top / "srv" / "logs"), KVP_LMCACHE_PORT=str(free_port()),
               KVP_LMCACHE_HTTP_PORT=str(free_port()), KVP_VLLM_PORT=str(free_port()),
               HOME=str(top / "home"), XDG_CACHE_HOME=str(top / "home" / ".cache"),
               LMCACHE_DISABLE_BANNER="1")
    return top, str(top / "configs" / "cpu-demo" / "identity.env"), env


@pytest.mark.parametrize("extra", [["--no-vllm"], []], ids=["no-vllm", "with-vllm"])
def test_launch_check_writes_nothing(tree: tuple[Path, str, dict[str, str]],
                                     extra: list[str]) -> None:
    top, config, env = tree
    before = snapshot(top)
    res = kvp("launch", config, "--check", *extra, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "preflight ok" in res.stdout
    root = top / "srv" / "cache"
    assert f"cache root {root} does not exist yet: the launch creates it (mode 0700)" \
        in res.stderr
    assert "weights: fingerprint" in res.stderr  # the weights were read (digests computed)
    assert snapshot(top) == before
    assert not root.exists() and not (top / "srv" / "state").exists()


def test_launch_check_on_an_existing_root_writes_nothing_either(
        tree: tuple[Path, str, dict[str, str]]) -> None:
    top, config, env = tree
    (top / "srv" / "cache").mkdir(mode=0o700)
    before = snapshot(top)
    res = kvp("launch", config, "--check", "--no-vllm", "--json", env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "does not exist yet" not in res.stdout + res.stderr
    assert snapshot(top) == before


# --------------------------------------------------------------------------- the verdict
WEIGHTS = WeightsCheck("unchecked", notes=("weights not checked",))
FACTS = PreflightFacts(
    with_vllm=False, pinned=True, namespace="kvp-x", dep_notes=(), serde="aesgcm",
    foreign_notes=(), listener_notes=(), budget_notes=("budget: fine",),
    root=RootFacts("/srv/cache", "dir", parent_is_dir=True, mode=0o700, writable=True,
                   avail_bytes=1 << 40),
    use_direct_io=False, generic_config="generic", service_user_error="", trust=(),
    shared=None, ports=(PortFacts("KVP_LMCACHE_PORT", "127.0.0.1", 1, True),),
    server_exe="lmcache", server_exe_found=True, vllm_mode="process", model_target="/m",
    model_exists=True, docker_found=False, identity_problems=(), identity_notes=(),
    weights=WEIGHTS)


@pytest.mark.parametrize(("root", "problem", "create"), [
    (FACTS.root, "", False),
    (RootFacts("/srv/cache", "absent", parent_is_dir=True, writable=True,
               avail_bytes=1 << 40), "", True),
    (RootFacts("/srv/cache", "absent", parent_is_dir=True, writable=False),
     "cannot create /srv/cache: Permission denied", False),
    (RootFacts("/srv/cache", "absent"), "/srv/cache does not exist", False),
    (RootFacts("/srv/cache", "other"), "/srv/cache is not a directory", False),
    (replace(FACTS.root, mode=0o755), "accessible to others (mode 0755)", False),
    (replace(FACTS.root, writable=False, avail_bytes=None), "not writable by this user",
     False),
    (replace(FACTS.root, avail_bytes=1 << 20), "only 1 MiB free on /srv/cache", False),
    (replace(FACTS.root, writable=False, read_only=True, avail_bytes=None),
     "/srv/cache is on a filesystem mounted read-only", False),
], ids=["dir", "to-create", "parent-not-writable", "no-parent", "not-a-dir", "open-mode",
        "not-writable", "full", "read-only"])
def test_the_cache_root_verdict(root: RootFacts, problem: str, create: bool) -> None:
    pre = judge(replace(FACTS, root=root))
    found = [str(p) for p in pre.problems]
    assert (any(problem in p for p in found) if problem else found == []), found
    assert pre.create_root == ("/srv/cache" if create else "")
    assert any("does not exist yet: the launch creates it" in n for n in pre.notes) == create
    # the budget is shown for a root that is (or will be) a directory
    assert ("budget: fine" in pre.notes) == (root.kind == "dir" or create)


def test_the_verdict_lists_every_problem_in_order() -> None:
    f = replace(FACTS, trust=(("KVP_CACHE_ROOT", "a"), ("KVP_STATE_DIR", "a"),
                              ("KVP_STATE_DIR", "b")),
                ports=(PortFacts("KVP_LMCACHE_PORT", "127.0.0.1", 9, False),),
                server_exe_found=False, root=replace(FACTS.root, mode=0o707))
    where = [p.where for p in judge(f).problems]
    assert where == ["KVP_CACHE_ROOT", "KVP_CACHE_ROOT", "KVP_STATE_DIR", "KVP_LMCACHE_PORT",
                     "lmcache"]  # the same trust problem once


def test_the_mode_rules() -> None:
    assert accessible_to_others(0o40701) and not accessible_to_others(0o40750)
    assert readable_by_others(0o100640) and not readable_by_others(0o100600)


def test_read_owner_only_refuses_what_it_should_not_trust(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"pw\n")
    f.chmod(0o600)
    assert read_owner_only(f, what="secret", max_bytes=3) == b"pw\n"
    with pytest.raises(KvpError, match="holds more than 2 bytes"):
        read_owner_only(f, what="secret", max_bytes=2)
    f.chmod(0o604)
    with pytest.raises(KvpError, match=r"secret .* is readable by others \(mode 0604\); "
                                       "chmod 600"):
        read_owner_only(f, what="secret", max_bytes=3)
    f.chmod(0o600)
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(KvpError, match="secret .*link: Too many levels of symbolic links; "
                                       "fix it"):
        read_owner_only(tmp_path / "link", what="secret", max_bytes=3, fix="fix it")
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(KvpError, match="is not a regular file"):  # and it did not block
        read_owner_only(tmp_path / "fifo", what="secret", max_bytes=3)
    with pytest.raises(KvpError, match="No such file"):
        read_owner_only(tmp_path / "missing", what="secret", max_bytes=3)


# --------------------------------------------------------------------------- LMCache's clean-up
#: what LMCache 0.5.6 deletes at a clean stop that is not its own (every name with '.tmp.'
#: that is no directory, at any depth, .kvpersist included) and what it also deletes that is
#: its own (a temp file of an interrupted write, normal after a kill -9: never a refusal)
NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # configs/cpu-demo
OPERATORS = ["notes.tmp.keep", "sub/draft.tmp.1", ".kvpersist/x.tmp.y", "ab/cd/z.tmp.1",
             "fifo.tmp.f", "link.tmp.broken", "bad\udcff.tmp.k"]
LMCACHES = [f"{NS}_01000100_0_{'ab' * 8}.bin.tmp.{'cd' * 16}",
            f"ab/cd/{NS}_01000100_0_abcd{'0' * 60}.bin.tmp.{'ef' * 16}"]


def plant_tmp_files(root: Path, names: list[str]) -> None:
    for name in names:
        p = os.path.join(os.fsencode(root), os.fsencode(name))
        os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
        if name.startswith("fifo"):
            os.mkfifo(p, 0o600)
        elif name.startswith("link"):
            os.symlink(b"/nonexistent", p)
        else:
            with open(p, "wb") as f:
                f.write(b"an operator's file\n")
    os.symlink("/tmp", root / "dirlink.tmp.d")  # LMCache's os.walk lists it as a directory


def test_launch_check_refuses_what_lmcache_would_delete(
        tree: tuple[Path, str, dict[str, str]]) -> None:
    top, config, env = tree
    root = top / "srv" / "cache"
    root.mkdir(mode=0o700)
    plant_tmp_files(root, OPERATORS + LMCACHES)
    before = snapshot(top)
    res = kvp("launch", config, "--check", "--no-vllm", "--json", env=env, timeout=600)
    assert res.returncode == 2, res.stdout + res.stderr
    [problem] = [p for p in json.loads(res.stdout)["problems"] if ".tmp." in p]
    assert f"{len(OPERATORS)} file(s) under the cache root {root}" in problem, problem
    named = [n for n in OPERATORS if display_name(n) in problem]
    assert len(named) == 5 and f"and {len(OPERATORS) - 5} more" in problem, problem
    assert "\udcff" not in problem and not any(n.split("/")[-1] in problem for n in LMCACHES)
    assert "KVP_ALLOW_LMCACHE_TMP_CLEANUP=true" in problem and "dirlink" not in problem
    # the systemd unit's start (launch --foreground) goes through the same verdict
    unit = kvp("launch", config, "--foreground", env=env, timeout=120)
    assert unit.returncode == 2 and "'.tmp.' in their names" in unit.stderr, unit.stderr
    # the opt-in, by flag or in the config's environment: a warning, and a launch would go on
    for extra, more_env in ((["--allow-lmcache-tmp-cleanup"], {}),
                            ([], {"KVP_ALLOW_LMCACHE_TMP_CLEANUP": "true"})):
        ok = kvp("launch", config, "--check", "--no-vllm", *extra, env={**env, **more_env},
                 timeout=600)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert f"WARNING: {len(OPERATORS)} file(s) under the cache root" in ok.stderr
        assert "the next clean stop deletes them" in ok.stderr
    assert snapshot(top) == before  # --check wrote nothing, deleted nothing
    # LMCache's own temp files alone never block
    for name in OPERATORS:
        os.unlink(os.path.join(os.fsencode(root), os.fsencode(name)))
    alone = kvp("launch", config, "--check", "--no-vllm", env=env, timeout=600)
    assert alone.returncode == 0 and "'.tmp.'" not in alone.stderr, alone.stderr


@pytest.mark.parametrize(("files", "allowed", "problem", "note"), [
    (0, False, False, False), (3, False, True, False), (3, True, False, True),
    (0, True, False, False)], ids=["none", "refused", "allowed", "none-allowed"])
def test_the_tmp_cleanup_verdict(files: int, allowed: bool, problem: bool, note: bool) -> None:
    f = replace(FACTS, tmp_files=files, tmp_samples=("a.tmp.1", "b.tmp.2", "c.tmp.3")[:files],
                allow_tmp_cleanup=allowed)
    pre = judge(f)
    found = [p for p in pre.problems if "'.tmp.'" in p.message]
    assert bool(found) == problem and all(p.where == "KVP_CACHE_ROOT" for p in found)
    assert any("'.tmp.'" in n and n.startswith("WARNING") for n in pre.notes) == note
    if problem:
        assert "a.tmp.1, b.tmp.2, c.tmp.3)" in found[0].message and "more" not in found[0].message


def test_each_name_of_a_linked_file_is_one_lmcache_deletes(tmp_path: Path) -> None:
    """A file with two names: counted once in the totals (as du does), but LMCache's clean-up
    unlinks each name with '.tmp.' in it, whichever name the scan met first; a symlink to a
    directory is never unlinked (os.walk lists it as a directory)."""
    root = tmp_path / "cache"
    (root / "d").mkdir(parents=True, mode=0o700)
    (root / "b.txt").write_text("kept under one name\n")
    os.link(root / "b.txt", root / "z.tmp.1")  # met after b.txt
    (root / "a.tmp.1").write_text("lost under both names\n")
    os.link(root / "a.tmp.1", root / "d" / "c.tmp.2")
    (root / "dir.tmp.link").symlink_to(root / "d")
    for workers in (1, 2):
        res = scan_at(root, workers=workers)
        assert res.foreign.files == 2, workers  # each inode once
        assert sorted(res.lmcache_cleans.samples) == ["a.tmp.1", "d/c.tmp.2", "z.tmp.1"]
