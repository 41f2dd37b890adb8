"""Warm-set pins: the manifest (pure), reading and measuring it on a real directory tree,
and the read-only commands honouring it (prune never selects a pin unless the namespace is
named, report counts them, verify reads them first) without importing lmcache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpersist.l2.layout import ChunkName
from kvpersist.l2.pins.store import measure_pins, pins_path
from kvpersist.l2.pins.usage import (
    PinnedUsage,
    all_names,
    parse_pin_document,
    pin_document,
    relpath_problem,
    without_pins,
)
from kvpersist.l2.retention import BUCKET_NS, Selection, plan_explicit, plan_retention
from kvpersist.l2.tree import open_root

from ..conftest import REPO, clean_env
from ..l2_roots import prune_at, read_pins_at, remove_pins_at, scan_at, verify_at, write_pins_at
from .test_cli_startup import HEAVY, WRAPPER, matching

NS = "kvp-" + "1" * 32
OTHER = "kvp-" + "2" * 32


def name(ns: str, i: int, rank: int = 0x01000100) -> str:
    return ChunkName(ns, rank, 0, f"{i:064x}").filename()


def doc(files: list[str], ns: str = NS) -> dict[str, object]:
    return pin_document(ns, "f" * 64, files, world_size=1, chunk_size=256,
                        hash_algorithm="blake3", shard_dirs=False, chunks=len(files),
                        created_ns=1)


# ----------------------------------------------------------------------------- pure


def test_a_manifest_holds_only_its_namespaces_chunk_files() -> None:
    good = [name(NS, 1), name(NS, 2)]
    pins, why = parse_pin_document(json.loads(json.dumps(doc(good))), NS)
    assert why == "" and pins is not None and pins.files == frozenset(good)
    sharded = ChunkName(NS, 0x01000100, 0, "ab" * 32).relpath(shard_dirs=True)
    assert relpath_problem(sharded, NS) == ""
    for rel, why in [(name(OTHER, 1), "belongs to"), ("x.bin", "not an LMCache"),
                     ("../" + name(NS, 1), "chunk file path"),
                     ("00/00/" + ChunkName(NS, 0x01000100, 0, "ab" * 32).filename(),
                      "shard directory"), ("a/b", "chunk file path")]:
        assert why in relpath_problem(rel, NS)
        with pytest.raises(ValueError):
            doc([*good, rel])
    bad = doc(good)
    bad["files"] = [*good, name(OTHER, 3)]
    assert parse_pin_document(bad, NS)[0] is None
    assert parse_pin_document(doc(good), OTHER)[0] is None
    assert parse_pin_document({"schema": "x"}, NS)[0] is None


def test_without_pins_subtracts_files_bytes_and_their_hours() -> None:
    left = without_pins(10, 1000, {5: [6, 600], 6: [4, 400]}, 7 * BUCKET_NS,
                        PinnedUsage(5, 500, 1, {5: [2, 200], 6: [4, 400], 9: [1, 1]}))
    assert (left.files, left.bytes, left.use_hist) == (5, 500, {5: [4, 400]})


def test_a_byte_target_never_counts_on_pinned_bytes() -> None:
    now = 10 * BUCKET_NS
    temp = without_pins(0, 0, {}, 0, PinnedUsage())
    stale = without_pins(10, 1000, {1: [10, 1000]}, 2 * BUCKET_NS,
                         PinnedUsage(4, 400, 0, {1: [4, 400]}))
    plan = plan_retention({NS: stale}, temp, active=[OTHER], need_bytes=900, now_ns=now)
    assert plan.bytes == 600 and not plan.satisfied
    only_pins = without_pins(4, 400, {1: [4, 400]}, 2 * BUCKET_NS,
                             PinnedUsage(4, 400, 0, {1: [4, 400]}))
    assert plan_explicit({NS: only_pins}, temp, active=[OTHER], now_ns=now,
                         stale=True).selections == ()
    named = plan_explicit({NS: only_pins}, temp, active=[OTHER], now_ns=now, namespaces=[NS])
    assert [s.named for s in named.selections] == [True]


# ----------------------------------------------------------------------------- on disk


def make_root(tmp_path: Path, sizes: dict[str, int]) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    for n, size in sizes.items():
        (root / n).write_bytes(b"\0" * size)
    return root


def test_pins_are_written_read_measured_and_removed_through_directory_fds(
        tmp_path: Path) -> None:
    pinned = [name(NS, 1), name(NS, 2), name(NS, 3)]
    root = make_root(tmp_path, {pinned[0]: 100, pinned[1]: 50, name(NS, 9): 7})
    os.symlink(root / pinned[0], root / pinned[2])  # a symlink is never a pinned file
    path = write_pins_at(root, doc(pinned))
    assert Path(path).stat().st_mode & 0o777 == 0o600
    # the writer and the warm-up name the manifest with one function
    assert path == pins_path(os.path.realpath(root), NS)
    assert pins_path(root, NS) == str(root / ".kvpersist" / "pins" / f"{NS}.json")
    read = read_pins_at(root)
    assert read.problems == () and set(read.pins) == {NS} and read.held == frozenset()
    with open_root(root) as r:
        assert measure_pins(r, read.pins[NS]).to_dict() == {"files": 2, "bytes": 150,
                                                               "missing": 1}
    # a manifest that is not its namespace's: that namespace is held whole, and named
    (root / ".kvpersist" / "pins" / f"{OTHER}.json").write_text(json.dumps(doc(pinned)))
    read = read_pins_at(root)
    assert set(read.pins) == {NS, OTHER} and read.held == {OTHER} and read.holds(OTHER)
    assert not read.holds(NS) and read.names == frozenset(pinned)
    (problem,) = read.problems
    assert f"pins/{OTHER}.json" in problem and "held as pinned" in problem
    assert remove_pins_at(root, NS) and not remove_pins_at(root, NS)


def test_a_symlinked_pins_directory_is_neither_read_nor_written(tmp_path: Path) -> None:
    root = make_root(tmp_path, {})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / ".kvpersist").mkdir()
    os.symlink(elsewhere, root / ".kvpersist" / "pins")
    with pytest.raises(Exception, match="symbolic link"):
        write_pins_at(root, doc([name(NS, 1)]))
    assert list(elsewhere.iterdir()) == []
    read = read_pins_at(root)
    assert read.pins == {} and "symbolic link" in read.unreadable_dir and read.holds(NS)
    assert "every namespace is held" in read.problems[0]


def test_prune_keeps_pinned_files_unless_the_namespace_is_named(tmp_path: Path) -> None:
    pinned = [name(NS, 1), name(NS, 2)]
    others = [name(NS, 3), name(NS, 4), name(NS, 5)]
    root = make_root(tmp_path, {n: 10 for n in pinned + others})
    old = time.time() - 7200
    for n in pinned + others:
        os.utime(root / n, (old, old))
    keep = frozenset(pinned)
    stale = Selection("stale", NS, None, 5, 50, "stale")
    dry = prune_at(root, [stale], keep=keep, dry_run=True)
    assert (dry.deleted_files, dry.kept_pinned) == (3, 2)
    res = prune_at(root, [stale], keep=keep, dry_run=False)
    assert (res.deleted_files, res.kept_pinned, res.deleted_pinned) == (3, 2, 0)
    assert sorted(p.name for p in root.glob("*.bin")) == sorted(pinned)
    write_pins_at(root, doc(pinned))
    named = Selection("stale", NS, None, 2, 20, "named", named=True)
    res = prune_at(root, [named], keep=keep, dry_run=False)
    assert (res.deleted_files, res.deleted_pinned, res.pins_removed) == (2, 2, [NS])
    assert list(root.glob("*.bin")) == []


def test_a_namespace_held_whole_is_kept_by_every_selection_but_a_named_one(
        tmp_path: Path) -> None:
    """An unreadable pin manifest holds its namespace (``keep_namespaces``), an unlistable
    pins directory every namespace (``keep_all``): their files count as pinned."""
    files = [name(NS, i) for i in range(3)] + [name(OTHER, i) for i in range(2)]
    root = make_root(tmp_path, {n: 10 for n in files})
    sels = [Selection("stale", NS, None, 3, 30, "stale"),
            Selection("stale", OTHER, None, 2, 20, "stale")]
    res = prune_at(root, sels, keep_namespaces=frozenset({NS}), dry_run=False)
    assert (res.deleted_files, res.kept_pinned) == (2, 3)
    assert sorted(p.name for p in root.glob("*.bin")) == sorted(files[:3])
    res = prune_at(root, sels, keep_all=True, dry_run=False)
    assert (res.deleted_files, res.kept_pinned) == (0, 3)
    named = Selection("stale", NS, None, 3, 30, "named", named=True)
    res = prune_at(root, [named], keep_all=True, dry_run=False)
    assert (res.deleted_files, res.deleted_pinned) == (3, 3)


def test_many_unreadable_pin_manifests_are_all_held_the_first_20_named(
        tmp_path: Path) -> None:
    root = make_root(tmp_path, {})
    pins = root / ".kvpersist" / "pins"
    pins.mkdir(parents=True)
    for i in range(100):
        (pins / f"kvp-{i:032x}.json").write_text('{"schema": NaN}')
    read = read_pins_at(root)
    assert len(read.held) == 100 and len(read.problems) == 21
    assert "and 80 more unreadable pin manifest(s)" in read.problems[-1]
    assert all("NaN" in p for p in read.problems[:20])


def test_verify_reads_the_pins_first(tmp_path: Path) -> None:
    good = {name(NS, i): 100 for i in range(6)}
    short = {name(NS, 10 + i): 60 for i in range(4)}
    root = make_root(tmp_path, {**good, **short})
    first = frozenset(list(short)[2:])  # two of the four damaged files are pinned
    res = verify_at(root, NS, serde="none", first=first)
    assert res.pinned == 2 and res.pinned_findings == 2
    assert {Path(f.path).name for f in res.findings[:2]} == first
    assert len(res.findings) == 4


def test_read_only_commands_honour_pins_without_importing_lmcache(tmp_path: Path) -> None:
    pinned = [name(NS, 1), name(NS, 2)]
    root = make_root(tmp_path, {pinned[0]: 30, pinned[1]: 20, name(NS, 3): 5})
    write_pins_at(root, doc(pinned))
    env = dict(clean_env(), KVP_CACHE_ROOT=str(root))
    out = subprocess.run([sys.executable, "-c", WRAPPER, "report", "--root", str(root),
                          "--json"], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120)
    data = json.loads(out.stdout.split("\nMODULES=")[-1])
    assert data["code"] == 0 and matching(data["modules"], HEAVY) == []
    report = json.loads(out.stdout.split("\nMODULES=")[0])
    (row,) = [r for r in report["namespaces"] if r["namespace"] == NS]
    assert row["warm_pins"] == {"files": 2, "bytes": 50, "missing": 0, "listed": 2,
                                "warm_file_sha256": "f" * 64, "unreadable": None}
    docs = {}
    for args in (["prune", "--root", str(root), "--namespace", NS, "--json"],
                 ["warmup", "--help"]):
        out = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True,
                             text=True, env=env, cwd=REPO, timeout=120)
        data = json.loads(out.stdout.split("\nMODULES=")[-1])
        assert data["code"] == 0 and matching(data["modules"], HEAVY) == [], args
        docs[args[0]] = out.stdout.split("\nMODULES=")[0]
    prune = json.loads(docs["prune"])  # a dry run naming the namespace: the pins go too
    assert prune["dry_run"] and prune["deleted"]["files"] == 3 and prune["deleted_pinned"] == 2


def test_the_scan_and_the_pin_histogram_use_the_same_hours(tmp_path: Path) -> None:
    pinned = [name(NS, 1)]
    root = make_root(tmp_path, {pinned[0]: 10, name(NS, 2): 10})
    res = scan_at(root, hist=True)
    pins, _ = parse_pin_document(doc(pinned), NS)
    assert pins is not None and all_names([pins]) == frozenset(pinned)
    with open_root(root) as r:
        pu = measure_pins(r, pins, hist=True)
    u = res.prefixes[NS]
    left = without_pins(u.files, u.bytes, u.use_hist, u.last_use_ns, pu)
    assert (left.files, left.bytes, sum(v[0] for v in left.use_hist.values())) == (1, 10, 1)
