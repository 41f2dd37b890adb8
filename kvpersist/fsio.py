"""Small filesystem helpers for the I/O layer: atomic, permission-restricted writes."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from kvpersist import resources
from kvpersist.errors import ConfigError, KvpError, Problem
from kvpersist.render import TEMPLATE_NAMES


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` through a temp file + fsync + rename, with ``mode``.

    Readers see the old file or the new one, never a half-written one.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def load_templates() -> dict[str, str]:
    """The texts of the launch templates under templates/."""
    root = resources.templates_dir()
    out: dict[str, str] = {}
    for name in TEMPLATE_NAMES:
        try:
            out[name] = (root / name).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(Problem(str(root / name), f"cannot read template: {exc}",
                                      "set KVP_HOME to the kvpersist share directory")) from exc
    return out


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest existing ancestor (for statvfs before the root exists)."""
    current = path
    while not current.exists():
        if current.parent == current:
            break
        current = current.parent
    return current


def fs_usage(path: Path) -> tuple[int, int]:
    """(filesystem size, bytes free for unprivileged users) of the filesystem holding path."""
    try:
        st = os.statvfs(nearest_existing(path))
    except OSError as exc:
        raise KvpError(f"cannot stat the filesystem of {path}: {exc}") from exc
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
