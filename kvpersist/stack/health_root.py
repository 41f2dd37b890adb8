"""The cache root's checks of ``kvp-admin health`` (pure: values in, checks out).

What stock LMCache 0.5.6 does when its cache root stops taking writes (read in its source,
``lmcache/v1/distributed/l2_adapters/``, and proven on loop-mounted ext4 and XFS by
tests/integration/test_full_filesystem.py): a store whose temp file cannot be created
(EROFS; ENOSPC on XFS) or written (ENOSPC: NIXL's POSIX backend reports only
``NIXL_ERR_BACKEND``) removes its temp file and is logged as ``Dynamic NIXL store failed``;
the chunk stays in L1 and is served from there, the chunks on disk are still read, and the
adapter keeps no failed state: the next store after space came back (or after a remount
read-write) is written, without a restart. A chunk whose write failed is not written later:
LMCache does not retry, and while the chunk is resident in L1 a new store of it is a no-op;
it reaches the disk when a request stores it again after it left L1 (an eviction, a restart).

So the verdicts below say *degraded* (serving, no longer caching), name the cause and the
operator's fix, and that no restart is needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvpersist.system.files import accessible_to_others

#: one check: (name, status, detail)
CheckRow = tuple[str, str, str]

RESUME = "writes resume without a restart"


@dataclass(frozen=True)
class RootFacts:
    """The cache root as ``health`` found it (plain data)."""

    exists: bool = False
    mode: int | None = None
    #: ``access(W_OK | X_OK)``: false on a read-only filesystem too
    writable: bool = False
    #: the filesystem holding it is mounted read-only (``statvfs`` ``ST_RDONLY``, and its
    #: superblock where that could be read)
    read_only: bool = False
    #: read-only only in this process's view of it (a sandbox such as the health unit's
    #: ``ProtectSystem=strict``): the filesystem is read-write, ``writable`` says nothing
    sandboxed: bool = False
    avail_bytes: int | None = None
    reserve_bytes: int | None = None
    budget: dict[str, Any] | None = None
    budget_error: str = ""


def root_checks(r: RootFacts) -> list[CheckRow]:
    """The ``cache_root*`` checks (pure): ``cache_root`` (down when missing), then
    ``cache_root.permissions``, ``cache_root.read_only``, ``cache_root.free_space`` (where
    the free space was read) and ``cache_root.budget`` (where a budget record exists)."""
    if not r.exists:
        return [("cache_root", "down", "cache root missing")]
    out: list[CheckRow] = []
    problems = []
    if r.mode is not None and accessible_to_others(r.mode):
        problems.append(f"accessible to others (mode {r.mode:04o})")
    if not r.writable and not r.read_only and not r.sandboxed:  # read-only: its own check
        problems.append("not writable")
    out.append(("cache_root.permissions", "degraded" if problems else "ok",
                "; ".join(problems) or f"mode {r.mode or 0:04o}, "
                + ("writable" if r.writable else "write access not testable from a "
                   "read-only sandbox" if r.sandboxed else "on a read-only filesystem")))
    if r.read_only:
        out.append(("cache_root.read_only", "degraded",
                    "the filesystem holding the cache root is mounted read-only: every L2 "
                    "write fails (EROFS), new chunks are not persisted; serving continues "
                    "from L1 and the chunks on disk. Find why (a remount, or the kernel "
                    "after I/O errors: dmesg), then `mount -o remount,rw`: " + RESUME))
    elif r.sandboxed:
        out.append(("cache_root.read_only", "ok",
                    "the filesystem is mounted read-write; read-only only in this check's "
                    "own sandbox (e.g. the health unit's ProtectSystem=strict)"))
    else:
        out.append(("cache_root.read_only", "ok", "mounted read-write"))
    if r.avail_bytes is not None and r.reserve_bytes is not None:
        low = r.avail_bytes <= r.reserve_bytes
        detail = f"{r.avail_bytes >> 20} MiB free, reserve {r.reserve_bytes >> 20} MiB"
        if low:
            detail += ("; free space under the reserve: once the filesystem is full every L2 "
                       "write fails (ENOSPC), new chunks are not persisted; serving "
                       "continues from L1 and the chunks on disk. Free space (what fills "
                       "it: df, du; old namespaces: kvp-admin prune): " + RESUME)
        out.append(("cache_root.free_space", "degraded" if low else "ok", detail))
    if r.budget is not None:
        over = not r.budget["within_budget"]
        at = r.budget.get("recorded_at_ns")
        when = (" at launch (" + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at / 1e9))
                + ")") if at else ""
        out.append(("cache_root.budget", "degraded" if over else "ok",
                    f"{r.budget['on_disk_bytes'] >> 20} MiB on disk, limit "
                    f"{r.budget['limit_bytes'] >> 20} MiB{when}"
                    + ("; budget exhausted: serving, no longer caching" if over else "")))
    elif r.budget_error:
        out.append(("cache_root.budget", "skipped", r.budget_error))
    return out


__all__ = ["RESUME", "RootFacts", "root_checks"]
