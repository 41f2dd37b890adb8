"""The cache-root handle: one opening per use case, passed down (kvpersist.l2.tree.RootDir)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvpersist.l2.tree as tree
from kvpersist.actions.prune import PruneRequest, prune
from kvpersist.actions.report import report
from kvpersist.l2.layout import ChunkName
from kvpersist.l2.tree import open_root

UNP = "kvp-unpinned-" + "c3" * 16


def make_root(tmp_path: Path, n: int = 3) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    for i in range(n):
        (root / ChunkName(UNP, 0x01000100, 0, f"{i:04x}" + "e" * 60).filename()).write_bytes(
            b"\0" * 10)
    return root


@pytest.fixture
def root_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the cache root was opened by (every :func:`open_root`, whoever calls it)."""
    opened: list[str] = []
    real = tree.open_dir

    def counting(name: str, dir_fd: int | None = None) -> int:
        if dir_fd is None:  # open_root's own opening; below the root all is relative
            opened.append(name)
        return real(name, dir_fd)

    monkeypatch.setattr(tree, "open_dir", counting)
    return opened


def test_one_prune_apply_opens_the_root_once(tmp_path: Path, root_opens: list[str]) -> None:
    root = make_root(tmp_path)
    out = prune(str(root), (), PruneRequest(unpinned=True, temp_older_than_s=0), apply=True)
    assert out.result.deleted_files == 3 and not out.result.errors
    assert (root / ".kvpersist" / "runs" / "prune.json").is_file()  # recorded, same handle
    assert root_opens == [str(root.resolve())]


def test_one_report_opens_the_root_once(tmp_path: Path, root_opens: list[str]) -> None:
    root = make_root(tmp_path)
    rep = report(str(root))
    assert rep.scan.chunk_files == 3
    assert root_opens == [str(root.resolve())]


def test_reopen_is_the_same_directory_with_its_own_position(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    with open_root(root) as r:
        fd = r.reopen()
        try:
            assert os.fstat(fd).st_ino == os.fstat(r.fd).st_ino
            assert fd != r.fd and sorted(os.listdir(fd)) == sorted(os.listdir(r.fd))
        finally:
            os.close(fd)
    assert r.fd == -1  # closed by its with block, once
    r.close()
