"""The prune executor (I/O): turn retention selections into files, then delete them safely.

Two steps, so that a dry run shows exactly what an apply deletes:

``plan_prune(root, selections)`` walks the chunk directories of the root (the root itself and
``ab/cd`` shard directories; never ``.kvpersist``, never foreign directories, never through a
symlink) and records every regular file whose name parses as a chunk or temp file of a selected
prefix, with its inode, size and mtime.

``execute_prune(plan)`` deletes them under the root's prune lock. For every file it re-opens the
directory (``O_NOFOLLOW``, checked to be the planned directory), ``lstat``s the name relative to
that directory descriptor and deletes it with ``unlink(name, dir_fd=...)`` only if it is still
the planned regular file (same inode, size and mtime) and still matches its selection. A file
that changed, was replaced or vanished is skipped and counted. Foreign files, symlinks and
manifests of namespaces that still have files are never deleted; a manifest is removed only
when its namespace was pruned whole, is not active, and no file of it is left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat as stat_mod
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.l2.layout import (
    META_DIR,
    PRUNE_LOCK,
    Kind,
    classify,
    is_namespace,
    is_shard_dir_name,
    manifest_relpath,
    parse_chunk_name,
)
from kvpersist.l2.retention import Selection
from kvpersist.system.forked import run_parts

ProgressFn = Callable[[int, int], None]
PROGRESS_EVERY = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PruneLocked(KvpError):
    """Another prune holds the lock of this cache root."""


@dataclass
class DirBatch:
    """The planned files of one directory (compact: names plus parallel integer arrays)."""

    rel: str
    dir_dev: int
    dir_ino: int
    names: list[str] = field(default_factory=list)
    sel: array = field(default_factory=lambda: array("i"))
    ino: array = field(default_factory=lambda: array("Q"))
    size: array = field(default_factory=lambda: array("q"))
    mtime: array = field(default_factory=lambda: array("q"))


@dataclass
class PrunePlan:
    """Files to delete, grouped by directory; ``selections`` index into ``DirBatch.sel``."""

    root: str
    selections: tuple[Selection, ...]
    active: frozenset[str]
    batches: list[DirBatch] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    per_selection: list[list[int]] = field(default_factory=list)  # [files, bytes]
    planned_ns: int = 0

    def paths(self) -> Iterator[str]:
        """Planned paths, relative to the root."""
        for b in self.batches:
            for name in b.names:
                yield f"{b.rel}/{name}" if b.rel else name


@dataclass
class PruneResult:
    """What a prune did (or, for a dry run, would do)."""

    root: str
    dry_run: bool
    planned_files: int = 0
    planned_bytes: int = 0
    deleted_files: int = 0
    deleted_bytes: int = 0
    skipped_changed: int = 0
    skipped_vanished: int = 0
    skipped_used: int = 0
    errors: list[str] = field(default_factory=list)
    manifests_removed: list[str] = field(default_factory=list)
    per_selection: list[dict[str, Any]] = field(default_factory=list)
    deleted_paths: list[str] | None = None
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": "kvpersist.prune/1",
            "root": self.root,
            "dry_run": self.dry_run,
            "planned": {"files": self.planned_files, "bytes": self.planned_bytes},
            "deleted": {"files": self.deleted_files, "bytes": self.deleted_bytes},
            "skipped": {
                "changed": self.skipped_changed,
                "vanished": self.skipped_vanished,
                "used_since_planned": self.skipped_used,
            },
            "selections": self.per_selection,
            "manifests_removed": self.manifests_removed,
            "errors": self.errors,
            "duration_s": round(self.duration_s, 3),
        }
        if self.deleted_paths is not None:
            d["files"] = self.deleted_paths
        return d


def _last_use(st: os.stat_result) -> int:
    return max(st.st_mtime_ns, st.st_atime_ns)


def _chunk_dirs(root_fd: int) -> Iterator[tuple[str, tuple[str, str] | None]]:
    """The root ("", None) and every ``ab/cd`` shard directory (names only; no symlinks)."""
    yield "", None
    with os.scandir(root_fd) as it:
        level1 = sorted(e.name for e in it if len(e.name) == 2
                        and is_shard_dir_name(e.name) and e.is_dir(follow_symlinks=False))
    for a in level1:
        try:
            afd = os.open(a, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            continue
        try:
            with os.scandir(afd) as it:
                level2 = sorted(e.name for e in it
                                if is_shard_dir_name(e.name) and e.is_dir(follow_symlinks=False))
        finally:
            os.close(afd)
        for b in level2:
            yield f"{a}/{b}", (a, b)


def _open_rel(root_fd: int, rel: str) -> int:
    """Open a directory below the root one component at a time, never through a symlink."""
    fd = os.dup(root_fd)
    try:
        for part in (p for p in rel.split("/") if p):
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def plan_prune(
    root: str | os.PathLike[str],
    selections: Sequence[Selection],
    *,
    active: frozenset[str] | set[str] = frozenset(),
    progress: Callable[[int], None] | None = None,
) -> PrunePlan:
    """Find the files the selections name (see the module docstring). Reads, never writes.

    Raises OSError if ``root`` is not a directory that can be opened without following a
    symlink.
    """
    root_s = os.path.realpath(os.fspath(root))
    plan = PrunePlan(root_s, tuple(selections), frozenset(active),
                     per_selection=[[0, 0] for _ in selections], planned_ns=time.time_ns())
    if not selections:
        return plan
    by_prefix: dict[str | None, list[int]] = {}
    for i, s in enumerate(selections):
        by_prefix.setdefault(s.prefix, []).append(i)
    want_temp = None in by_prefix
    starts = tuple(f"{p}_" for p in by_prefix if p is not None)
    root_fd = os.open(root_s, _DIR_FLAGS)
    seen = 0
    try:
        for rel, shard in _chunk_dirs(root_fd):
            try:
                dfd = _open_rel(root_fd, rel)
            except OSError:
                continue
            try:
                dst = os.fstat(dfd)
                batch = DirBatch(rel, dst.st_dev, dst.st_ino)
                with os.scandir(dfd) as it:
                    for e in it:
                        seen += 1
                        if progress is not None and not seen & 0xFFFF:
                            progress(seen)
                        name = e.name
                        if not name.startswith(starts) and not (want_temp and ".tmp." in name):
                            continue
                        if not e.is_file(follow_symlinks=False):
                            continue
                        kind, chunk = classify(name, shard)
                        if chunk is None:
                            continue
                        key = None if kind is Kind.TEMP else chunk.prefix
                        idxs = by_prefix.get(key)
                        if idxs is None:
                            continue
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        use = _last_use(st)
                        for i in idxs:
                            if selections[i].matches(key, use):
                                batch.names.append(name)
                                batch.sel.append(i)
                                batch.ino.append(st.st_ino)
                                batch.size.append(st.st_size)
                                batch.mtime.append(st.st_mtime_ns)
                                plan.files += 1
                                plan.bytes += st.st_size
                                plan.per_selection[i][0] += 1
                                plan.per_selection[i][1] += st.st_size
                                break
                if batch.names:
                    plan.batches.append(batch)
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)
    return plan


@contextlib.contextmanager
def prune_lock(root: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``<root>/.kvpersist/prune.lock`` (flock). Raises PruneLocked if another prune
    holds it."""
    meta = os.path.join(os.fspath(root), META_DIR)
    os.makedirs(meta, mode=0o700, exist_ok=True)
    path = os.path.join(meta, PRUNE_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            who = f" (pid {holder})" if holder else ""
            raise PruneLocked(
                f"another kvp-admin prune is running on {os.fspath(root)}{who}; "
                f"wait for it to finish (lock: {path})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def execute_prune(
    plan: PrunePlan,
    *,
    dry_run: bool = True,
    list_paths: bool = False,
    progress: ProgressFn | None = None,
    lock: bool = True,
) -> PruneResult:
    """Delete the planned files (or, with ``dry_run``, only report them).

    Takes the root's prune lock unless ``lock`` is False (the caller then holds it). Raises
    PruneLocked if another prune holds it; errors on single files are collected in the result.
    """
    t0 = time.perf_counter()
    res = PruneResult(plan.root, dry_run, plan.files, plan.bytes)
    if list_paths:
        res.deleted_paths = []
    if dry_run:
        res.deleted_files, res.deleted_bytes = plan.files, plan.bytes
        if list_paths:
            res.deleted_paths = list(plan.paths())
        done = [list(x) for x in plan.per_selection]
    else:
        ctx = prune_lock(plan.root) if lock else contextlib.nullcontext()
        with ctx:
            done = _delete(plan, res, progress)
            _remove_manifests(plan, res)
    res.per_selection = [
        {**s.to_dict(), "deleted_files": d[0], "deleted_bytes": d[1]}
        for s, d in zip(plan.selections, done, strict=True)
    ]
    res.duration_s = time.perf_counter() - t0
    return res


def _delete(plan: PrunePlan, res: PruneResult, progress: ProgressFn | None) -> list[list[int]]:
    done = [[0, 0] for _ in plan.selections]
    sels = plan.selections
    total = plan.files
    count = 0
    root_fd = os.open(plan.root, _DIR_FLAGS)
    lstat, unlink, S_ISREG = os.lstat, os.unlink, stat_mod.S_ISREG
    paths = res.deleted_paths
    try:
        for b in plan.batches:
            try:
                dfd = _open_rel(root_fd, b.rel)
            except OSError as exc:
                res.errors.append(f"{b.rel or '.'}: {exc.strerror}")
                res.skipped_vanished += len(b.names)
                continue
            try:
                dst = os.fstat(dfd)
                if (dst.st_dev, dst.st_ino) != (b.dir_dev, b.dir_ino):
                    res.errors.append(f"{b.rel or '.'}: directory replaced since planned")
                    res.skipped_changed += len(b.names)
                    continue
                for j, name in enumerate(b.names):
                    count += 1
                    if progress is not None and not count % PROGRESS_EVERY:
                        progress(count, total)
                    try:
                        st = lstat(name, dir_fd=dfd)
                    except FileNotFoundError:
                        res.skipped_vanished += 1
                        continue
                    except OSError as exc:
                        res.errors.append(f"{b.rel}/{name}: {exc.strerror}")
                        continue
                    if (
                        not S_ISREG(st.st_mode)
                        or st.st_ino != b.ino[j]
                        or st.st_size != b.size[j]
                        or st.st_mtime_ns != b.mtime[j]
                    ):
                        res.skipped_changed += 1
                        continue
                    i = b.sel[j]
                    s = sels[i]
                    if s.before_ns is not None and _last_use(st) >= s.before_ns:
                        res.skipped_used += 1
                        continue
                    try:
                        unlink(name, dir_fd=dfd)
                    except FileNotFoundError:
                        res.skipped_vanished += 1
                        continue
                    except OSError as exc:
                        res.errors.append(f"{b.rel}/{name}: {exc.strerror}")
                        continue
                    res.deleted_files += 1
                    res.deleted_bytes += st.st_size
                    done[i][0] += 1
                    done[i][1] += st.st_size
                    if paths is not None:
                        paths.append(f"{b.rel}/{name}" if b.rel else name)
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)
    if progress is not None:
        progress(count, total)
    return done


def _prefix_has_files(root: str, prefix: str) -> bool:
    """True if any chunk or temp file of ``prefix`` is left (names only, no stat)."""
    start = f"{prefix}_"
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        for rel, shard in _chunk_dirs(root_fd):
            try:
                dfd = _open_rel(root_fd, rel)
            except OSError:
                continue
            try:
                with os.scandir(dfd) as it:
                    for e in it:
                        if e.name.startswith(start):
                            _, chunk = classify(e.name, shard)
                            if chunk is not None and chunk.prefix == prefix:
                                return True
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)
    return False


def _remove_manifests(plan: PrunePlan, res: PruneResult) -> None:
    """Remove the manifest of each namespace pruned whole, inactive, and now without files."""
    for s in plan.selections:
        ns = s.prefix
        if ns is None or s.before_ns is not None or not is_namespace(ns) or ns in plan.active:
            continue
        rel = manifest_relpath(ns)
        mdir, _, mname = rel.rpartition("/")
        if not os.path.lexists(os.path.join(plan.root, rel)):
            continue  # (checked again below, without following symlinks)
        if _prefix_has_files(plan.root, ns):
            continue
        try:
            root_fd = os.open(plan.root, _DIR_FLAGS)
            try:
                dfd = _open_rel(root_fd, mdir)
            finally:
                os.close(root_fd)
        except OSError:
            continue  # no manifest directory
        try:
            st = os.lstat(mname, dir_fd=dfd)
            if stat_mod.S_ISREG(st.st_mode):
                os.unlink(mname, dir_fd=dfd)
                res.manifests_removed.append(ns)
        except FileNotFoundError:
            pass
        except OSError as exc:
            res.errors.append(f"{rel}: {exc.strerror}")
        finally:
            os.close(dfd)


# --------------------------------------------------------------------------- one-pass prune


def _stream_part(root: str, selections: Sequence[Selection], part: int, parts: int,
                 dry_run: bool, list_paths: bool,
                 progress: Callable[[int], None] | None) -> dict[str, Any]:
    """One worker of :func:`prune_stream`: its share of the root's entries (by name hash) and
    of the shard directories (by directory). The root is listed once; shard directories
    found in that listing are walked afterwards."""
    by_prefix: dict[str | None, list[int]] = {}
    for i, s in enumerate(selections):
        by_prefix.setdefault(s.prefix, []).append(i)
    want_temp = None in by_prefix
    starts = tuple(f"{p}_" for p in by_prefix if p is not None)
    done = [[0, 0] for _ in selections]
    out: dict[str, Any] = {"done": done, "changed": 0, "vanished": 0,
                           "errors": [], "paths": [] if list_paths else None, "ino_checked": 0,
                           "ino_mismatch": 0}
    paths = out["paths"]
    lstat, unlink, s_isreg = os.lstat, os.unlink, stat_mod.S_ISREG
    count = 0

    def do_dir(dfd: int, rel: str, shard: tuple[str, str] | None, split_names: bool,
               level1: list[str] | None) -> None:
        nonlocal count
        with os.scandir(dfd) as it:
            for e in it:
                name = e.name
                if not name.startswith(starts) and not (want_temp and ".tmp." in name):
                    if (level1 is not None and len(name) == 2 and is_shard_dir_name(name)
                            and e.is_dir(follow_symlinks=False)):
                        level1.append(name)
                    continue
                if split_names and hash(name) % parts != part:
                    continue
                if not e.is_file(follow_symlinks=False):
                    continue  # symlinks, directories, devices: never
                if name[-4:] == ".bin":
                    chunk = parse_chunk_name(name)
                    key = None if chunk is None else chunk.prefix
                    if chunk is not None and shard is not None and chunk.shard() != shard:
                        continue
                else:
                    kind, chunk = classify(name, shard)
                    key = None if kind is Kind.TEMP else chunk.prefix if chunk else None
                if chunk is None:
                    continue
                idxs = by_prefix.get(key)
                if idxs is None:
                    continue
                # delete-time validation, relative to the directory descriptor: still a
                # regular file, still the inode the directory listed, still selected
                try:
                    st = lstat(name, dir_fd=dfd)
                except FileNotFoundError:
                    out["vanished"] += 1
                    continue
                except OSError as exc:
                    out["errors"].append(f"{rel}/{name}: {exc.strerror}")
                    continue
                out["ino_checked"] += 1
                if not s_isreg(st.st_mode) or st.st_ino != e.inode():
                    out["changed"] += 1
                    if s_isreg(st.st_mode):
                        out["ino_mismatch"] += 1
                    continue
                use = _last_use(st)
                hit = -1
                for i in idxs:
                    if selections[i].matches(key, use):
                        hit = i
                        break
                if hit < 0:
                    continue  # used too recently for an LRU selection
                if not dry_run:
                    try:
                        unlink(name, dir_fd=dfd)
                    except FileNotFoundError:
                        out["vanished"] += 1
                        continue
                    except OSError as exc:
                        out["errors"].append(f"{rel}/{name}: {exc.strerror}")
                        continue
                done[hit][0] += 1
                done[hit][1] += st.st_size
                if paths is not None:
                    paths.append(f"{rel}/{name}" if rel else name)
                count += 1
                if progress is not None and not count % PROGRESS_EVERY:
                    progress(count)

    root_fd = os.open(root, _DIR_FLAGS)
    try:
        level1: list[str] = []
        do_dir(root_fd, "", None, parts > 1, level1)
        k = 0
        for a in sorted(level1):
            try:
                afd = os.open(a, _DIR_FLAGS, dir_fd=root_fd)
            except OSError:
                continue
            try:
                with os.scandir(afd) as it:
                    level2 = sorted(e.name for e in it if len(e.name) == 2
                                    and is_shard_dir_name(e.name)
                                    and e.is_dir(follow_symlinks=False))
                for b in level2:
                    k += 1
                    if k % parts != part:
                        continue
                    try:
                        bfd = os.open(b, _DIR_FLAGS, dir_fd=afd)
                    except OSError:
                        continue
                    try:
                        do_dir(bfd, f"{a}/{b}", (a, b), False, None)
                    finally:
                        os.close(bfd)
            finally:
                os.close(afd)
    finally:
        os.close(root_fd)
    del out["errors"][100:]
    return out


def _stream_workers(root: str, workers: int | None) -> int:
    """One process unless asked: unlinks in one directory serialize on its lock, and measured
    on ext4 a second worker did not make a one-namespace prune faster (docs/benchmarks.md)."""
    del root
    return max(1, workers) if workers is not None else 1


def prune_stream(
    root: str | os.PathLike[str],
    selections: Sequence[Selection],
    *,
    active: frozenset[str] | set[str] = frozenset(),
    dry_run: bool = True,
    list_paths: bool = False,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
    lock: bool = True,
) -> PruneResult:
    """Plan and delete in one pass (what ``kvp-admin prune`` runs).

    The directory listing is the plan: for each listed entry whose name parses as a chunk or
    temp file of a selected prefix, the file is ``lstat``ed relative to the directory
    descriptor and deleted with ``unlink(name, dir_fd=...)`` only if it is a regular file with
    the inode the listing showed (a file replaced since it was listed is skipped) and its last
    use still matches the selection. A dry run does the same without unlinking, so it lists
    exactly what ``--apply`` deletes on an unchanged tree. Large flat trees are split between
    forked workers by a hash of each name. Takes the prune lock unless ``lock`` is False (the
    caller holds it; never needed for a dry run). Raises PruneLocked.
    """
    t0 = time.perf_counter()
    root_s = os.path.realpath(os.fspath(root))
    res = PruneResult(root_s, dry_run)
    if list_paths:
        res.deleted_paths = []
    plan = PrunePlan(root_s, tuple(selections), frozenset(active))
    ctx = prune_lock(root_s) if lock and not dry_run else contextlib.nullcontext()
    with ctx:
        parts: list[dict[str, Any]] = []
        if selections:
            n = _stream_workers(root_s, workers)
            parts = _run_parts(root_s, plan.selections, n, dry_run, list_paths, progress)
        done = [[0, 0] for _ in selections]
        for p in parts:
            for d, x in zip(done, p["done"], strict=True):
                d[0] += x[0]
                d[1] += x[1]
            res.skipped_changed += p["changed"]
            res.skipped_vanished += p["vanished"]
            res.errors.extend(p["errors"])
            if res.deleted_paths is not None and p["paths"] is not None:
                res.deleted_paths.extend(p["paths"])
        checked = sum(p["ino_checked"] for p in parts)
        mismatch = sum(p["ino_mismatch"] for p in parts)
        if checked >= 100 and mismatch == checked:
            res.errors.append("every file's inode differs from its directory entry's: this "
                              "filesystem (overlayfs?) reports unstable inode numbers; nothing "
                              "was deleted")
        res.deleted_files = sum(d[0] for d in done)
        res.deleted_bytes = sum(d[1] for d in done)
        res.planned_files, res.planned_bytes = res.deleted_files, res.deleted_bytes
        if not dry_run:
            _remove_manifests(plan, res)
    res.per_selection = [
        {**s.to_dict(), "deleted_files": d[0], "deleted_bytes": d[1]}
        for s, d in zip(plan.selections, done, strict=True)
    ]
    if res.deleted_paths is not None:
        res.deleted_paths.sort()
    res.duration_s = time.perf_counter() - t0
    return res


def _run_parts(root: str, selections: tuple[Selection, ...], n: int, dry_run: bool,
               list_paths: bool, progress: Callable[[int], None] | None) -> list[dict[str, Any]]:
    return run_parts(
        n, lambda part, prog: _stream_part(root, selections, part, n, dry_run, list_paths, prog),
        progress, "prune")
