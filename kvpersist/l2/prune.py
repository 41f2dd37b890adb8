"""The prune executor (I/O): delete the files retention selections name, safely, in one pass.

``prune_stream(root, selections)`` walks the chunk directories of the open root
(:func:`kvpersist.l2.tree.chunk_dirs`: the root itself and ``ab/cd`` shard directories; never
``.kvpersist``, never a foreign directory, never through a symlink). The directory listing is
the plan: every regular file whose name parses as a chunk or temp file of a selected prefix is
``lstat``ed relative to the directory descriptor and deleted with ``unlink(name, dir_fd=...)``
only if

- it is still a regular file with the inode the listing showed (else: skipped, changed),
- its last use still matches its selection (an LRU selection skips a file used since the prune
  began: skipped, used; a maximum-age selection compares when the file was written, its
  ``st_mtime``, with the cutoff instead),
- its inode did not change since the prune began (``st_ctime`` is older than the start: a file
  written, truncated or re-linked in place since then is skipped, changed).

A file gone by then is skipped and counted as vanished. A dry run does the same without
unlinking, so it lists exactly what ``--apply`` deletes on an unchanged tree. Foreign files,
symlinks and manifests of namespaces that still have files are never deleted; a manifest is
removed only when its namespace was pruned whole, is not active, and no file of it is left.
Deleting takes the root's prune lock (``.kvpersist/prune.lock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat as stat_mod
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.l2.layout import (
    META_DIR,
    PRUNE_LOCK,
    Kind,
    classify,
    display_name,
    is_namespace,
    parse_chunk_name,
)
from kvpersist.l2.manifests import default_manifest_dirs, remove_manifest
from kvpersist.l2.pins.store import remove_pins
from kvpersist.l2.retention import Selection
from kvpersist.l2.tree import RootDir, Shard, chunk_dirs, meta_dir
from kvpersist.l2.verify import frame_store
from kvpersist.system.forked import run_parts

PROGRESS_EVERY = 4096
#: At most this many error messages are kept per worker.
ERRORS_CAP = 100


class PruneLocked(KvpError):
    """Another prune holds the lock of this cache root."""


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
    #: warm-set pins a selection would have taken but may not (all but --namespace)
    kept_pinned: int = 0
    #: warm-set pins deleted because their namespace was named (--namespace)
    deleted_pinned: int = 0
    pins_removed: list[str] = field(default_factory=list)
    #: namespaces whose frame record was removed with their last file
    frame_records_removed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    manifests_removed: list[str] = field(default_factory=list)
    per_selection: list[dict[str, Any]] = field(default_factory=list)
    deleted_paths: list[str] | None = None
    duration_s: float = 0.0
    #: problems that did not affect what was deleted (e.g. the run could not be recorded)
    warnings: list[str] = field(default_factory=list)

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
                "pinned": self.kept_pinned,
            },
            "deleted_pinned": self.deleted_pinned,
            "pins_removed": self.pins_removed,
            "frame_records_removed": self.frame_records_removed,
            "selections": self.per_selection,
            "manifests_removed": self.manifests_removed,
            "errors": self.errors,
            "warnings": self.warnings,
            "duration_s": round(self.duration_s, 3),
        }
        if self.deleted_paths is not None:
            d["files"] = self.deleted_paths
        return d


def _last_use(st: os.stat_result) -> int:
    return max(st.st_mtime_ns, st.st_atime_ns)


@contextlib.contextmanager
def prune_lock(root: RootDir) -> Iterator[None]:
    """Hold ``<root>/.kvpersist/prune.lock`` (flock) of the open root. Raises PruneLocked if
    another prune holds it, KvpError if the lock cannot be taken (e.g. ``.kvpersist`` is a
    symlink, or this user may not write there)."""
    path = os.path.join(root.path, META_DIR, PRUNE_LOCK)
    mfd = meta_dir(root)
    try:
        fd = os.open(PRUNE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600, dir_fd=mfd)
    except OSError as exc:
        fix = ("it is a symbolic link: remove it" if exc.errno == errno.ELOOP
               else "run as the user that owns the cache")
        raise KvpError(f"cannot open the prune lock {path}: {exc.strerror}; {fix}") from None
    finally:
        os.close(mfd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise KvpError(f"cannot lock {path}: {exc.strerror}") from None
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = ""
            who = f" (pid {holder})" if holder else ""
            raise PruneLocked(
                f"another kvp-admin prune is running on {root.path}{who}; "
                f"wait for it to finish (lock: {path})"
            ) from None
        with contextlib.suppress(OSError):
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


def _prefix_has_files(root_fd: int, prefix: str) -> bool:
    """True if any chunk or temp file of ``prefix`` is left (names only, no stat)."""
    start = f"{prefix}_"
    with chunk_dirs(root_fd) as dirs:
        for d in dirs:
            try:
                for e in d.entries():
                    if e.name.startswith(start):
                        _, chunk = classify(e.name, d.shard)
                        if chunk is not None and chunk.prefix == prefix:
                            return True
            except OSError:
                return True  # cannot tell: keep the manifest
    return False


def _remove_manifests(root: RootDir, selections: Sequence[Selection], active: frozenset[str],
                      manifest_dirs: Sequence[str], res: PruneResult) -> None:
    """Remove the manifest of each namespace pruned whole, inactive, and now without files,
    from every manifest directory of this root (``manifest_dirs``)."""
    for s in selections:
        ns = s.prefix
        if ns is None or s.before_ns is not None or not is_namespace(ns) or ns in active:
            continue
        if _prefix_has_files(root.fd, ns):
            continue
        try:
            if remove_pins(root, ns) and ns not in res.pins_removed:
                res.pins_removed.append(ns)
        except (OSError, KvpError) as exc:
            res.errors.append(f"{META_DIR}/pins/{ns}.json: {exc}")
        try:
            if frame_store.remove(root, ns) and ns not in res.frame_records_removed:
                res.frame_records_removed.append(ns)
        except OSError as exc:
            res.errors.append(f"{frame_store.record_path(root, ns)}: {exc.strerror or exc}")
        for mdir in dict.fromkeys(manifest_dirs):
            try:
                if remove_manifest(mdir, ns) and ns not in res.manifests_removed:
                    res.manifests_removed.append(ns)
            except OSError as exc:
                res.errors.append(f"{display_name(mdir)}/{ns}.json: {exc.strerror}")


@dataclass
class _PartResult:
    """What one worker of :func:`prune_stream` did."""

    done: list[list[int]]  # per selection: [files, bytes]
    changed: int = 0
    kept_pinned: int = 0
    deleted_pinned: int = 0
    vanished: int = 0
    used: int = 0
    errors: list[str] = field(default_factory=list)
    paths: list[str] | None = None
    ino_checked: int = 0
    ino_mismatch: int = 0


@dataclass(frozen=True)
class Keep:
    """What only a selection named on the command line may delete: the warm-set pins by file
    name (``names``), every file of the namespaces held whole (``namespaces``: their pin
    manifest is unreadable) and, with ``every_namespace`` (the pins directory cannot be
    listed), every chunk file."""

    names: frozenset[str] = frozenset()
    namespaces: frozenset[str] = frozenset()
    every_namespace: bool = False

    def keeps(self, name: str, prefix: str | None) -> bool:
        """Whether the chunk file ``name`` of ``prefix`` (None: a temp file) is kept."""
        return name in self.names or (prefix is not None and (
            self.every_namespace or prefix in self.namespaces))


def _stream_part(root: RootDir, selections: Sequence[Selection], part: int, parts: int,
                 dry_run: bool, list_paths: bool, progress: Callable[[int], None] | None,
                 started_ns: int, keep: Keep | None = None) -> _PartResult:
    """One worker of :func:`prune_stream`: its share of the root's entries (by name hash) and
    of the shard directories (by directory). The root is listed once (the walker finds the
    shard directories in the same listing)."""
    by_prefix: dict[str | None, list[int]] = {}
    for i, s in enumerate(selections):
        by_prefix.setdefault(s.prefix, []).append(i)
    want_temp = None in by_prefix
    starts = tuple(f"{p}_" for p in by_prefix if p is not None)
    out = _PartResult([[0, 0] for _ in selections], paths=[] if list_paths else None)
    done, paths, errors = out.done, out.paths, out.errors
    lstat, unlink, s_isreg = os.lstat, os.unlink, stat_mod.S_ISREG
    keep = Keep() if keep is None else keep
    count = 0

    def error(rel: str, exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError) and len(errors) < ERRORS_CAP:
            errors.append(f"{display_name(rel)}: {exc.strerror}")

    def do_dir(dfd: int, entries: Iterator[os.DirEntry[str]], rel: str, shard: Shard | None,
               split_names: bool) -> None:
        nonlocal count
        for e in entries:
            name = e.name
            if not name.startswith(starts) and not (want_temp and ".tmp." in name):
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
            # delete-time validation, relative to the directory descriptor: still a regular
            # file, still the inode the directory listed, still selected, unchanged since
            # the prune began
            try:
                st = lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                out.vanished += 1
                continue
            except OSError as exc:
                error(f"{rel}/{name}" if rel else name, exc)
                continue
            out.ino_checked += 1
            if not s_isreg(st.st_mode) or st.st_ino != e.inode():
                out.changed += 1
                if s_isreg(st.st_mode):
                    out.ino_mismatch += 1
                continue
            use = _last_use(st)
            hit = -1
            for i in idxs:
                if selections[i].matches(key, use, st.st_mtime_ns):
                    hit = i
                    break
            if hit < 0:
                # an LRU selection that no longer matches: used since the prune began, or
                # simply newer than its cutoff (never selected); a maximum age compares the
                # write time, which a use does not change
                if use >= started_ns and not all(selections[i].by_written for i in idxs):
                    out.used += 1
                continue
            pinned = keep.keeps(name, key)
            if pinned and not selections[hit].named:
                out.kept_pinned += 1  # a warm-set pin: only --namespace deletes it
                continue
            if st.st_ctime_ns > started_ns:
                out.changed += 1  # written, truncated or re-linked in place since then
                continue
            if not dry_run:
                try:
                    unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    out.vanished += 1
                    continue
                except OSError as exc:
                    error(f"{rel}/{name}" if rel else name, exc)
                    continue
            done[hit][0] += 1
            done[hit][1] += st.st_size
            if pinned:
                out.deleted_pinned += 1
            if paths is not None:  # as the name is (a salt may hold a newline): the table
                paths.append(f"{rel}/{name}" if rel else name)  # escapes it, --json does not
            count += 1
            if progress is not None and not count % PROGRESS_EVERY:
                progress(count)

    k = 0

    def mine(shard: Shard) -> bool:
        nonlocal k
        k += 1
        return k % parts == part

    try:
        root_fd = root.fd if part == 0 else root.reopen()
    except OSError as exc:
        error(".", exc)
        return out
    try:
        with chunk_dirs(root_fd, select=mine if parts > 1 else None, on_error=error) as dirs:
            for d in dirs:
                try:
                    do_dir(d.fd, d.entries(), d.rel, d.shard, parts > 1 and d.shard is None)
                except OSError as exc:  # the listing itself failed
                    error(d.rel or ".", exc)
    finally:
        if root_fd != root.fd:
            os.close(root_fd)
    return out


def _stream_workers(root: RootDir, workers: int | None) -> int:
    """One process unless asked: unlinks in one directory serialize on its lock, and measured
    on ext4 a second worker did not make a one-namespace prune faster (docs/benchmarks.md)."""
    del root
    return max(1, workers) if workers is not None else 1


def prune_stream(
    root: RootDir,
    selections: Sequence[Selection],
    *,
    active: frozenset[str] | set[str] = frozenset(),
    dry_run: bool = True,
    list_paths: bool = False,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
    lock: bool = True,
    manifest_dirs: Sequence[str] = (),
    keep: frozenset[str] = frozenset(),
    keep_namespaces: frozenset[str] = frozenset(),
    keep_all: bool = False,
) -> PruneResult:
    """Plan and delete in one pass (what ``kvp-admin prune`` runs; see the module docstring).

    ``keep``: the file names of the root's warm-set pins; only a selection named on the
    command line deletes one (and, after an ``--apply`` that leaves its namespace without
    files, its pin manifest is removed too). ``keep_namespaces``: namespaces held whole (their
    pin manifest is unreadable), ``keep_all``: every namespace held (the pins directory cannot
    be listed); their files are kept, and counted as pinned, the same way.

    After an ``--apply``, the manifest of a namespace pruned whole is removed from the root's
    default manifest directories and from ``manifest_dirs`` (those of its deployments).

    Large flat trees can be split between forked workers by a hash of each name. Takes the
    prune lock unless ``lock`` is False (the caller holds it; never needed for a dry run).
    Raises PruneLocked, KvpError if the lock cannot be taken; errors on single files are
    collected in the result.
    """
    t0 = time.perf_counter()
    sels = tuple(selections)
    res = PruneResult(root.path, dry_run)
    if list_paths:
        res.deleted_paths = []
    ctx = prune_lock(root) if lock and not dry_run else contextlib.nullcontext()
    with ctx:
        parts: list[_PartResult] = []
        if sels:
            n = _stream_workers(root, workers)
            parts = _run_parts(root, sels, n, dry_run, list_paths, progress,
                               Keep(keep, keep_namespaces, keep_all))
        done = [[0, 0] for _ in sels]
        for p in parts:
            for d, x in zip(done, p.done, strict=True):
                d[0] += x[0]
                d[1] += x[1]
            res.skipped_changed += p.changed
            res.skipped_vanished += p.vanished
            res.skipped_used += p.used
            res.kept_pinned += p.kept_pinned
            res.deleted_pinned += p.deleted_pinned
            res.errors.extend(p.errors)
            if res.deleted_paths is not None and p.paths is not None:
                res.deleted_paths.extend(p.paths)
        checked = sum(p.ino_checked for p in parts)
        mismatch = sum(p.ino_mismatch for p in parts)
        if checked >= 100 and mismatch == checked:
            res.errors.append("every file's inode differs from its directory entry's: "
                              "this filesystem (overlayfs?) reports unstable inode "
                              "numbers; nothing was deleted")
        res.deleted_files = sum(d[0] for d in done)
        res.deleted_bytes = sum(d[1] for d in done)
        res.planned_files, res.planned_bytes = res.deleted_files, res.deleted_bytes
        if not dry_run:
            _remove_manifests(root, sels, frozenset(active),
                              [*default_manifest_dirs(root.path), *manifest_dirs], res)
    res.per_selection = [
        {**s.to_dict(), "deleted_files": d[0], "deleted_bytes": d[1]}
        for s, d in zip(sels, done, strict=True)
    ]
    if res.deleted_paths is not None:
        res.deleted_paths.sort()
    res.duration_s = time.perf_counter() - t0
    return res


def _run_parts(root: RootDir, selections: tuple[Selection, ...], n: int, dry_run: bool,
               list_paths: bool, progress: Callable[[int], None] | None,
               keep: Keep) -> list[_PartResult]:
    # "since the prune began" (for all workers alike). File timestamps come from the kernel's
    # coarse clock, never ahead of this one: a file changed before now never counts as changed
    started_ns = time.time_ns()
    return run_parts(
        n, lambda part, prog: _stream_part(root, selections, part, n, dry_run, list_paths, prog,
                                           started_ns, keep),
        progress, "prune")
