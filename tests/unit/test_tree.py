"""The cache-tree walker: layout, no symlink ever followed, descriptors closed, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpersist.errors import KvpError, UsageError
from kvpersist.l2.tree import (
    DIR_FLAGS,
    chunk_dirs,
    meta_dir,
    open_rel,
    open_root,
    walk_dirs,
)

NAME = "kvp-" + "a1" * 16 + "_01000100_0_{h}.bin"


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with shard directories, foreign and metadata directories, and symlinks."""
    r = tmp_path / "cache"
    touch(r / NAME.format(h="abcd00"))
    touch(r / "ab/cd" / NAME.format(h="abcd01"))
    touch(r / "ab/ce" / NAME.format(h="abce01"))
    touch(r / "01/02" / NAME.format(h="010201"))
    touch(r / "ab/cd/ef" / NAME.format(h="abcd02"))    # too deep: foreign
    touch(r / "ab/zz" / NAME.format(h="ab0000"))       # not a shard name
    touch(r / "AB/CD" / NAME.format(h="abcd03"))       # upper case: foreign
    touch(r / ".kvpersist/manifests/x.json")
    touch(r / "ff")                                    # a file with a shard name
    outside = tmp_path / "outside"
    touch(outside / "cd" / NAME.format(h="12cd00"))
    (r / "12").symlink_to(outside)                     # a shard-named symlink
    (r / "01" / "03").symlink_to(outside / "cd")
    return r


def test_chunk_dirs_yields_the_root_and_shard_dirs_in_order(root: Path) -> None:
    with open_root(root) as r, chunk_dirs(r.fd) as dirs:
        got = [(d.rel, d.shard) for d in dirs]
    assert got == [("", None), ("01/02", ("01", "02")), ("ab/cd", ("ab", "cd")),
                   ("ab/ce", ("ab", "ce"))]


def test_listing_the_root_through_entries_finds_the_same_dirs(root: Path) -> None:
    seen: dict[str, list[str]] = {}
    with open_root(root) as r, chunk_dirs(r.fd) as dirs:
        for d in dirs:
            seen[d.rel] = sorted(e.name for e in d.entries())
    assert list(seen) == ["", "01/02", "ab/cd", "ab/ce"]
    assert seen["ab/cd"] == sorted(["ef", NAME.format(h="abcd01")])
    assert NAME.format(h="abcd00") in seen[""] and ".kvpersist" in seen[""]


def test_select_partitions_shard_dirs(root: Path) -> None:
    calls: list[tuple[str, str]] = []

    def odd(shard: tuple[str, str]) -> bool:
        calls.append(shard)
        return len(calls) % 2 == 1

    with open_root(root) as r, chunk_dirs(r.fd, select=odd) as dirs:
        got = [d.rel for d in dirs]
    assert calls == [("01", "02"), ("ab", "cd"), ("ab", "ce")]
    assert got == ["", "01/02", "ab/ce"]


def test_descriptors_are_closed_after_an_early_exit(root: Path) -> None:
    before = open_fds()
    with open_root(root) as r:
        with chunk_dirs(r.fd) as dirs:
            for d in dirs:
                if d.shard is not None:
                    break
        with walk_dirs(r.fd, 0) as walk:
            for w in walk:
                for e in os.scandir(w.fd):
                    if e.is_dir(follow_symlinks=False):
                        w.descend(e.name, w.tag + 1)
                if w.depth == 3:
                    break
    assert open_fds() == before


def test_walk_dirs_descends_what_the_caller_chooses_never_a_symlink(root: Path) -> None:
    errors: list[str] = []
    rels: list[tuple[str, int, str]] = []
    with open_root(root) as r, \
            walk_dirs(r.fd, "top", on_error=lambda rel, exc: errors.append(rel)) as walk:
        for d in walk:
            rels.append((d.rel, d.depth, d.tag))
            with os.scandir(d.fd) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if e.name in ("ab", "cd", "ef", "12"):  # "12" is a symlink: refused
                        d.descend(e.name, e.name)
    assert rels == [("", 0, "top"), ("ab", 1, "ab"), ("ab/cd", 2, "cd"),
                    ("ab/cd/ef", 3, "ef")]
    assert errors == ["12"]


def test_open_rel_refuses_symlinks_and_escapes(root: Path) -> None:
    with open_root(root) as r:
        fd = open_rel(r.fd, "ab/cd")
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(root / "ab/cd"))
        finally:
            os.close(fd)
        with pytest.raises(NotADirectoryError):
            open_rel(r.fd, "12")
        with pytest.raises(NotADirectoryError):
            open_rel(r.fd, "01/03")
        with pytest.raises(ValueError):
            open_rel(r.fd, "../x")
        fd = open_rel(r.fd, "")
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(root))
        finally:
            os.close(fd)


def test_open_root_resolves_a_symlinked_root_and_explains_failures(root: Path,
                                                                   tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(root)
    with open_root(link) as r:
        assert r.path == str(root.resolve())
        assert os.fstat(r.fd).st_ino == root.stat().st_ino
    with pytest.raises(UsageError, match="cannot scan .*missing: no such directory"):
        open_root(tmp_path / "missing", purpose="scan")
    with pytest.raises(UsageError, match="not a directory"):
        open_root(root / "ff", purpose="scan")


def test_open_root_unreadable(tmp_path: Path) -> None:
    """Root reads any directory, so the unreadable case runs as another user (uid 65534)."""
    import shutil
    import subprocess
    import sys

    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.fail("this test runs as root with setpriv (util-linux) to act as another user")
    d = tmp_path / "locked"
    d.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    code = ("import sys\n"
            "from kvpersist.errors import KvpError\n"
            "from kvpersist.l2.tree import open_root\n"
            "try:\n"
            f"    open_root({str(d)!r}, purpose='verify')\n"
            "except KvpError as exc:\n"
            "    print(exc); sys.exit(3)\n")
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "run as the user that owns" in res.stdout


def test_meta_dir_creates_and_refuses_symlinks(tmp_path: Path) -> None:
    r = tmp_path / "c"
    r.mkdir()
    with open_root(r) as rd:
        fd = meta_dir(rd, "quarantine")
        os.close(fd)
        assert (r / ".kvpersist/quarantine").is_dir()
        assert (r / ".kvpersist/quarantine").stat().st_mode & 0o777 == 0o700
        with pytest.raises(FileNotFoundError):
            meta_dir(rd, "nope", create=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (r / ".kvpersist/quarantine").rmdir()
    (r / ".kvpersist/quarantine").symlink_to(elsewhere)
    with open_root(r) as rd, pytest.raises(KvpError, match="is a symbolic link"):
        meta_dir(rd, "quarantine")
    r2 = tmp_path / "c2"
    r2.mkdir()
    (r2 / ".kvpersist").symlink_to(elsewhere)
    with open_root(r2) as rd, pytest.raises(KvpError, match="kvpersist will not write"):
        meta_dir(rd)
    assert list(elsewhere.iterdir()) == []


def test_dir_flags_never_follow() -> None:
    assert DIR_FLAGS & os.O_NOFOLLOW and DIR_FLAGS & os.O_DIRECTORY


def test_open_root_permission_denied_is_a_kvp_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpersist.l2.tree as tree

    def denied(name: str, dir_fd: int | None = None) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tree, "open_dir", denied)
    with pytest.raises(KvpError, match="cannot prune .*: Permission denied; run as the user"):
        open_root(tmp_path, purpose="prune")
