"""Remove one conversation's chunk files from an open cache root (I/O).

:func:`forget_files` is given the open root and the keys of a :class:`~kvpersist.l2.forget.plan.
ForgetPlan` (their files already parse-checked as the namespace's chunks). It works as
:mod:`kvpersist.l2.prune` does, on named files instead of a listing:

- each directory (the root, or its ``ab/cd`` shard) is opened relative to the root's
  descriptor one component at a time, never through a symlink (``O_NOFOLLOW``);
- each file is ``lstat``ed relative to its directory's descriptor: what is not a regular file
  (a symlink, a FIFO, a directory under a chunk's name), and a file below a symlink where its
  shard directory should be, is counted (``not_regular``) and never touched;
- the dry run stops there; ``apply`` takes the root's prune lock, then ``lstat``s each file
  again just before ``unlink(name, dir_fd=...)`` and deletes it only if it is still a regular
  file with the inode, size and change time measured (a file LMCache wrote again meanwhile is
  counted as changed and left: run it again).

A file that is not there is an ordinary miss (``absent``). Temp files (``<name>.tmp.<hex>``)
of an in-flight write are not touched (LMCache renames them into place; ``forget`` run again
after the write removes what it published).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat as stat_mod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.l2.forget.plan import ChunkKey
from kvpersist.l2.layout import display_name, parse_chunk_name
from kvpersist.l2.prune import ERRORS_CAP, prune_lock
from kvpersist.l2.tree import RootDir, open_rel


@dataclass
class FilesOutcome:
    """The NVMe tier: what was found and what was (or would be) deleted, in files."""

    root: str
    dry_run: bool
    state: str = "checked"  # checked / deleted / no_root
    found_files: int = 0
    found_bytes: int = 0
    deleted_files: int = 0
    deleted_bytes: int = 0
    absent: int = 0
    not_regular: int = 0
    changed: int = 0
    kept_pinned_files: int = 0
    kept_pinned_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.changed

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "state": self.state,
                "found": {"files": self.found_files, "bytes": self.found_bytes},
                "deleted": {"files": self.deleted_files, "bytes": self.deleted_bytes},
                "kept_pinned": {"files": self.kept_pinned_files,
                                "bytes": self.kept_pinned_bytes},
                "absent": self.absent, "skipped_not_regular": self.not_regular,
                "skipped_changed": self.changed, "errors": self.errors}


@dataclass(frozen=True)
class _Found:
    key: ChunkKey
    dir_rel: str
    st: os.stat_result


_NOT_A_DIR = -2


class _Dirs:
    """The chunk directories opened so far (relative to the root, never through a link)."""

    def __init__(self, root: RootDir) -> None:
        self.root = root
        self.fds: dict[str, int | None] = {}

    def get(self, rel: str) -> int | None:
        """The directory's descriptor; None when there is no such directory; raises
        NotADirectoryError when something else (a symlink, a file) has its name."""
        if rel not in self.fds:
            try:
                self.fds[rel] = open_rel(self.root.fd, rel)
            except FileNotFoundError:
                self.fds[rel] = None  # no such shard directory: nothing in it
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                self.fds[rel] = _NOT_A_DIR
        fd = self.fds[rel]
        if fd == _NOT_A_DIR:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (a link?)")
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None and fd >= 0:
                os.close(fd)


@contextlib.contextmanager
def _open_dirs(root: RootDir) -> Iterator[_Dirs]:
    dirs = _Dirs(root)
    try:
        yield dirs
    finally:
        dirs.close()


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_dev, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == \
        (b.st_ino, b.st_dev, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


def forget_files(root: RootDir, targets: Sequence[ChunkKey], *, apply: bool,
                 kept: Sequence[ChunkKey] = ()) -> FilesOutcome:
    """Measure (and with ``apply`` delete) the files of ``targets`` on ``root``; ``kept``
    (the pins a forget keeps) are measured only. Raises PruneLocked when another prune or
    forget holds the root's lock, KvpError when the lock cannot be taken; errors on single
    files are collected in the result."""
    out = FilesOutcome(root.path, not apply)

    def error(rel: str, exc: OSError) -> None:
        if len(out.errors) < ERRORS_CAP:
            out.errors.append(f"{display_name(rel)}: {exc.strerror or exc}")

    ctx = prune_lock(root) if apply else contextlib.nullcontext()
    with ctx, _open_dirs(root) as dirs:
        for k in kept:
            f = _stat(dirs, k, out, error, counting=False)
            if f is not None:
                out.kept_pinned_files += 1
                out.kept_pinned_bytes += f.st.st_size
        found: list[_Found] = []
        for k in targets:
            f = _stat(dirs, k, out, error, counting=True)
            if f is not None:
                found.append(f)
                out.found_files += 1
                out.found_bytes += f.st.st_size
        if not apply:
            return out
        out.state = "deleted"
        for f in found:
            dfd = dirs.get(f.dir_rel)
            assert dfd is not None
            try:
                st = os.lstat(f.key.name, dir_fd=dfd)
            except FileNotFoundError:
                out.absent += 1
                continue
            except OSError as exc:
                error(f.key.relpath, exc)
                continue
            if not stat_mod.S_ISREG(st.st_mode) or not _same(st, f.st):
                out.changed += 1
                continue
            try:
                os.unlink(f.key.name, dir_fd=dfd)
            except FileNotFoundError:
                out.absent += 1
                continue
            except OSError as exc:
                error(f.key.relpath, exc)
                continue
            out.deleted_files += 1
            out.deleted_bytes += st.st_size
    return out


def _stat(dirs: _Dirs, k: ChunkKey, out: FilesOutcome, error: Any,
          counting: bool) -> _Found | None:
    """The key's file if it is a regular file whose name parses; None otherwise (counted)."""
    if parse_chunk_name(k.name) is None:  # never a name that does not parse
        return None
    rel = posixpath.dirname(k.relpath)
    try:
        dfd = dirs.get(rel)
    except NotADirectoryError:
        # a link (or a file) where its shard directory should be: never followed
        if counting:
            out.not_regular += 1
        return None
    except OSError as exc:
        error(rel, exc)
        return None
    if dfd is None:
        if counting:
            out.absent += 1
        return None
    try:
        st = os.lstat(k.name, dir_fd=dfd)
    except FileNotFoundError:
        if counting:
            out.absent += 1
        return None
    except OSError as exc:
        error(k.relpath, exc)
        return None
    if not stat_mod.S_ISREG(st.st_mode):
        if counting:
            out.not_regular += 1
        return None
    return _Found(k, rel, st)
