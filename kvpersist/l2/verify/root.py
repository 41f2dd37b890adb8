"""Find L2 chunk files that can never be valid, and quarantine them (explicit command only).

Stock LMCache never rewrites a key whose file exists, so a damaged chunk file is a miss
after every restart, forever. ``verify`` finds:

* ``size``: a chunk file too small to hold an aesgcm frame, or whose size differs from its
  namespace's usual size for the same kv_rank world (truncated or extended) and, with the
  ``aesgcm`` serde and a key, whose frame also fails authentication;
* ``auth``: with the ``aesgcm`` serde, a file of the deployment's namespace whose frame fails
  AES-GCM authentication with the deployment's key (tampered, corrupted, written under another
  key) — LMCache would treat it as a miss every time;
* ``temp``: an interrupted write (``<name>.tmp.<uuid>``) older than ``temp_age`` seconds;
* ``type``, ``perm``, ``dup`` (:mod:`kvpersist.l2.verify.rules`): an entry under a chunk name
  that is not a regular file (LMCache reads through a symlink, blocks on a FIFO), a chunk file
  the server's user cannot read, and the same frame under two names (a valid frame served as
  another chunk's KV);
* ``moved`` (with the namespace's frame record, :mod:`kvpersist.l2.verify.frame_record`): a
  frame recorded under another chunk's name (a rename over, a restore from the wrong backup,
  a sync tool), which authentication cannot tell from the right one.

Quarantine renames a file out of its deterministic name into
``<cache root>/.kvpersist/quarantine/`` (same filesystem, atomic), so LMCache stores the chunk
afresh on the next miss. Nothing is deleted; ``prune`` or the operator removes the
quarantine. Files are found, read and renamed relative to directory descriptors of the walk
(:mod:`kvpersist.l2.tree`), never through a symlink, and a file that is no longer the one
checked (device, inode, size, mtime) is left alone; a ``.kvpersist`` or ``quarantine`` that is a
symlink is refused.

Where a frame ends. LMCache pads every file to 4 KiB with whatever its L1 buffer held after
the frame (the aesgcm serializer never clears it: stale bytes of other chunks, see
docs/lmcache-publish-path.md), so the end of a frame cannot be told from trailing zeros alone.
The plaintext length of a namespace's chunks is fixed by its KV geometry: verify learns it
from the first file that authenticates, and a file that failed before it was known is tried
again with it (reading, if needed, a few other files of the namespace to learn it). Until it
is known, a file is tried at the lengths that end its frame after its last non-zero byte and
at every length a KV chunk can have in its last 4 KiB
(:func:`kvpersist.l2.frames.frame_candidates`): with a small L1 every file's padding can be
dirty (the 60-minute soak quarantined 522 valid files before this), and a real chunk
authenticates at the first aligned try. Only a file that fails
with the learned length is a finding, or, when no file of its group authenticates, one that
fails every length tried.

A file that authenticates is never a ``size`` or ``auth`` finding. With the ``aesgcm``
serde and a key, every chunk file of the namespace is read and authenticated before it is
condemned; its size is only a hint: the usual size of the files that authenticated says
which size to read first and whether a failing file is a ``size`` or an ``auth`` finding.
(Files of another namespace are not authenticated, only compared with their group's most
common size; with a key, one of another size is read and kept if it authenticates. With
``serde: none`` the size is all there is.) The order of reading
(:mod:`kvpersist.l2.verify.order`: the warm-set pins first, then authentic sizes before sizes
seen to fail) is what keeps a flood of garbage files named like the namespace's chunks from
using up a time bound before the authentic files are read.

Crash-window checks (:func:`verify_root` with ``since_ns``) check only the files modified at or
after that instant, and ``deadline_s`` bounds the time spent reading (the rest, and the failed
files whose verdict waits for a frame length still to learn, are counted as ``unchecked``).

I/O is bounded: ``rate_mb_s`` caps read bandwidth (block by block); ``progress`` is called
as files go by. Every file is read through :class:`~kvpersist.system.untrusted.ChunkFile`
and authenticated streamed (:func:`kvpersist.l2.frames.authenticate_source`): memory is a
block's, whatever a file's size, and ``deadline_s`` also stops a read in the middle of a
file. A chunk file larger than its namespace's geometry allows (``max_bytes_for``,
:func:`kvpersist.l2.frames.max_chunk_file_bytes`) is a ``size`` finding without being read
(issue 40: a 50 GB sparse file named like a chunk ended ``launch`` with ``MemoryError``).
Pure helpers: ``expected_sizes``, ``frame_candidates``; the rest reads files.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpersist.l2 import layout
from kvpersist.l2.frames import (
    ALIGNED_SEARCHES,
    FRAME_OVERHEAD,
    HDR_LEN,
    MAX_CHUNK_FILE_BYTES,
    TAG_LEN,
    Deadline,
    authenticate_source,
    derive_key,
)
from kvpersist.l2.layout import display_name
from kvpersist.l2.tree import RootDir, chunk_dirs
from kvpersist.l2.verify.frame_record import FrameRecord
from kvpersist.l2.verify.frame_store import FrameSummary, bind_frames, header_reader
from kvpersist.l2.verify.order import Group, ReadOrder, failed_verdict
from kvpersist.l2.verify.quarantine import DirCache, Seen, quarantine
from kvpersist.l2.verify.rules import dup_detail, perm_verdict, shared_frames, type_verdict
from kvpersist.system.untrusted import ChunkFile, UnreadableFile

SCHEMA = "kvpersist.verify/1"
#: ``since_ns`` of a check of the frame record alone: no file is modified at or after it
EMPTY_WINDOW = (1 << 63) - 1

@dataclass(frozen=True)
class Finding:
    path: str
    kind: str  # size / auth / temp / type / perm / dup / moved
    detail: str
    size: int


@dataclass
class VerifyResult:
    root: str
    namespace: str
    serde: str
    apply: bool
    files: int = 0
    bytes_read: int = 0
    authenticated: int = 0
    findings: list[Finding] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: problems that did not affect the check (e.g. the run could not be recorded)
    warnings: list[str] = field(default_factory=list)
    #: only files modified at or after this instant (ns since the epoch) were checked
    since_ns: int | None = None
    #: chunk files in the window that were not read because ``deadline_s`` ran out
    unchecked: int = 0
    #: files outside the window read to learn a namespace's frame length
    reference_reads: int = 0
    #: warm-set pinned files among the chunk files checked (they are checked first)
    pinned: int = 0
    #: findings about warm-set pinned files
    pinned_findings: int = 0
    #: the check of the namespace's frame record (None: no record was given)
    frames: FrameSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        d["findings"] = [asdict(f) for f in self.findings]
        return d


# --------------------------------------------------------------------------- pure helpers


def expected_sizes(sizes: dict[tuple[str, int], list[int]]) -> dict[tuple[str, int], int]:
    """The usual size per (prefix, kv world size): the most common one (pure)."""
    return {k: Counter(v).most_common(1)[0][0] for k, v in sizes.items() if v}


# --------------------------------------------------------------------------- walking (I/O)


class _Throttle:
    def __init__(self, rate_mb_s: float | None) -> None:
        self.rate = rate_mb_s * 1e6 if rate_mb_s else None
        self.t0 = time.monotonic()
        self.done = 0

    def account(self, n: int) -> None:
        self.done += n
        if self.rate:
            ahead = self.done / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def _open(dir_fd: int, name: str, *, max_bytes: int, where: str,
          on_read: Callable[[int], None]) -> ChunkFile:
    """The chunk file ``name`` of ``dir_fd`` opened for reading (the one place verify opens
    a file; :class:`~kvpersist.system.untrusted.ChunkFile` bounds it). Raises OSError or
    UnreadableFile."""
    return ChunkFile(dir_fd, name, max_bytes=max_bytes, where=where, on_read=on_read)


def verify_root(root: RootDir, namespace: str, *, serde: str = "aesgcm",
                key: bytes | None = None, aes_bits: int = 128, apply: bool = False,
                temp_age: float = 600.0, rate_mb_s: float | None = 200.0,
                all_namespaces: bool = False, since_ns: int | None = None,
                deadline_s: float | None = None,
                progress: Callable[[int, int], None] | None = None,
                first: frozenset[str] = frozenset(),
                key_for: Callable[[str], bytes | None] | None = None,
                max_bytes_for: Callable[[str], int] | None = None,
                record: FrameRecord | None = None) -> VerifyResult:
    """Check the chunk files under the open ``root``; quarantine findings when ``apply``.

    ``key`` is the master key (aesgcm); files of ``namespace`` (all prefixes when
    ``all_namespaces``) are authenticated with it. Only the chunk directories are visited (the
    root and ``ab/cd`` shard directories, never through a symlink), and only files named as
    chunks or temp files of their directory (a chunk in the wrong shard directory is foreign:
    never touched). Files that cannot be read are listed in ``skipped``. With ``since_ns``
    only chunk files whose mtime is at or after it are checked (sizes are still compared with
    every file of the namespace), and no temp file is a finding; ``deadline_s`` stops reading
    after that many seconds (``unchecked`` counts the rest). Files named in ``first`` (the
    warm-set pins, what every session needs first) are checked before all others, so a
    deadline never leaves them unchecked while others were read. Raises KvpError if, with
    ``apply``, the quarantine directory cannot be made safely.

    ``key_for`` (per-namespace keys, docs/keys-and-shred.md) replaces ``key``: the master key
    of each prefix, or None for a prefix whose key is not known (judged by size only).
    ``max_bytes_for``: the largest chunk file of each prefix (default
    :data:`~kvpersist.l2.frames.MAX_CHUNK_FILE_BYTES`); a larger one is a ``size`` finding,
    never read.

    ``record``: the namespace's frame record (:mod:`~kvpersist.l2.verify.frame_store`): the
    identities of the frames that authenticated, and the first bytes of every other file of
    the namespace that changed since the record saw it (within ``deadline_s``), are judged
    against it: a frame recorded under another name is a ``moved`` finding (``dup``: an
    unknown frame read under several names); the rest is learned into ``record`` (in place,
    not written). ``since_ns`` :data:`EMPTY_WINDOW` checks the record alone.
    """
    t0 = time.monotonic()
    res = VerifyResult(root.given or root.path, namespace, serde, apply, since_ns=since_ns)
    targets = _check(root, res, key_for=key_for or (lambda _prefix: key), aes_bits=aes_bits,
                     temp_age=temp_age, rate_mb_s=rate_mb_s, all_namespaces=all_namespaces,
                     progress=progress,
                     deadline=None if deadline_s is None else t0 + deadline_s, first=first,
                     max_bytes_for=max_bytes_for or (lambda _prefix: MAX_CHUNK_FILE_BYTES),
                     record=record)
    if apply:
        res.quarantined = quarantine(root, res.root, ((f.path, f.kind, seen) for f, seen
                                                      in zip(res.findings, targets,
                                                             strict=True)), res.skipped)
    res.seconds = time.monotonic() - t0
    return res


def _check(r: RootDir, res: VerifyResult, *, key_for: Callable[[str], bytes | None],
           aes_bits: int,
           temp_age: float, rate_mb_s: float | None, all_namespaces: bool,
           progress: Callable[[int, int], None] | None,
           deadline: float | None = None, first: frozenset[str] = frozenset(),
           max_bytes_for: Callable[[str], int] = lambda _prefix: MAX_CHUNK_FILE_BYTES,
           record: FrameRecord | None = None) -> list[Seen]:
    """Fill ``res.findings``; return, for each finding, the file it is about."""
    namespace, serde, since = res.namespace, res.serde, res.since_ns
    targets: list[Seen] = []
    mine: list[Seen] = []  # the namespace's regular chunk files (the frame record's)
    now = time.time()
    chunks: list[tuple[Seen, layout.ChunkName]] = []
    others: list[tuple[Seen, layout.ChunkName]] = []  # outside the window
    sizes: dict[tuple[str, int], list[int]] = {}

    def shown(rel: str, name: str = "") -> str:
        return display_name(os.path.join(res.root, rel, name) if name
                            else os.path.join(res.root, rel))

    def note(rel: str, exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            res.skipped.append(f"{shown(rel)}: {exc.strerror}")

    def finding(seen: Seen, kind: str, detail: str) -> None:
        # the path as it is (lossless in --json); the table and the messages escape it
        res.findings.append(Finding(os.path.join(res.root, seen.rel, seen.name), kind, detail,
                                    seen.size))
        targets.append(seen)
        if seen.name in first:
            res.pinned_findings += 1

    root_st = os.fstat(r.fd)  # the server runs as the cache root's owner
    with chunk_dirs(r.fd, on_error=note) as dirs:
        for d in dirs:
            try:
                for e in d.entries():
                    regular = e.is_file(follow_symlinks=False)
                    kind, parsed = layout.classify(e.name, d.shard)
                    if parsed is None or (not regular and kind != layout.Kind.CHUNK):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError as exc:
                        note(d.path_of(e.name), exc)
                        continue
                    seen = Seen.of(d.rel, e.name, st)
                    if regular and kind == layout.Kind.CHUNK and parsed.prefix == namespace:
                        mine.append(seen)
                    odd = None if kind == layout.Kind.TEMP else (
                        ("type", type_verdict(st.st_mode)) if not regular else
                        ("perm", perm_verdict(st.st_mode, st.st_uid, st.st_gid,
                                              root_st.st_uid, root_st.st_gid)))
                    if odd is not None and odd[1] is not None:
                        if since is None or st.st_mtime_ns >= since:
                            res.files += 1
                            finding(seen, odd[0], odd[1])
                        continue
                    if kind == layout.Kind.TEMP:
                        age = now - st.st_mtime
                        if since is None and age >= temp_age:
                            finding(seen, "temp", f"interrupted write, untouched {age:.0f} s")
                        continue
                    limit = max_bytes_for(parsed.prefix)
                    if st.st_size > limit:  # never read: no chunk of its namespace is this big
                        if since is None or st.st_mtime_ns >= since:
                            res.files += 1
                            finding(seen, "size", f"{st.st_size:,} bytes, more than the "
                                    f"{limit:,} a chunk file of this namespace can be")
                        continue
                    sizes.setdefault((parsed.prefix, parsed.rank.world_size),
                                     []).append(st.st_size)
                    if since is not None and st.st_mtime_ns < since:
                        others.append((seen, parsed))
                        continue
                    res.files += 1
                    chunks.append((seen, parsed))
            except OSError as exc:  # the listing itself failed
                note(d.rel or ".", exc)
    if first:
        res.pinned = sum(1 for seen, _ in chunks if seen.name in first)
    usual = expected_sizes(sizes)
    keys: dict[tuple[str, str], bytes] = {}
    known_plain: dict[Group, int] = {}
    #: the sizes of each group's files that authenticated: what an authentic file looks like
    authentic: dict[Group, Counter[int]] = {}
    #: files that failed before their group's frame length was known: tried again after
    pending: dict[Group, list[tuple[Seen, layout.ChunkName]]] = {}
    referenced: set[Group] = set()  # groups whose older files were read to learn the length
    searches: Counter[Group] = Counter()  # files tried at every aligned length, per group
    throttle = _Throttle(rate_mb_s)
    dirs_open = DirCache(r.fd)
    frames: list[tuple[bytes, Seen]] = []  # the IV of each frame that authenticated

    def authenticates(parsed: layout.ChunkName) -> bool:
        """Whether every file of ``parsed``'s group is read and authenticated."""
        return (serde == "aesgcm" and key_for(parsed.prefix) is not None
                and (all_namespaces or parsed.prefix == namespace))

    # the warm set first, then authentic sizes before sizes seen to fail (verify_order)
    order: ReadOrder[tuple[Seen, layout.ChunkName]] = ReadOrder()
    for seen, parsed in chunks:
        group = (parsed.prefix, parsed.rank.world_size)
        order.add((seen, parsed), (group, seen.size) if authenticates(parsed) else None,
                  pinned=seen.name in first)

    def read_auth(seen: Seen, parsed: layout.ChunkName,
                  known: int | None) -> tuple[bool, int | None]:
        """(read, plaintext length or None); read is False if the file could not be read.
        Raises Deadline when ``deadline`` passes in the middle of the file."""
        salt = parsed.salt or ""
        if (parsed.prefix, salt) not in keys:
            master = key_for(parsed.prefix)
            assert master is not None
            keys[parsed.prefix, salt] = derive_key(master, salt, aes_bits)
        group = (parsed.prefix, parsed.rank.world_size)
        aligned = known is None and searches[group] < ALIGNED_SEARCHES
        try:
            with _open(dirs_open.get(seen.rel), seen.name,
                       max_bytes=max_bytes_for(parsed.prefix),
                       where=shown(seen.rel, seen.name), on_read=counted) as f:
                if not seen.same(f.st):
                    res.skipped.append(f"{shown(seen.rel, seen.name)}: changed while it was "
                                       "being checked")
                    return False, None
                found = authenticate_source(f, keys[parsed.prefix, salt], known, aligned,
                                            stop=out_of_time)
        except FileNotFoundError:
            return False, None
        except OSError as exc:
            note(os.path.join(seen.rel, seen.name), exc)
            return False, None
        except UnreadableFile as exc:  # no longer a regular file, or grown past the bound
            res.skipped.append(str(exc))
            return False, None
        if found is None:
            if aligned:
                searches[group] += 1
            return True, None
        frames.append((found[1], seen))
        return True, found[0]

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    def counted(nbytes: int) -> None:
        res.bytes_read += nbytes
        throttle.account(nbytes)

    def passed(seen: Seen, group: Group, n: int, counted: bool = True) -> None:
        """``seen`` authenticated with plaintext length ``n``: never a finding."""
        known_plain[group] = n
        authentic.setdefault(group, Counter())[seen.size] += 1
        order.learned((group, seen.size), True)
        if counted:
            res.authenticated += 1

    def condemn(seen: Seen, group: Group) -> None:
        """``seen`` was read and fails authentication with every length to try."""
        finding(seen, *failed_verdict(seen.size, authentic.get(group, Counter()),
                                      usual.get(group)))

    def judge(seen: Seen, parsed: layout.ChunkName, group: Group) -> None:
        """A file of a group verify authenticates: read, and condemned only if it fails."""
        if seen.size < FRAME_OVERHEAD:
            finding(seen, "size", "too small for an aesgcm frame")
            return
        ok, n = read_auth(seen, parsed, known_plain.get(group))
        if not ok:
            return
        if n is not None:
            passed(seen, group, n)
            return
        order.learned((group, seen.size), False)
        if group in known_plain:
            condemn(seen, group)
            return
        pending.setdefault(group, []).append((seen, parsed))
        if group not in referenced:  # learn the length now: it says which size to read next
            referenced.add(group)
            ref = _learn_length(group, others, read_auth, res)
            if ref is not None:
                passed(ref[0], group, ref[1], counted=False)

    def judge_plain(seen: Seen, parsed: layout.ChunkName, group: Group) -> None:
        """A file verify does not authenticate (serde none, no key, another namespace): its
        size against its group's usual size; with a key, an outlier is read and kept if it
        authenticates."""
        size, want = seen.size, usual.get(group)
        if want is not None and size != want:
            detail = f"{size} bytes where this namespace's chunks have {want}"
            if serde == "aesgcm" and key_for(parsed.prefix) is not None \
                    and size >= FRAME_OVERHEAD:
                ok, n = read_auth(seen, parsed, known_plain.get(group))
                if not ok:
                    return
                if n is not None:
                    passed(seen, group, n)
                    return
                detail += ", and its frame fails AES-GCM authentication with the key"
            finding(seen, "size", detail)
        elif serde == "aesgcm" and size < FRAME_OVERHEAD:
            finding(seen, "size", "too small for an aesgcm frame")

    try:
        i = 0
        while (item := order.pop()) is not None:
            if progress is not None and (i % 64 == 0 or i == len(chunks) - 1):
                progress(i + 1, len(chunks))
            i += 1
            if deadline is not None and time.monotonic() >= deadline:
                # undecided: the rest, and the failures that a length still to learn decides
                res.unchecked = 1 + len(order) + sum(len(f) for f in pending.values())
                pending.clear()
                break
            seen, parsed = item
            group = (parsed.prefix, parsed.rank.world_size)
            try:
                (judge if authenticates(parsed) else judge_plain)(seen, parsed, group)
            except Deadline:  # ran out in the middle of a file: it and the rest unchecked
                waiting = sum(len(f) for f in pending.values())
                here = any(p[0] is seen for p in pending.get(group, ()))
                res.unchecked = (0 if here else 1) + len(order) + waiting
                pending.clear()
                break
        retries = [(g, seen, parsed) for g, failed in pending.items() for seen, parsed in failed]
        for j, (group, seen, parsed) in enumerate(retries):
            known = known_plain.get(group)
            if known is None or seen.size < HDR_LEN + known + TAG_LEN:
                condemn(seen, group)  # nothing more to try: it failed every length that fits
                continue
            if deadline is not None and time.monotonic() >= deadline:
                res.unchecked += len(retries) - j
                break
            try:
                ok, n = read_auth(seen, parsed, known)
            except Deadline:
                res.unchecked += len(retries) - j
                break
            if n is not None:
                passed(seen, group, n)
            elif ok:
                condemn(seen, group)
        for seen, count in shared_frames(frames).items():
            finding(seen, "dup", dup_detail(count))
        if record is not None:
            flagged = {t.name for t in targets}
            ivs = {s.name: iv for iv, s in frames if s.name not in flagged}
            found, res.frames = bind_frames(
                record, mine, ivs, skip=flagged, out_of_time=out_of_time,
                read_header=header_reader(dirs_open.get, max_bytes_for(namespace), counted))
            for seen, what, detail in found:
                finding(seen, what, detail)
    finally:
        dirs_open.close()
    return targets


#: at most this many files outside a crash window are read to learn a frame length
REFERENCE_READS = 8


def _learn_length(group: Group, others: list[tuple[Seen, layout.ChunkName]],
                  read_auth: Callable[[Seen, layout.ChunkName, int | None],
                                      tuple[bool, int | None]],
                  res: VerifyResult) -> tuple[Seen, int] | None:
    """The first of up to :data:`REFERENCE_READS` of ``group``'s files outside the window
    (newest first: most likely written under the current key) that authenticates, with its
    plaintext length; None if none does."""
    same = sorted((o for o in others if (o[1].prefix, o[1].rank.world_size) == group),
                  key=lambda o: o[0].mtime_ns, reverse=True)
    for seen, parsed in same[:REFERENCE_READS]:
        res.reference_reads += 1
        _, n = read_auth(seen, parsed, None)
        if n is not None:
            return seen, n
    return None
