"""verify's rules for what authentication cannot see: entries under chunk names that are not
regular files, chunk files the server's user cannot read, and one frame under two names
(docs/lmcache-failure-paths.md)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from kvpersist.l2.verify import rules
from tests.l2_roots import verify_at
from tests.unit.test_verify_walk import MASTER, NS, chunk, frame, put


@pytest.mark.parametrize(("mode", "words"), [
    (stat.S_IFLNK | 0o777, "a symbolic link: LMCache reads chunk files through links"),
    (stat.S_IFIFO | 0o600, "a FIFO: LMCache's load blocks opening it"),
    (stat.S_IFDIR | 0o700, "a directory, not a chunk file"),
    (stat.S_IFSOCK | 0o600, "a socket, not a chunk file"),
    (stat.S_IFCHR | 0o600, "a character device"),
    (stat.S_IFBLK | 0o600, "a block device"),
])
def test_type_verdict_names_what_the_entry_is_and_what_lmcache_does(mode: int,
                                                                    words: str) -> None:
    detail = rules.type_verdict(mode)
    assert detail is not None and detail.startswith(words)


def test_a_regular_file_has_no_type_verdict() -> None:
    assert rules.type_verdict(stat.S_IFREG | 0o600) is None


@pytest.mark.parametrize(("mode", "owner", "group", "readable"), [
    (0o600, 7, 7, True), (0o000, 7, 7, False), (0o200, 7, 7, False),
    (0o040, 8, 7, True), (0o600, 8, 7, False),   # the group's bits for another owner
    (0o004, 8, 8, True), (0o640, 8, 8, False),   # others' bits for another owner and group
    (0o044, 7, 7, False),                         # the owner's own bits decide, not others'
])
def test_readable_by_follows_the_permission_bits(mode: int, owner: int, group: int,
                                                 readable: bool) -> None:
    assert rules.readable_by(stat.S_IFREG | mode, owner, group, 7, 7) is readable
    verdict = rules.perm_verdict(stat.S_IFREG | mode, owner, group, 7, 7)
    assert (verdict is None) is readable
    if verdict is not None:
        assert f"mode {mode:04o}" in verdict and "uid 7" in verdict


def test_shared_frames_are_every_file_sharing_an_iv_counted_once() -> None:
    pairs = [(b"a", "x"), (b"b", "y"), (b"a", "z"), (b"a", "x"), (b"c", "w"), (b"b", "v")]
    assert rules.shared_frames(pairs) == {"x": 2, "z": 2, "y": 2, "v": 2}
    assert rules.shared_frames([(b"a", "x"), (b"a", "x")]) == {}
    assert "under 3 names" in rules.dup_detail(3)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "cache"
    for i in range(4):
        put(r / chunk(i).filename(), frame())
    return r


def kinds(root: Path, **kw: object) -> dict[str, str]:
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, **kw)
    return {Path(f.path).name: f.kind for f in res.findings}


def test_a_copy_and_a_hard_link_of_a_frame_are_dup_findings_under_every_name(
        root: Path) -> None:
    n = chunk
    (root / n(10).filename()).write_bytes((root / n(0).filename()).read_bytes())  # cp
    os.link(root / n(1).filename(), root / n(11).filename())                      # ln
    put(root / n(12).relpath(shard_dirs=True), (root / n(2).filename()).read_bytes())
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None)
    assert res.files == 7 and res.authenticated == 7
    found = {Path(f.path).name: (f.kind, f.detail) for f in res.findings}
    want = {n(i).filename() for i in (0, 10, 1, 11, 2, 12)}
    assert set(found) == want
    assert all(k == "dup" and "under 2 names" in d for k, d in found.values())
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, apply=True)
    assert len(res.quarantined) == 6
    assert sorted(p.name for p in root.glob("*.bin")) == [n(3).filename()]
    assert kinds(root) == {}


def test_a_fifo_a_symlink_and_a_directory_under_chunk_names_are_type_findings(
        root: Path) -> None:
    fifo, link, folder = (root / chunk(i).filename() for i in (20, 21, 22))
    os.mkfifo(fifo, 0o600)
    link.symlink_to(chunk(0).filename())  # a valid frame: LMCache would serve it as chunk 21
    folder.mkdir()
    t0 = time.monotonic()
    found = kinds(root)
    assert time.monotonic() - t0 < 30  # the FIFO was never opened for reading
    assert found == {fifo.name: "type", link.name: "type", folder.name: "type"}
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, apply=True)
    assert len(res.quarantined) == 3
    q = root / ".kvpersist" / "quarantine"
    moved = {p.name.split(".type.")[0]: p for p in q.iterdir()}
    assert stat.S_ISFIFO(moved[fifo.name].lstat().st_mode)
    assert os.readlink(moved[link.name]) == chunk(0).filename()
    assert moved[folder.name].is_dir()
    assert (root / chunk(0).filename()).is_file()  # what the link named is untouched
    assert kinds(root) == {}


def test_a_chunk_file_its_owner_cannot_read_is_a_perm_finding_though_it_authenticates(
        root: Path) -> None:
    locked = root / chunk(1).filename()
    locked.chmod(0)
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None)
    assert [(Path(f.path).name, f.kind) for f in res.findings] == [(locked.name, "perm")]
    assert "mode 0000" in res.findings[0].detail and res.bytes_read == 3 * len(frame())
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, apply=True)
    assert len(res.quarantined) == 1 and not locked.exists()


def test_the_crash_window_sees_odd_entries_made_since_and_serde_none_sees_them_too(
        root: Path) -> None:
    old = root / chunk(30).filename()
    old.symlink_to(chunk(0).filename())
    past = time.time() - 3600
    os.utime(old, (past, past), follow_symlinks=False)
    since = time.time_ns() - 10**9
    new = root / chunk(31).filename()
    os.mkfifo(new, 0o600)
    assert kinds(root, since_ns=since) == {new.name: "type"}
    (root / chunk(3).filename()).chmod(0o200)
    res = verify_at(root, NS, serde="none", rate_mb_s=None)
    assert {Path(f.path).name: f.kind for f in res.findings} == {
        old.name: "type", new.name: "type", chunk(3).filename(): "perm"}
    assert res.bytes_read == 0
