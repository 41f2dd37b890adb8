"""Small filesystem helpers for the I/O layer: one atomic writer, one statvfs reader.

Every error is raised as :class:`~kvpersist.errors.KvpError` with the path and a fix, so a
caller never lets an ``OSError`` reach the user as a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpersist.errors import KvpError


def atomic_write(path: str | os.PathLike[str], text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` through a temp file + fsync + rename, with ``mode``.

    Readers see the old file or the new one, never a half-written one. Missing parent
    directories are created 0700. Raises KvpError if the file cannot be written.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise KvpError(f"cannot write {target}: {exc.strerror or exc}; check that its "
                       "directory exists and is writable by this user") from exc
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise KvpError(f"cannot write {target}: {exc.strerror or exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any, mode: int = 0o600) -> None:
    """:func:`atomic_write` of ``obj`` as indented, key-sorted JSON with a final newline."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` or its closest existing ancestor (for statvfs before the root exists)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current.parent != current:
        current = current.parent
    return current


@dataclass(frozen=True)
class FsInfo:
    """The filesystem holding a path (from statvfs): size, free, free for unprivileged users."""

    total_bytes: int
    free_bytes: int
    avail_bytes: int


def fs_info(path: str | os.PathLike[str]) -> FsInfo:
    """statvfs of the filesystem holding ``path`` (or its nearest existing ancestor).

    Raises KvpError if it cannot be read.
    """
    try:
        sv = os.statvfs(nearest_existing(path))
    except (OSError, ValueError) as exc:
        raise KvpError(f"cannot stat the filesystem of {path}: {exc}") from exc
    return FsInfo(total_bytes=sv.f_blocks * sv.f_frsize, free_bytes=sv.f_bfree * sv.f_frsize,
                  avail_bytes=sv.f_bavail * sv.f_frsize)
