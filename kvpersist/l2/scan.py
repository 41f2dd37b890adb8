"""One-pass scan of an L2 cache root (the I/O layer of the inventory).

``scan_root(root)`` walks the whole tree with :func:`kvpersist.l2.tree.walk_dirs` (directory
descriptors, never following a symlink), lists each directory once with ``os.scandir``,
lstat()s each entry once and aggregates per file-name prefix, so its memory grows with the
number of namespaces, ranks and groups, not with the number of files. On a multi-core host a
big tree is split between forked worker processes by a hash of each root entry's name; each
worker returns only its aggregates.

Categories (they add up to what ``du -s --apparent-size -b ROOT`` counts):

- chunks, per prefix (a namespace, or another LMCache model-name prefix),
- temp files (``<chunk name>.tmp.<hex>``: in-flight or left over by a crash),
- metadata (``.kvpersist/`` and ``lmcache-server.pid``),
- symlinks (counted with their own lstat size, never followed),
- foreign files and directories (anything else; never modified),
- directories (root, shard directories, and every other directory below the root).

Hard-linked files are counted once, as du does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpersist.l2.layout import (
    META_DIR,
    PID_FILE,
    QUARANTINE_DIR,
    TEMP_MARKER,
    Kind,
    classify,
    display_name,
    is_shard_dir_name,
    valid_head,
)
from kvpersist.l2.tree import RootDir, open_dir, walk_dirs
from kvpersist.l2.usage import HIST_BUCKET_NS, SAMPLE_CAP, PrefixUsage, Usage
from kvpersist.system.files import FsInfo, fs_info
from kvpersist.system.forked import run_parts

#: Trees whose root directory is at least this big (bytes of directory entries) are scanned
#: by several processes.
PARALLEL_MIN_DIR_BYTES = 1 << 20
PROGRESS_EVERY = 1 << 16
_NO_MIN = 1 << 63
_HEX_BYTES = b"0123456789abcdef"
# what a directory of the walk is (its walk tag): chunk layout, foreign, or kvpersist metadata
_PLAIN, _FOREIGN, _META = 0, 1, 2
#: where ``verify --apply`` moves what it finds (relative to the root; see l2/verify/root.py)
QUARANTINE_PREFIX = f"{META_DIR}/{QUARANTINE_DIR}/"

ProgressFn = Callable[[int], None]
#: ``Dir.subdirs.append`` of the directory being scanned: queues ``(name, tag)`` for the walk
DescendFn = Callable[[tuple[str, int]], None]


#: A file with several names, as a walker met it: (name, path below the root, depth, under a
#: foreign directory, under the metadata directory, shard directory, its lstat)
LinkedFile = tuple[str, str, int, bool, bool, "tuple[str, str] | None", os.stat_result]


@dataclass
class ScanResult:
    """Everything a scan found, aggregated."""

    root: str
    started_ns: int = 0
    duration_s: float = 0.0
    fs: FsInfo | None = None
    prefixes: dict[str, PrefixUsage] = field(default_factory=dict)
    temp: Usage = field(default_factory=Usage)
    metadata: Usage = field(default_factory=Usage)
    symlinks: Usage = field(default_factory=Usage)
    foreign: Usage = field(default_factory=Usage)
    foreign_dirs: int = 0
    #: what LMCache's clean-up at a graceful stop deletes that is not LMCache's own: it
    #: walks the whole tree under the cache root (``os.walk``: every depth, ``.kvpersist``
    #: too, symlinked directories not entered) and unlinks every entry that is not a
    #: directory (a file, a symlink, a FIFO, a socket) whose name contains ``.tmp.``; counted
    #: here are those that are not LMCache's own names where LMCache writes them (a chunk or
    #: its temp name in the root or in its own shard directory), each name of a file with
    #: several names once (a subset of the others, not added to the total)
    lmcache_cleans: Usage = field(default_factory=Usage)
    directories: Usage = field(default_factory=Usage)
    #: files in ``.kvpersist/quarantine/`` (moved there by ``verify --apply``; a subset of
    #: the metadata, not added to the total)
    quarantine: Usage = field(default_factory=Usage)
    errors: list[str] = field(default_factory=list)
    workers: int = 1
    #: directory entries looked at (every worker's share)
    entries: int = 0
    #: regular files with more than one name, counted once each at the end of the scan
    #: (:func:`_count_links`), after the workers' results are merged
    links: list[LinkedFile] = field(default_factory=list)

    def merge(self, other: ScanResult) -> None:
        for p, u in other.prefixes.items():
            mine = self.prefixes.get(p)
            if mine is None:
                self.prefixes[p] = u
            else:
                mine.merge(u)
        self.temp.merge(other.temp)
        self.metadata.merge(other.metadata)
        self.symlinks.merge(other.symlinks)
        self.foreign.merge(other.foreign)
        self.foreign_dirs += other.foreign_dirs
        self.lmcache_cleans.merge(other.lmcache_cleans)
        self.directories.merge(other.directories)
        self.quarantine.merge(other.quarantine)
        self.entries += other.entries
        self.errors.extend(other.errors[: max(0, SAMPLE_CAP - len(self.errors))])
        self.links.extend(other.links)

    @property
    def chunk_files(self) -> int:
        return sum(u.files for u in self.prefixes.values())

    @property
    def chunk_bytes(self) -> int:
        return sum(u.bytes for u in self.prefixes.values())

    @property
    def total_bytes(self) -> int:
        """Apparent bytes of everything under the root, as ``du -s --apparent-size -b``."""
        return (
            self.chunk_bytes
            + self.temp.bytes
            + self.metadata.bytes
            + self.symlinks.bytes
            + self.foreign.bytes
            + self.directories.bytes
        )

    def prefix_bytes(self) -> dict[str, int]:
        return {p: u.bytes for p, u in self.prefixes.items()}


class _Walker:
    """Walks a tree and fills a ScanResult. ``part``/``parts`` select this worker's share of
    the root's entries."""

    def __init__(
        self,
        root: str,
        part: int,
        parts: int,
        progress: ProgressFn | None,
        hist: bool,
        ages: bool = False,
    ) -> None:
        self.root = root
        self.part = part
        self.parts = parts
        self.progress = progress
        self.hist = hist
        self.ages = ages
        self.res = ScanResult(root=root)
        self.count = 0
        # (prefix, rank hex, group hex) -> PrefixUsage, or None if that triple is invalid
        self.keys: dict[str, list[Any]] = {}
        self.accs: dict[tuple[str, str, str], list[Any]] = {}

    # -- helpers -------------------------------------------------------------------------

    def _error(self, msg: str) -> None:
        if len(self.res.errors) < SAMPLE_CAP:
            self.res.errors.append(msg)

    def _prefix(self, prefix: str) -> PrefixUsage:
        return _prefix(self.res, prefix)

    # -- the walk ------------------------------------------------------------------------

    def walk_root(self, root_fd: int | None = None) -> ScanResult:
        """Walk the tree: from ``root_fd`` (the caller's; left open) or, if None, from a
        descriptor of ``self.root`` opened here."""
        res = self.res
        own = root_fd is None
        if root_fd is None:
            try:
                root_fd = open_dir(self.root)
            except OSError as exc:
                self._error(f"{display_name(self.root)}: {exc.strerror}")
                return res
        try:
            if self.part == 0:
                res.directories.add(os.fstat(root_fd))
            with walk_dirs(root_fd, _PLAIN, on_error=self._open_error) as dirs:
                scan_fd, partition = self._scan_fd, self.parts > 1
                for d in dirs:
                    # one directory: ``depth`` 0 is the root, 1 and 2 may be shard directories
                    # (unless foreign or metadata); the hot loop chooses what to walk next
                    tag, depth = d.tag, d.depth
                    shard: tuple[str, str] | None = None
                    if depth == 2 and tag == _PLAIN:
                        a, _, b = d.rel.partition("/")
                        shard = (a, b)
                    scan_fd(d.fd, d.rel, depth, partition and depth == 0, tag == _FOREIGN,
                            tag == _META, shard, d.subdirs.append)
        finally:
            if own:
                os.close(root_fd)
        self._fold()
        res.entries = self.count
        return res

    def _open_error(self, rel: str, exc: OSError) -> None:
        self._error(f"{display_name(rel or '.')}: {exc.strerror}")

    def _scan_fd(self, dfd: int, rel: str, depth: int, partition: bool, foreign: bool,
                 meta: bool, shard: tuple[str, str] | None, descend: DescendFn) -> None:
        """The hot loop over one directory's entries.

        Chunk files whose ``prefix_rank_group`` head was seen before take the fast path: one
        ``rpartition``, one dict lookup, one lstat and a few integer updates. Everything else
        goes through :meth:`_slow_entry`.
        """
        hist, ages = self.hist, self.ages
        keys = self.keys
        parts, part = self.parts, self.part
        progress = self.progress
        count = self.count
        plain = not foreign and not meta and depth != 1
        slow = self._slow_entry
        bucket_ns = HIST_BUCKET_NS
        hex_bytes = _HEX_BYTES
        with os.scandir(dfd) as it:
            for e in it:
                name = e.name
                if partition and hash(name) % parts != part:
                    continue
                count += 1
                if not count & (PROGRESS_EVERY - 1) and progress is not None:
                    progress(count)
                if plain and e.is_file(follow_symlinks=False):
                    head, _, tail = name.rpartition("_")
                    a = None
                    # "<lowercase hex>.bin": deleting the hex digits must leave ".in" (the
                    # non-hex letters of ".bin"); bytes.translate is ~4x cheaper than a regex
                    if (
                        len(tail) > 4
                        and not len(tail) & 1  # the hash is whole bytes: even digits
                        and tail.endswith(".bin")
                        and tail.encode("utf-8", "surrogateescape")
                        .translate(None, hex_bytes) == b".in"
                    ):
                        a = keys.get(head)
                        if a is None and head:
                            # only valid heads are remembered, so memory stays bounded by
                            # the number of (prefix, rank, group) triples
                            a = self._new_key(head)
                            if a is not None:
                                keys[head] = a
                    if a is not None and (shard is None or (tail[0:2], tail[2:4]) == shard):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError as exc:
                            self._stat_error(exc, rel, name)
                            continue
                        if st.st_nlink > 1:
                            self.res.links.append((name, f"{rel}/{name}" if rel else name,
                                                   depth, foreign, meta, shard, st))
                            continue
                        sz = st.st_size
                        a[0] += 1
                        a[1] += sz
                        a[2] += st.st_blocks
                        m = st.st_mtime_ns
                        if m < a[3]:
                            a[3] = m
                        if m > a[4]:
                            a[4] = m
                        at = st.st_atime_ns
                        if at > a[7]:
                            a[7] = at
                        if hist:
                            b = (at if at > m else m) // bucket_ns
                            h = a[5].get(b)
                            if h is None:
                                a[5][b] = [1, sz]
                            else:
                                h[0] += 1
                                h[1] += sz
                        if ages:
                            w = a[8].get(m // bucket_ns)
                            if w is None:
                                a[8][m // bucket_ns] = [1, sz]
                            else:
                                w[0] += 1
                                w[1] += sz
                        if shard is not None:
                            a[6] += 1
                        continue
                slow(e, name, rel, depth, foreign, meta, shard, descend)
        self.count = count

    def _stat_error(self, exc: OSError, rel: str, name: str) -> None:
        # vanished between readdir and lstat: simply not there any more
        if not isinstance(exc, FileNotFoundError):
            self._error(f"{display_name(f'{rel}/{name}')}: {exc.strerror}")

    def _slow_entry(self, e: os.DirEntry[str], name: str, rel: str, depth: int, foreign: bool,
                    meta: bool, shard: tuple[str, str] | None, descend: DescendFn) -> None:
        """Classify and count one entry that did not take the fast path."""
        res = self.res
        path = f"{rel}/{name}" if rel else name
        try:
            if e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                if st.st_nlink > 1:
                    res.links.append((name, path, depth, foreign, meta, shard, st))
                    return
                _count_file(res, name, path, depth, foreign, meta, shard, st, self.hist,
                            self.ages)
            elif e.is_symlink():
                st = e.stat(follow_symlinks=False)
                res.symlinks.add(st, sample=path)
                # LMCache unlinks the link itself, unless it leads to a directory
                if TEMP_MARKER in name and not _leads_to_dir(e):
                    res.lmcache_cleans.add(st, sample=path)
            elif e.is_dir(follow_symlinks=False):
                res.directories.add(e.stat(follow_symlinks=False))
                if meta or (depth == 0 and name == META_DIR):
                    descend((name, _META))
                elif foreign or not (depth < 2 and is_shard_dir_name(name)):
                    if not foreign:
                        res.foreign_dirs += 1
                    descend((name, _FOREIGN))
                else:
                    descend((name, _PLAIN))
            else:
                # sockets, fifos, devices: foreign, counted with their lstat size
                st = e.stat(follow_symlinks=False)
                res.foreign.add(st, sample=path)
                if TEMP_MARKER in name:
                    res.lmcache_cleans.add(st, sample=path)
        except OSError as exc:
            self._stat_error(exc, rel, name)

    def _new_key(self, head: str) -> list[Any] | None:
        """Validate a ``prefix_rank_group`` head once; its fast accumulator or None.

        An accumulator is ``[files, bytes, blocks, min mtime, max mtime, use histogram,
        sharded files, max atime, write-time histogram]``; :meth:`_fold` adds it to the
        prefix's PrefixUsage at the end (with its rank and group, if any file was counted).
        """
        fields = head.rsplit("_", 2)
        if len(fields) != 3:
            return None
        prefix, rank, group = fields
        # the fields as the one parser wants them (layout.parse_chunk_name); an "@" in the
        # prefix (a salt holding "_"), and anything not printable, takes the slow path
        if not valid_head(prefix, rank, group):
            return None
        acc = self.accs.get((prefix, rank, group))
        if acc is None:
            acc = self.accs[(prefix, rank, group)] = [0, 0, 0, _NO_MIN, 0, {}, 0, 0, {}]
        return acc

    def _fold(self) -> None:
        for (prefix, rank, group), acc in self.accs.items():
            files, nbytes, blocks, lo, hi, hist, sharded, atime, written = acc
            if not files:
                continue
            u = self._prefix(prefix)
            u.merge(Usage(files, nbytes, blocks * 512, lo, hi, hist, newest_atime_ns=atime,
                          write_hist=written))
            u.sharded_files += sharded
            u.ranks.add(int(rank, 16))
            u.groups.add(int(group, 16))
        self.accs.clear()


def _prefix(res: ScanResult, prefix: str) -> PrefixUsage:
    u = res.prefixes.get(prefix)
    if u is None:
        u = res.prefixes[prefix] = PrefixUsage(prefix=prefix)
    return u


def _leads_to_dir(e: os.DirEntry[str]) -> bool:
    """Does the symlink ``e`` lead to a directory (``os.walk`` then lists it as one and
    LMCache's clean-up leaves it)? A broken link does not."""
    try:
        return e.is_dir()
    except OSError:
        return False


def _cleaned_not_lmcaches(res: ScanResult, name: str, path: str, depth: int, foreign: bool,
                          meta: bool, shard: tuple[str, str] | None,
                          st: os.stat_result) -> None:
    """Count the regular file ``name`` in ``lmcache_cleans`` if LMCache's clean-up deletes
    it (``.tmp.`` in its name) and it is not LMCache's own name where LMCache writes one."""
    if TEMP_MARKER in name and (meta or foreign or depth == 1 or classify(name, shard)[0]
                                is Kind.FOREIGN):
        res.lmcache_cleans.add(st, sample=path)


def _count_file(res: ScanResult, name: str, path: str, depth: int, foreign: bool, meta: bool,
                shard: tuple[str, str] | None, st: os.stat_result, hist: bool,
                ages: bool = False) -> None:
    """Count one regular file into its category (the slow path, and linked files): a salted
    chunk file (``@{cache_salt}`` in its name) always comes here, and is counted under its
    salt too."""
    _cleaned_not_lmcaches(res, name, path, depth, foreign, meta, shard, st)
    if meta:
        res.metadata.add(st)
        if path.startswith(QUARANTINE_PREFIX):
            res.quarantine.add(st)
    elif foreign or depth == 1:
        res.foreign.add(st, sample=path)
    elif depth == 0 and name == PID_FILE:
        res.metadata.add(st)
    else:
        kind, chunk = classify(name, shard)
        if kind is Kind.CHUNK and chunk is not None:
            u = _prefix(res, chunk.prefix)
            u.add(st, hist=hist, ages=ages)
            u.ranks.add(chunk.kv_rank)
            u.groups.add(chunk.group)
            if shard is not None:
                u.sharded_files += 1
            if chunk.salt is not None:
                u.add_salted(chunk.salt, st.st_size)
        elif kind is Kind.TEMP:
            res.temp.add(st, hist=True)
        else:
            res.foreign.add(st, sample=path)


def _count_links(res: ScanResult, hist: bool, ages: bool = False) -> None:
    """Count each file with several names once, as du does, whichever worker met which name:
    the first name in path order counts, the others are skipped."""
    seen: set[tuple[int, int]] = set()
    for name, path, depth, foreign, meta, shard, st in sorted(res.links, key=lambda x: x[1]):
        key = (st.st_dev, st.st_ino)
        if key in seen:
            # counted once, but LMCache's clean-up unlinks each name of it
            _cleaned_not_lmcaches(res, name, path, depth, foreign, meta, shard, st)
            continue
        seen.add(key)
        _count_file(res, name, path, depth, foreign, meta, shard, st, hist, ages)
    res.links = []


def _busy_cpus(samples: int = 8, interval_s: float = 0.0025) -> float:
    """How many CPUs other tasks keep busy right now: the most runnable tasks other than this
    one over a few samples of ``/proc/loadavg`` (about 20 ms). The 1-minute load average
    (the fallback where that file is missing) lags a minute behind and counts this command's
    own previous runs (a scan every minute, a benchmark loop) as load."""
    busy = -1
    try:
        for i in range(samples):
            if i:
                time.sleep(interval_s)
            with open("/proc/loadavg", "rb") as f:
                running = int(f.read(256).split()[3].split(b"/")[0])
            busy = max(busy, running - 1)  # this process is one of the runnable tasks
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return float(max(0, busy))


def _want_workers(root_fd: int, workers: int | None) -> int:
    """How many processes to scan with: one for a small tree; for a big one, as many as there
    are idle CPUs (:func:`_busy_cpus`: no other task runnable on them right now), at most 4.
    A forked worker on a busy CPU makes the scan slower, not faster (measured:
    docs/benchmarks.md)."""
    if workers is not None:
        return max(1, workers)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not cpus or cpus < 2:
        return 1
    try:
        st = os.fstat(root_fd)
    except OSError:
        return 1
    big = st.st_size >= PARALLEL_MIN_DIR_BYTES or st.st_nlink >= 2 + 64
    if not big:
        return 1
    idle = cpus - _busy_cpus()
    return max(1, min(cpus, 4, int(idle + 0.5)))


def scan_root(
    root: RootDir,
    *,
    progress: ProgressFn | None = None,
    workers: int | None = None,
    hist: bool = True,
    ages: bool = False,
) -> ScanResult:
    """Scan the open ``root`` and return the aggregates.

    ``progress`` is called now and then with the number of entries seen (by the first worker,
    scaled to an estimate of the total). ``workers`` forces the number of processes (default:
    one, or up to four on a multi-core host when the tree is big). ``hist`` keeps the last-use
    histogram needed by retention planning, ``ages`` the write-time (mtime) histogram of
    ``report``'s ages. Errors on single entries are collected in ``result.errors``.
    """
    # the root itself may be a symlink the operator set up (resolved when it was opened);
    # nothing below it is followed
    root_s = root.path
    started = time.time_ns()
    t0 = time.perf_counter()
    n = _want_workers(root.fd, workers)
    result: ScanResult
    if n == 1:
        result = _Walker(root_s, 0, 1, progress, hist, ages).walk_root(root.fd)
    else:
        result = _scan_forked(root_s, root.fd, n, progress, hist, ages)
    _count_links(result, hist, ages)
    result.root = root_s
    result.started_ns = started
    result.duration_s = time.perf_counter() - t0
    result.fs = fs_info(root_s)
    result.workers = n
    return result


def _scan_forked(root: str, root_fd: int, n: int, progress: ProgressFn | None,
                 hist: bool, ages: bool = False) -> ScanResult:
    """Scan with ``n`` processes: this one takes part 0 (on ``root_fd``), forked children the
    rest. A child opens the root itself: a directory descriptor shared between processes would
    share its read position too."""
    parts = run_parts(
        n, lambda part, prog: _Walker(root, part, n, prog, hist, ages).walk_root(
            root_fd if part == 0 else None),
        progress, "scan")
    result = parts[0]
    for other in parts[1:]:
        result.merge(other)
    return result
