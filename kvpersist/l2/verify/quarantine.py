"""The chunk files verify saw, the directories it visits, and the quarantine (I/O).

A file is remembered as :class:`Seen` (where it is and which inode it was), so that the
quarantine renames only that very entry: a file that is no longer the one checked (device,
inode, size, mtime) is left alone. Everything is opened relative to directory descriptors
below the open root, never through a symlink; a ``.kvpersist`` or ``quarantine`` that is a
symlink is refused (:func:`kvpersist.l2.tree.meta_dir`).
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvpersist.l2 import layout
from kvpersist.l2.layout import QUARANTINE_DIR, display_name
from kvpersist.l2.tree import RootDir, meta_dir, open_rel


@dataclass(frozen=True, slots=True)
class Seen:
    """A file as verify saw it: where (directory relative to the root, name) and which inode
    (type, device, inode, size, mtime; and its ctime, for the frame record), so quarantine
    moves only that very entry."""

    rel: str
    name: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    fmt: int = stat_mod.S_IFREG
    ctime_ns: int = 0

    @classmethod
    def of(cls, rel: str, name: str, st: os.stat_result) -> Seen:
        return cls(rel, name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                   stat_mod.S_IFMT(st.st_mode), st.st_ctime_ns)

    def same(self, st: os.stat_result) -> bool:
        return (stat_mod.S_IFMT(st.st_mode) == self.fmt and st.st_dev == self.dev
                and st.st_ino == self.ino and st.st_size == self.size
                and st.st_mtime_ns == self.mtime_ns)


class DirCache:
    """The directory of the last file asked for, opened below the root without following a
    symlink (verify visits files directory by directory)."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.rel: str | None = None
        self.fd = -1

    def get(self, rel: str) -> int:
        """The descriptor of directory ``rel``. Raises OSError."""
        if rel != self.rel:
            self.close()
            self.fd = open_rel(self.root_fd, rel)
            self.rel = rel
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.rel = -1, None


def quarantine(r: RootDir, shown_root: str, found: Iterable[tuple[str, str, Seen]],
               skipped: list[str]) -> list[str]:
    """Rename each file of ``found`` (its path as shown, its finding's kind, the file as it
    was seen) into ``.kvpersist/quarantine/`` if it is still the file that was checked (same
    device, inode, size and mtime), relative to directory descriptors opened without
    following a symlink. Returns the quarantined paths; what was not moved goes to
    ``skipped`` with why. Raises KvpError if the quarantine directory cannot be opened or
    made safely (``.kvpersist`` or ``quarantine`` a symlink, no permission)."""
    qfd = meta_dir(r, QUARANTINE_DIR)
    qpath = os.path.join(shown_root, layout.META_DIR, QUARANTINE_DIR)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dirs_open = DirCache(r.fd)
    moved: list[str] = []
    try:
        for path, kind, seen in found:
            src = display_name(path)
            try:
                dfd = dirs_open.get(seen.rel)
                st = os.lstat(seen.name, dir_fd=dfd)
            except FileNotFoundError:
                skipped.append(f"{src}: gone")
                continue
            except OSError as exc:
                skipped.append(f"{src}: {exc.strerror}")
                continue
            if not seen.same(st):
                skipped.append(f"{src}: changed since it was checked")
                continue
            try:
                dst = free_name(qfd, f"{seen.name}.{kind}.{stamp}")
                os.rename(seen.name, dst, src_dir_fd=dfd, dst_dir_fd=qfd)
            except OSError as exc:
                skipped.append(f"{src}: {exc.strerror}")
                continue
            moved.append(os.path.join(qpath, dst))
    finally:
        dirs_open.close()
        os.close(qfd)
    return moved


def quarantine_name(name: str) -> str:
    """The name a file gets in the quarantine (pure): ``.tmp.`` becomes ``.tmp~.``, because
    LMCache's clean-up at a graceful stop deletes every file with ``.tmp.`` in its name
    anywhere under the cache root, the quarantine included."""
    return name.replace(layout.TEMP_MARKER, ".tmp~.")


def free_name(dir_fd: int, name: str) -> str:
    """``name`` (made safe by :func:`quarantine_name`), or ``name.1``, ``name.2``... : the first
    that does not exist in ``dir_fd`` (a quarantined file never replaces another). Raises
    OSError."""
    name = quarantine_name(name)
    candidate, n = name, 0
    while True:
        try:
            os.lstat(candidate, dir_fd=dir_fd)
        except FileNotFoundError:
            return candidate
        n += 1
        candidate = f"{name}.{n}"
