"""Scan and prune on real directory trees: totals against du, and the safety properties."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2.layout import ChunkName, temp_name
from kvpersist.l2.prune import PruneLocked
from kvpersist.l2.retention import plan_explicit
from tests.cli import KVP_ADMIN, kvp
from tests.conftest import REPO, clean_env
from tests.l2_roots import lock_at, prune_at, scan_at

NS_A = "kvp-" + "a1" * 16          # will be the active namespace (when a config is given)
NS_B = "kvp-" + "b2" * 16          # stale
UNP = "kvp-unpinned-" + "c3" * 16  # unpinned
HOUR = 3600


def chunk(prefix: str, i: int, *, world: int = 1, rank: int = 0, group: int = 0,
          salt: str | None = None) -> ChunkName:
    kv = world << 24 | rank << 16 | world << 8 | rank
    return ChunkName(prefix, kv, group, f"{i:04x}" + "e" * 12, salt)


def write(path: Path, size: int, age_s: float = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def build_tree(root: Path, outside: Path) -> dict[str, list[Path]]:
    """A cache root with every kind of entry the scanner must tell apart."""
    root.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[Path]] = {k: [] for k in (NS_A, NS_B, UNP, "test-model", "--a--b",
                                                     "temp_old", "temp_new", "foreign",
                                                     "symlink", "meta")}
    for i in range(6):
        groups[NS_A].append(write(root / chunk(NS_A, i, world=2, rank=i % 2).filename(),
                                  1000 + i, age_s=(6 - i) * 2 * HOUR))
    for i in range(4):  # stale namespace, sharded layout, salted
        c = chunk(NS_B, i, group=1, salt=f"user_{i}")
        groups[NS_B].append(write(root / c.relpath(shard_dirs=True), 700, age_s=10 * HOUR))
    for i in range(3):
        groups[UNP].append(write(root / chunk(UNP, i).filename(), 333, age_s=20 * HOUR))
    groups["test-model"].append(write(root / chunk("test-model", 1).filename(), 50))
    groups["--a--b"].append(write(root / chunk("--a--b", 2).filename(), 60))
    groups["temp_old"].append(write(root / temp_name(chunk(NS_A, 99), "ab" * 16), 11,
                                    age_s=3 * HOUR))
    groups["temp_new"].append(write(root / temp_name(chunk(NS_B, 98), "cd" * 16), 13))
    for rel in ("README", "notes.txt", f"{NS_A}_01000100_0_ZZZZ.bin", f"{NS_A}.bin",
                f"{NS_A}_01000100_0_ABCD.bin", f"{NS_A}_01000100_0_.bin",
                f"{NS_A}_01000100_0_ab.ci.n.bin", f"{NS_A}_01000100_0_abé.bin",
                "ab/stray.bin", f"zz/{chunk(NS_A, 5).filename()}",
                f"ab/cd/{chunk(NS_A, 5).filename()}",  # wrong shard for its hash
                f"deep/x/{chunk(NS_A, 1).filename()}"):
        groups["foreign"].append(write(root / rel, 17))
    # symlinks named like chunks, pointing outside the root: never followed, never deleted
    outside.mkdir(parents=True, exist_ok=True)
    target = write(outside / "precious.bin", 4096)
    link = root / chunk(NS_A, 77).filename()
    link.symlink_to(target)
    groups["symlink"].append(link)
    # a shard-looking directory that is a symlink to a directory full of chunk-named files
    odir = outside / "shard"
    for i in range(3):
        write(odir / "12" / chunk(NS_B, 0x1234 + i).filename(), 99)
    (root / "12").symlink_to(odir)
    groups["symlink"].append(root / "12")
    # kvpersist metadata
    man = {"schema": "kvpersist.manifest/1", "namespace": NS_B, "lmcache_model_name": NS_B,
           "pinned": True, "identity": {"model_id": "org/old", "model_revision": "f" * 40,
                                        "tensor_parallel_size": 1, "kv_cache_dtype": "bfloat16"},
           "canonical_json": "{}", "deployment": {"config": "old", "served_model_name": "old"}}
    groups["meta"].append(write(root / ".kvpersist/manifests" / f"{NS_B}.json", 0))
    (root / ".kvpersist/manifests" / f"{NS_B}.json").write_text(json.dumps(man))
    for ns in (UNP, "kvp-" + "99" * 16):
        m = {**man, "namespace": ns, "pinned": ns.startswith("kvp-u") is False}
        (root / ".kvpersist/manifests" / f"{ns}.json").write_text(json.dumps(m))
    groups["meta"].append(root / ".kvpersist/manifests" / f"{UNP}.json")
    groups["meta"].append(write(root / "lmcache-server.pid", 6))
    return groups


def du_bytes(*paths: Path) -> int:
    """What du --apparent-size -b counts for these paths (the grand total)."""
    if not paths:
        return 0
    out = subprocess.run(["du", "--apparent-size", "-b", "-c", "-s", *map(str, paths)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root (not following symlinks) -> (inode, size)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_size)
    return out


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, dict[str, list[Path]], Path]:
    root = tmp_path / "cache"
    outside = tmp_path / "outside"
    return root, build_tree(root, outside), outside


def write_config(tmp_path: Path, root: Path, **extra: str) -> Path:
    """A deployment config (the cpu-demo identity) whose cache root is ``root``."""
    src = (REPO / "configs/cpu-demo/identity.env").read_text()
    drop = ("KVP_CACHE_ROOT=", *(f"{k}=" for k in extra))
    lines = [ln for ln in src.splitlines() if not ln.startswith(drop)]
    lines.append(f"KVP_CACHE_ROOT={root}")
    lines += [f"{k}={v}" for k, v in extra.items()]
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "identity.env").write_text("\n".join(lines) + "\n")
    return cfg


def namespace_of(cfg: Path) -> str:
    from kvpersist.config.loader import load_deployment

    return load_deployment(str(cfg), clean_env()).namespace


# --------------------------------------------------------------------------- scan


@pytest.mark.parametrize("workers", [1, 2])
def test_scan_totals_equal_du(tree: Any, workers: int) -> None:
    root, g, _ = tree
    res = scan_at(root, workers=workers)
    assert res.total_bytes == du_bytes(root)
    for prefix in (NS_A, NS_B, UNP, "test-model", "--a--b"):
        u = res.prefixes[prefix]
        assert (u.files, u.bytes) == (len(g[prefix]), du_bytes(*g[prefix])), prefix
    assert (res.temp.files, res.temp.bytes) == (2, du_bytes(*g["temp_old"], *g["temp_new"]))
    assert (res.foreign.files, res.foreign.bytes) == (len(g["foreign"]), du_bytes(*g["foreign"]))
    assert res.symlinks.files == 2
    assert res.metadata.files == 4  # three manifests + the pid file
    assert res.prefixes[NS_B].sharded_files == 4
    assert res.prefixes[NS_B].salted_files == 4
    assert res.prefixes[NS_A].ranks == {0x02000200, 0x02010201}
    assert res.foreign_dirs == 2  # zz and deep
    assert not res.errors


def test_scan_parallel_equals_serial(tree: Any) -> None:
    root, _, _ = tree
    a, b = scan_at(root, workers=1), scan_at(root, workers=3)
    assert a.total_bytes == b.total_bytes
    assert {p: (u.files, u.bytes, u.allocated_bytes, u.ranks, u.oldest_mtime_ns)
            for p, u in a.prefixes.items()} == \
           {p: (u.files, u.bytes, u.allocated_bytes, u.ranks, u.oldest_mtime_ns)
            for p, u in b.prefixes.items()}
    assert a.prefixes[NS_A].use_hist == b.prefixes[NS_A].use_hist


def test_hard_links_count_once_like_du(tmp_path: Path) -> None:
    root = tmp_path / "c"
    f = write(root / chunk(NS_A, 1).filename(), 5000)
    os.link(f, root / "hardlink-copy")
    res = scan_at(root)
    assert res.total_bytes == du_bytes(root)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_hard_links_split_between_workers_count_once(tmp_path: Path, workers: int) -> None:
    """60 hard-link pairs whose two names land with different workers (the split is by a
    hash of the name): each inode is counted once whatever the worker count, as du counts."""
    root = tmp_path / "c"
    for i in range(60):
        f = write(root / chunk(NS_A, i).filename(), 1000 + i)
        os.link(f, root / chunk(NS_B, i).filename())  # a second chunk name, same inode
        t = write(root / temp_name(chunk(NS_A, 1000 + i), f"{i:032x}"), 300 + i)
        os.link(t, root / f"foreign-{i}")
    res = scan_at(root, workers=workers)
    assert res.workers == workers
    assert res.total_bytes == du_bytes(root)
    # the first name in path order counts: kvp-a1... sorts before kvp-b2..., foreign- first
    assert res.prefixes[NS_A].files == 60 and NS_B not in res.prefixes
    assert res.foreign.files == 60 and res.temp.files == 0


def test_report_cli_json_and_table(tree: Any) -> None:
    root, g, _ = tree
    r = kvp("report", "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "kvpersist.report/1"
    assert doc["total_bytes"] == du_bytes(root)
    by = {n["prefix"]: n for n in doc["namespaces"]}
    assert by[NS_B]["namespace"] == NS_B and by[NS_B]["status"] == "stale"
    assert by[NS_B]["manifest"]["model_id"] == "org/old"
    assert by["test-model"]["namespace"] is None and by["test-model"]["status"] == "other"
    assert by[NS_A]["tp_sizes"] == [2] and by[NS_A]["active"] is False
    assert [n["bytes"] for n in doc["namespaces"]] == sorted(
        (n["bytes"] for n in doc["namespaces"]), reverse=True)
    for key in ("files", "bytes", "allocated_bytes", "active"):
        assert all(key in n for n in doc["namespaces"])
    assert doc["foreign"]["files"] == len(g["foreign"])
    assert doc["temp"] == {**doc["temp"], "files": 2}
    assert doc["manifests_without_files"] == ["kvp-" + "99" * 16]
    t = kvp("report", "--root", str(root))
    assert t.returncode == 0 and NS_B in t.stdout and "not a namespace" in t.stdout
    assert t.stderr == ""  # no progress output when stderr is not a terminal


def test_report_marks_the_configured_namespace_active(tmp_path: Path, tree: Any) -> None:
    root, _, _ = tree
    cfg = write_config(tmp_path, root)
    ns = namespace_of(cfg)
    write(root / chunk(ns, 1).filename(), 10)
    doc = json.loads(kvp("report", "--config", str(cfg), "--json").stdout)
    by = {n["prefix"]: n for n in doc["namespaces"]}
    assert by[ns]["active"] is True and by[NS_A]["active"] is False
    assert doc["budget_bytes"] == 4 * 1024**3
    assert by[ns]["share_of_budget"] is not None


def test_report_errors(tmp_path: Path) -> None:
    r = kvp("report", "--root", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot scan" in r.stderr
    r = kvp("report")
    assert r.returncode == 2 and "--root" in r.stderr


# --------------------------------------------------------------------------- prune


def test_dry_run_deletes_nothing_and_apply_deletes_exactly_that(tree: Any) -> None:
    root, g, _ = tree
    before = snapshot(root)
    args = ["prune", "--root", str(root), "--namespace", NS_B, "--unpinned",
            "--temp-older-than", "1h", "--json", "--list"]
    dry = kvp(*args)
    assert dry.returncode == 0, dry.stderr
    assert snapshot(root) == before
    listed = set(json.loads(dry.stdout)["files"])
    expect = {str(p.relative_to(root)) for p in g[NS_B] + g[UNP] + g["temp_old"]}
    assert listed == expect
    app = kvp(*args, "--apply")
    assert app.returncode == 0, app.stderr
    doc = json.loads(app.stdout)
    assert set(doc["files"]) == listed
    assert doc["deleted"]["files"] == len(listed)
    after = snapshot(root)
    assert {p for p in set(before) - set(after) if not p.startswith(".kvpersist/")} == listed
    # idempotent: the same prune again deletes nothing and exits 0
    again = kvp(*args, "--apply")
    assert again.returncode == 0 and json.loads(again.stdout)["deleted"]["files"] == 0
    # manifests: the unpinned namespace is gone entirely, so its manifest went with it; the
    # stale one still has a (young) temp file, so its manifest stays; so does the orphan one
    mdir = root / ".kvpersist/manifests"
    assert sorted(p.name for p in mdir.iterdir()) == sorted([f"kvp-{'99' * 16}.json",
                                                             f"{NS_B}.json"])
    assert doc["manifests_removed"] == [UNP]
    g["temp_new"][0].unlink()
    last = json.loads(kvp("prune", "--root", str(root), "--namespace", NS_B, "--apply",
                          "--json").stdout)
    assert last["deleted"]["files"] == 0 and last["manifests_removed"] == [NS_B]


def test_symlinks_and_foreign_files_survive_every_prune(tmp_path: Path, tree: Any) -> None:
    root, g, outside = tree
    cfg = write_config(tmp_path, root)
    outside_before = snapshot(outside)
    keep = {str(p.relative_to(root)): p.lstat().st_ino for p in g["foreign"] + g["symlink"]}
    for args in (["--namespace", NS_A, "--force"], ["--namespace", NS_B], ["--stale"],
                 ["--unpinned"], ["--temp-older-than", "0s"], ["--to-budget", "--force"],
                 ["--namespace", "test-model", "--namespace", "--a--b"]):
        r = kvp("prune", "--config", str(cfg), *args, "--apply")
        assert r.returncode == 0, (args, r.stderr)
    assert snapshot(outside) == outside_before
    for rel, ino in keep.items():
        assert (root / rel).lstat().st_ino == ino, rel
    assert (root / "lmcache-server.pid").exists()
    left = scan_at(root)
    assert left.chunk_files == 0 and left.temp.files == 0


class _Listing:
    """What os.scandir returns, for entries read in advance."""

    def __init__(self, entries: list[os.DirEntry[str]]) -> None:
        self.entries = entries

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self) -> Iterator[os.DirEntry[str]]:
        return iter(self.entries)


def change_after_first_listing(monkeypatch: pytest.MonkeyPatch,
                               change: Callable[[], None]) -> None:
    """Run ``change`` once, after the next directory listing was read and before anything is
    done with it: the tree changes between listing and deletion."""
    real = os.scandir
    pending = [change]

    def scandir(path: Any) -> _Listing:
        with real(path) as it:
            entries = list(it)
        if pending:
            time.sleep(0.05)  # past the kernel's coarse clock tick: the change is datable
            pending.pop()()
        return _Listing(entries)

    monkeypatch.setattr(os, "scandir", scandir)


def test_file_replaced_between_listing_and_deletion_is_not_deleted(
        tree: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root, g, _ = tree
    sel = plan_explicit(scan_at(root).prefixes, scan_at(root).temp, active=set(),
                        now_ns=time.time_ns(), namespaces=(NS_A,)).selections
    assert prune_at(root, sel, dry_run=True).deleted_files == 6
    replaced, grown = g[NS_A][0], g[NS_A][1]

    def change() -> None:
        tmp = replaced.with_name("x.new")
        tmp.write_bytes(b"new content")
        os.replace(tmp, replaced)             # new inode under the listed name
        with open(grown, "ab") as f:          # same inode, different size
            f.write(b"more")
        g[NS_A][2].unlink()                   # vanished

    change_after_first_listing(monkeypatch, change)
    res = prune_at(root, sel, dry_run=False)
    assert res.deleted_files == 3
    assert res.skipped_changed == 2 and res.skipped_vanished == 1
    assert replaced.read_bytes() == b"new content" and grown.exists()


def test_file_used_since_listed_is_kept_for_an_lru_prune(
        tree: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root, g, _ = tree
    scan = scan_at(root)
    from kvpersist.l2.retention import plan_retention

    rp = plan_retention(scan.prefixes, scan.temp, active={NS_A}, need_bytes=10**9,
                        now_ns=time.time_ns(), allow_active=True)
    act = [s for s in rp.selections if s.prefix == NS_A]
    assert act and act[0].before_ns is not None
    oldest = g[NS_A][0]

    def read_since() -> None:                 # read since: atime moves
        os.utime(oldest, (time.time(), os.lstat(oldest).st_mtime))

    change_after_first_listing(monkeypatch, read_since)
    res = prune_at(root, act, dry_run=False)
    assert res.skipped_used == 1 and oldest.exists()


def test_prune_stream_never_touches_symlinks_or_foreign_files(tree: Any) -> None:
    from kvpersist.l2.retention import select_named

    root, g, outside = tree
    outside_before = snapshot(outside)
    keep = {str(p.relative_to(root)): p.lstat().st_ino for p in g["foreign"] + g["symlink"]}
    sels = select_named(active=set(), now_ns=time.time_ns(),
                        namespaces=(NS_A, NS_B, UNP, "test-model", "--a--b"),
                        temp_older_than_s=0).selections
    res = prune_at(root, sels, dry_run=False, workers=2)
    assert not res.errors
    assert snapshot(outside) == outside_before
    for rel, ino in keep.items():
        assert (root / rel).lstat().st_ino == ino, rel
    assert (root / "lmcache-server.pid").exists()
    left = scan_at(root)
    assert left.chunk_files == 0 and left.temp.files == 0
    # every file of NS_B and UNP is gone (temp files too), so are their manifests
    assert sorted(res.manifests_removed) == sorted([NS_B, UNP])
    assert [p.name for p in (root / ".kvpersist/manifests").iterdir()] == [f"kvp-{'99' * 16}.json"]


def test_missing_or_symlinked_roots_are_clear_errors_and_nothing_is_created(
        tmp_path: Path, tree: Any) -> None:
    from kvpersist.errors import KvpError, UsageError

    missing = tmp_path / "missing"
    with pytest.raises(UsageError, match="cannot scan"):
        scan_at(missing)
    with pytest.raises(UsageError, match="cannot prune"):
        prune_at(missing, [], dry_run=False)
    with pytest.raises(UsageError, match="cannot prune"), lock_at(missing):
        pass
    assert not missing.exists()
    root, _, _ = tree
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / ".kvpersist").rename(tmp_path / "meta-moved")
    (root / ".kvpersist").symlink_to(elsewhere)
    with pytest.raises(KvpError, match="symbolic link"), lock_at(root):
        pass
    assert list(elsewhere.iterdir()) == []


def test_second_prune_exits_clearly_while_one_runs(tree: Any) -> None:
    root, _, _ = tree
    with lock_at(root):
        r = kvp("prune", "--root", str(root), "--unpinned", "--apply")
        assert r.returncode == 1
        assert "another kvp-admin prune is running" in r.stderr
        assert "Traceback" not in r.stderr
        with pytest.raises(PruneLocked), lock_at(root):
            pass
        # a dry run needs no lock
        assert kvp("prune", "--root", str(root), "--unpinned").returncode == 0
    assert scan_at(root).prefixes[UNP].files == 3
    assert kvp("prune", "--root", str(root), "--unpinned", "--apply").returncode == 0


def test_concurrent_prunes_delete_each_file_once(tree: Any) -> None:
    root, g, _ = tree
    procs = [subprocess.Popen([*KVP_ADMIN, "prune", "--root",
                               str(root), "--namespace", NS_A, "--apply", "--json"],
                              cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [(p.wait(60), *p.communicate()) for p in procs]
    deleted = sum(json.loads(o)["deleted"]["files"] for rc, o, _ in outs if rc == 0)
    refused = [e for rc, _, e in outs if rc == 1]
    assert deleted == len(g[NS_A])
    assert all("another kvp-admin prune is running" in e for e in refused)
    assert all(rc in (0, 1) for rc, _, _ in outs)


def test_active_namespace_is_refused_without_force(tmp_path: Path, tree: Any) -> None:
    root, _, _ = tree
    cfg = write_config(tmp_path, root)
    ns = namespace_of(cfg)
    files = [write(root / chunk(ns, i).filename(), 10) for i in range(3)]
    r = kvp("prune", "--config", str(cfg), "--namespace", ns, "--apply")
    assert r.returncode == 2 and "--force" in r.stderr
    assert all(f.exists() for f in files)
    r = kvp("prune", "--config", str(cfg), "--namespace", ns, "--apply", "--force", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["deleted"]["files"] == 3


def test_stale_needs_to_know_the_active_deployments(tree: Any) -> None:
    root, _, _ = tree
    r = kvp("prune", "--root", str(root), "--stale")
    assert r.returncode == 2 and "--config" in r.stderr
    r = kvp("prune", "--root", str(root))
    assert r.returncode == 2 and "nothing selected" in r.stderr
    r = kvp("prune", "--root", str(root), "--temp-older-than", "soon")
    assert r.returncode == 2


def test_stale_with_config_keeps_the_active_namespace(tmp_path: Path, tree: Any) -> None:
    root, g, _ = tree
    cfg = write_config(tmp_path, root)
    ns = namespace_of(cfg)
    mine = write(root / chunk(ns, 1).filename(), 10)
    r = kvp("prune", "--config", str(cfg), "--stale", "--apply", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {s["prefix"] for s in doc["selections"]} == {NS_A, NS_B}
    assert mine.exists() and all(p.exists() for p in g[UNP] + g["test-model"])


def test_to_budget_frees_temp_then_unpinned_then_stale(tmp_path: Path, tree: Any) -> None:
    root, g, _ = tree
    # a budget so small that the low watermark needs more than temp + unpinned
    cfg = write_config(tmp_path, root, KVP_L2_BUDGET="8000", KVP_L2_RESERVE="0")
    ns = namespace_of(cfg)
    mine = write(root / chunk(ns, 1).filename(), 10)
    r = kvp("prune", "--config", str(cfg), "--to-budget", "--json")
    assert r.returncode == 0, r.stderr
    kinds = [s["kind"] for s in json.loads(r.stdout)["selections"]]
    assert kinds[:2] == ["temp", "unpinned"] and "stale" in kinds
    assert "active" not in kinds
    r = kvp("prune", "--config", str(cfg), "--to-budget", "--apply")
    assert r.returncode == 0 and mine.exists()
    assert all(p.exists() for p in g["test-model"] + g["temp_new"])


def test_budget_command(tmp_path: Path, tree: Any) -> None:
    root, _, _ = tree
    cfg = write_config(tmp_path, root)
    r = kvp("budget", str(cfg), "--json")
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "kvpersist.budget/1"
    assert doc["budget_bytes"] == 4 * 1024**3
    assert doc["inactive_bytes"] == scan_at(root).chunk_bytes + scan_at(root).temp.bytes
    t = kvp("budget", str(cfg))
    assert "max_capacity_gb" in t.stdout


def test_one_pass_prune_skips_files_replaced_after_they_were_listed(tmp_path: Path) -> None:
    """prune_stream (what the CLI runs) checks each file's inode against the directory listing
    right before unlinking: files replaced mid-run survive, nothing is deleted twice."""
    from kvpersist.l2.prune import PROGRESS_EVERY
    from kvpersist.l2.retention import select_named

    root = tmp_path / "c"
    n = PROGRESS_EVERY + 500
    paths = [write(root / chunk(NS_B, i).filename(), 3) for i in range(n)]
    sels = select_named(active=set(), now_ns=time.time_ns(), namespaces=(NS_B,)).selections
    replaced: list[Path] = []

    def swap_the_rest(done: int) -> None:
        if replaced:
            return
        for p in paths:
            if p.exists():
                tmp = p.with_name(p.name + ".new-tmp")  # foreign name, then renamed over
                tmp.write_bytes(b"fresh")
                os.replace(tmp, p)
                replaced.append(p)

    res = prune_at(root, sels, dry_run=False, progress=swap_the_rest, workers=1)
    assert replaced
    left = [p for p in paths if p.exists()]
    assert res.deleted_files + len(left) == n
    assert res.skipped_changed == len(left)  # exactly the replaced files it had listed
    assert all(p.read_bytes() == b"fresh" for p in left)


@pytest.mark.parametrize("workers", [1, 2])
def test_one_pass_prune_dry_run_equals_apply(tree: Any, workers: int) -> None:
    from kvpersist.l2.retention import select_named

    root, g, _ = tree
    sels = select_named(active=set(), now_ns=time.time_ns(), namespaces=(NS_B, UNP),
                        temp_older_than_s=HOUR).selections
    dry = prune_at(root, sels, dry_run=True, list_paths=True, workers=workers)
    app = prune_at(root, sels, dry_run=False, list_paths=True, workers=workers)
    assert dry.deleted_paths == app.deleted_paths
    assert sorted(dry.deleted_paths or []) == sorted(
        str(p.relative_to(root)) for p in g[NS_B] + g[UNP] + g["temp_old"])
    assert (app.deleted_files, app.deleted_bytes) == (dry.deleted_files, dry.deleted_bytes)


def test_a_symlinked_root_is_scanned_but_nothing_below_is_followed(tree: Any,
                                                                    tmp_path: Path) -> None:
    root, g, _ = tree
    link = tmp_path / "root-link"
    link.symlink_to(root)
    res = scan_at(link)
    assert res.root == str(root.resolve())
    assert res.total_bytes == du_bytes(root)
    assert res.prefixes[NS_B].files == len(g[NS_B])


def test_report_joins_the_manifest_render_writes(tmp_path: Path, tree: Any) -> None:
    """The manifest kvpersist.stack.render produces (as launch writes it, here into a state dir
    outside the cache root) is what the report joins on."""
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.render import manifest

    root, _, _ = tree
    state = tmp_path / "state"
    cfg = write_config(tmp_path, root, KVP_STATE_DIR=str(state))
    dep = load_deployment(str(cfg), clean_env())
    (state / "manifests").mkdir(parents=True)
    (state / "manifests" / f"{dep.namespace}.json").write_text(json.dumps(manifest(dep)))
    write(root / chunk(dep.namespace, 1).filename(), 10)
    doc = json.loads(kvp("report", "--config", str(cfg), "--json").stdout)
    row = next(n for n in doc["namespaces"] if n["prefix"] == dep.namespace)
    assert row["active"] is True
    assert row["manifest"]["model_id"] == "kvpersist/cpu-demo-llama"
    assert row["manifest"]["kv_cache_dtype"] == "bfloat16"
    assert row["manifest"]["config"] == dep.name
