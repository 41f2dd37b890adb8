"""The launch pre-read: which files it picks (pure), how it is planned into a launch, and the
read-path explanation render and budget show."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpersist.l2.hot_files import Candidate, off_reason, plan_preread, preread_cap
from kvpersist.l2.read_path import explain_read_path
from kvpersist.l2.tree import open_root
from kvpersist.stack.preread import PrereadResult, list_candidates, preread, start_preread

GIB = 1024**3
NS = "kvp-" + "a" * 32
OTHER = "kvp-" + "b" * 32


def c(rel: str, size: int, t: int) -> Candidate:
    return Candidate(rel, size, t)


# --------------------------------------------------------------------------- selection (pure)


def test_newest_first_up_to_the_cap() -> None:
    files = [c("old", 100, 1), c("new", 100, 3), c("mid", 100, 2)]
    p = plan_preread(files, 250)
    assert [f.rel for f in p.files] == ["new", "mid"]
    assert p.bytes == 200 and p.cap_bytes == 250
    assert p.candidates == 3 and p.candidate_bytes == 300
    assert "2 most recently used of 3" in p.reason


def test_everything_fits() -> None:
    p = plan_preread([c("a", 10, 1), c("b", 10, 2)], 20)
    assert [f.rel for f in p.files] == ["b", "a"] and p.reason.startswith("all 2")


def test_stops_at_the_first_file_that_does_not_fit() -> None:
    # a recency prefix: the small old file after the big one is not taken around the gap
    p = plan_preread([c("newest", 10, 9), c("big", 1000, 8), c("small-old", 10, 1)], 100)
    assert [f.rel for f in p.files] == ["newest"]


def test_ties_broken_by_path_and_empty_files_skipped() -> None:
    p = plan_preread([c("b", 5, 7), c("a", 5, 7), c("empty", 0, 9)], 100)
    assert [f.rel for f in p.files] == ["a", "b"] and p.candidates == 2


def test_zero_cap_is_off() -> None:
    p = plan_preread([c("a", 5, 1)], 0)
    assert p.files == () and p.bytes == 0 and p.reason.startswith("off")


def test_cap_from_share_of_mem_available() -> None:
    assert preread_cap(16 * GIB, 0.25) == 4 * GIB
    assert preread_cap(16 * GIB, 0) == 0
    assert preread_cap(0, 0.5) == 0
    with pytest.raises(ValueError):
        preread_cap(GIB, 1.5)


def test_off_reasons() -> None:
    assert off_reason(0.25, False) == ""
    assert "0" in off_reason(0, False)
    assert "O_DIRECT" not in off_reason(0.25, True) and "direct_io" in off_reason(0.25, True)


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 50)), max_size=40),
       st.integers(0, 1 << 22))
def test_plan_properties(specs: list[tuple[int, int]], cap: int) -> None:
    files = [c(f"f{i:03d}", size, t) for i, (size, t) in enumerate(specs)]
    p = plan_preread(files, cap)
    chosen = {f.rel for f in p.files}
    assert p.bytes == sum(f.size for f in p.files) <= max(cap, 0)
    assert len(chosen) == len(p.files)
    # newest first, and nothing left out is newer than something taken
    times = [f.last_use_ns for f in p.files]
    assert times == sorted(times, reverse=True)
    left = [f for f in files if f.size > 0 and f.rel not in chosen]
    if p.files and left:
        assert max(f.last_use_ns for f in left) <= min(times)


# --------------------------------------------------------------------------- listing (real files)


def make_tree(root: Path) -> dict[str, Path]:
    """A cache root with the namespace's chunk files (flat and sharded) and everything the
    pre-read must leave alone."""
    root.mkdir(mode=0o700)
    flat = root / f"{NS}_01000100_0_00aa.bin"
    flat.write_bytes(b"x" * 4096)
    (root / "00" / "bb").mkdir(parents=True)
    sharded = root / "00" / "bb" / f"{NS}_01000100_0_00bbcc.bin"
    sharded.write_bytes(b"y" * 8192)
    outside = root.parent / "outside.bin"
    outside.write_bytes(b"z" * 100)
    (root / f"{NS}_01000100_0_00cc.bin").symlink_to(outside)          # a symlink: never
    (root / "11").symlink_to(root / "00")                              # a linked shard dir
    os.mkfifo(root / f"{NS}_01000100_0_00dd.bin")                      # not a regular file
    (root / f"{NS}_junk.bin").write_bytes(b"j")                        # does not parse
    (root / f"{NS}_01000100_0_00ee.bin.tmp.abcdef").write_bytes(b"t")  # in flight
    (root / f"{OTHER}_01000100_0_00ff.bin").write_bytes(b"o")          # another namespace
    (root / ".kvpersist").mkdir()
    (root / ".kvpersist" / f"{NS}_01000100_0_0011.bin").write_bytes(b"m")  # metadata dir
    return {"flat": flat, "sharded": sharded}


def test_lists_only_the_namespaces_regular_chunk_files(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    real = make_tree(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        errors: list[str] = []
        got = {x.rel: x.size for x in list_candidates(fd, NS, errors)}
    finally:
        os.close(fd)
    assert got == {str(p.relative_to(root)): p.stat().st_size for p in real.values()}
    assert errors == []


def _preread(root: Path, cap_bytes: int) -> PrereadResult:
    with open_root(root, purpose="pre-read") as r:
        return preread(r, NS, cap_bytes=cap_bytes)


def test_preread_advises_what_the_plan_picks(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    real = make_tree(root)
    os.utime(real["sharded"], ns=(10**18, 10**18))  # 2001: the flat file is the newest
    res = _preread(root, 5000)
    assert res.files == [real["flat"].name] and res.bytes == 4096
    assert res.plan.candidates == 2 and res.errors == []
    res = _preread(root, 1 << 30)
    assert sorted(res.files) == sorted(str(p.relative_to(root)) for p in real.values())
    assert res.to_dict()["schema"] == "kvpersist.preread/1"


def test_preread_skips_a_file_swapped_for_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    real = make_tree(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cands = list_candidates(fd, NS)
    finally:
        os.close(fd)
    # between listing and advising, the flat file becomes a symlink: advise refuses it
    real["flat"].unlink()
    real["flat"].symlink_to(tmp_path / "outside.bin")
    from kvpersist.stack.preread import advise

    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rels = sorted(x.rel for x in cands)
        with pytest.raises(OSError):
            advise(fd, real["flat"].name)
        assert advise(fd, rels[0]) == 8192  # the sharded one
    finally:
        os.close(fd)


def test_direct_io_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    from kvpersist.system.files import direct_io_problem

    # this filesystem (ext4 here) supports O_DIRECT; the probe file has no name
    assert direct_io_problem(tmp_path) == ""
    assert list(tmp_path.iterdir()) == []


def test_start_preread_never_raises(tmp_path: Path) -> None:
    pid, why = start_preread([str(tmp_path / "no-such-python"), "-c", "pass"],
                             log=str(tmp_path / "preread.log"), cwd=str(tmp_path))
    assert pid is None and why.startswith("pre-read not started")
    pid, why = start_preread([sys.executable, "-c", "pass"], log=str(tmp_path / "p.log"),
                             cwd=str(tmp_path))
    assert pid is not None and why == ""
    os.waitpid(pid, 0)


# --------------------------------------------------------------------------- explanation (pure)


def test_read_path_lines() -> None:
    import dataclasses

    from kvpersist.config.generic import GenericConfig

    from .test_render import dep  # the deployment helper of the render tests

    g = dataclasses.replace(GenericConfig(), l2_use_direct_io=False)
    d = dep({"KVP_PREREAD_RAM_SHARE": "0.25"}, g)
    rp = explain_read_path(d, mem_available=8 * GIB)
    assert rp.preread_cap_bytes == 2 * GIB and rp.preread_off == ""
    assert rp.lines[0].startswith("L2 reads: buffered") and "A/B" in rp.lines[0]
    assert "2 GiB" in rp.lines[1] or "2.0 GiB" in rp.lines[1]
    assert rp.changed == ("l2.use_direct_io",)
    default = explain_read_path(dep())
    assert default.changed == () and default.lines[0].startswith("L2 reads: O_DIRECT")
    assert default.to_dict()["preread"] == "off" and default.preread_cap_bytes is None
    assert "KVP_PREREAD_RAM_SHARE is 0" in default.preread_off


def test_read_path_names_settings_that_leave_the_defaults() -> None:
    import dataclasses

    from kvpersist.config.generic import GenericConfig
    from kvpersist.stack.render import render

    from .test_render import TEMPLATES, dep

    g = dataclasses.replace(GenericConfig(), l2_shard_dirs=True, chunk_size=512)
    d = dep({"KVP_PREREAD_RAM_SHARE": "0.25"}, g)
    rp = explain_read_path(d)
    assert rp.changed == ("l2.shard_dirs", "server.chunk_size")
    assert "direct_io" in rp.preread_off  # O_DIRECT reads never see the page cache
    assert any("re-keys every chunk" in line for line in rp.lines)
    r = render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    assert r.as_json()["read_path"] == rp.to_dict()
    assert r.as_json()["read_path"]["lines"][0].startswith("L2 reads: O_DIRECT, ab/cd shard")
