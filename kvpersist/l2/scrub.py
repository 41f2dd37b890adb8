"""Zero the padding after the aesgcm frame of each chunk file (I/O; explicit command only).

LMCache 0.5.6 writes every chunk file as whole 4 KiB pages of an L1 buffer that it never
clears: after the frame ``[version][iv][ciphertext||tag]`` the file holds whatever that L1
memory held before, once L1 is reused plaintext KV of other chunks (possibly of other
tenants), on disk in clear (docs/lmcache-publish-path.md). ``scrub`` overwrites exactly those
bytes with zeros, in place, and never a byte of the frame.

Why it is safe while LMCache runs (read in ``lmcache==0.5.6``):

* a reader uses only the frame: ``dynamic_load`` reads the file's pages into an L1 buffer and
  ``AesGcmDeserializer.deserialize`` takes the ciphertext length from the chunk's KV layout
  (``frame_end = 1 + 12 + plaintext + 16``), never from the file; the padding it reads is
  ignored, so a read that overlaps a scrub sees the same frame whatever it sees after it;
* LMCache never writes into a published file: a store writes ``<name>.tmp.<uuid>`` (a new
  inode) and renames it over the name. The scrub opens the name once (relative to the
  directory's descriptor, ``O_NOFOLLOW``), checks with ``fstat`` that it is the regular file
  listed (device, inode, size), reads and authenticates the frame through that descriptor
  with the deployment's key, and writes zeros through the same descriptor with ``pwrite``,
  only from the frame's end to the file's end, then ``fsync``. A file that LMCache (or prune,
  or verify's quarantine) replaced or removed meanwhile is another inode: the zeros land in
  the one that was authenticated, past its frame;
* the file's size, atime and mtime are kept (restored with ``futimens``), so retention,
  crash-window checks and the re-checks of prune and verify see the file they listed.

Only a file whose frame authenticates is written, and only when its padding is not all zeros
already. Every file is opened through :class:`~kvpersist.system.untrusted.ChunkFile` and
authenticated streamed (:func:`kvpersist.l2.frames.authenticate_source`): a file larger
than its namespace's geometry allows is not read (named in ``skipped``; ``verify``
quarantines it), and memory is a block's whatever a file's size (issue 40: a 50 GB sparse
file named like a chunk ended the scrub with ``MemoryError``). A file with a second hard
link is never written: LMCache never links its files, so the other name is someone else's
(the zeros would land in it too).

Clean files cost one read of their last bytes: the plaintext length of a namespace's chunks
is learned from the first file that authenticates (per kv world size and file size), after
which a file's padding is read alone (under 4 KiB) and the rest of the file
only if that padding is dirty. A file that fails authentication is left alone (``verify``'s
business).
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
    MAX_CHUNK_FILE_BYTES,
    Deadline,
    authenticate_source,
    derive_key,
    frame_end,
)
from kvpersist.l2.layout import display_name
from kvpersist.l2.tree import RootDir, chunk_dirs, open_rel
from kvpersist.l2.verify.frame_record import FrameRecord, judge
from kvpersist.system.untrusted import ChunkFile, UnreadableFile

SCHEMA = "kvpersist.scrub/1"


@dataclass
class ScrubResult:
    """What a scrub saw and did (``kvpersist.scrub/1``)."""

    root: str
    namespace: str
    apply: bool
    #: chunk files of the namespace looked at
    files: int = 0
    #: files whose padding is all zeros already (nothing written)
    clean: int = 0
    #: files whose padding holds non-zero bytes and whose frame authenticates
    dirty: int = 0
    #: of those, the files zeroed (``apply``)
    scrubbed: int = 0
    #: padding bytes that are (dry run: would be) overwritten with zeros
    bytes_zeroed: int = 0
    bytes_read: int = 0
    #: files whose frame does not authenticate (or whose length is unknown): left alone
    unauthenticated: int = 0
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: only files modified at or after this instant (ns since the epoch) were looked at
    since_ns: int | None = None
    #: files not looked at because ``deadline_s`` ran out
    unchecked: int = 0
    #: files whose frame the namespace's frame record holds under another chunk's name
    #: (:mod:`kvpersist.l2.verify.frame_record`): left for ``verify --apply``
    moved: list[str] = field(default_factory=list)
    #: problems that did not affect the scrub (a frame record refused or not written)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        return d


@dataclass(frozen=True, slots=True)
class _Listed:
    rel: str
    name: str
    dev: int
    ino: int
    size: int
    salt: str
    group: tuple[str, int]
    ctime_ns: int = 0


def scrub_root(root: RootDir, namespace: str, key: bytes, *, aes_bits: int = 128,
               apply: bool = False, since_ns: int | None = None,
               deadline_s: float | None = None,
               progress: Callable[[int, int], None] | None = None,
               max_bytes: int = MAX_CHUNK_FILE_BYTES,
               record: FrameRecord | None = None) -> ScrubResult:
    """Zero the padding after the aesgcm frame of ``namespace``'s chunk files under the open
    ``root`` when ``apply`` (a dry run counts what would be zeroed). ``key`` is the master key
    of the namespace; ``since_ns`` limits the scrub to files modified at or after that instant;
    ``deadline_s`` stops it after that many seconds, in the middle of a file too
    (``unchecked`` counts the rest); ``max_bytes``: the largest chunk file of the namespace
    (:func:`~kvpersist.l2.frames.max_chunk_file_bytes`), a larger one is not read.
    ``record``: the namespace's frame record; the identity of each frame the scrub
    authenticates is judged against it and learned (in place, not written), and a frame it
    holds under another chunk's name is listed in ``moved`` (verify quarantines it).

    Only the chunk directories are visited (the root and ``ab/cd`` shard directories, never
    through a symlink) and only regular files named as the namespace's chunks. Files that
    cannot be opened, or changed between the listing and the open, are listed in ``skipped``.
    Never raises for a single file; raises OSError only if the root cannot be listed at all.
    """
    t0 = time.monotonic()
    res = ScrubResult(root.given or root.path, namespace, apply, since_ns=since_ns)
    listed = _list(root, res)
    keys: dict[str, bytes] = {}
    #: plaintext length per (group, file size), learned from a file that authenticates
    known: dict[tuple[tuple[str, int], int], int] = {}
    searches: Counter[tuple[str, int]] = Counter()
    dirs: dict[str, int] = {}
    #: name -> (frame identity, inode, ctime) of each frame authenticated
    ivs: dict[str, tuple[bytes, int, int]] = {}

    def out_of_time() -> bool:
        return deadline_s is not None and time.monotonic() - t0 >= deadline_s

    try:
        for i, f in enumerate(listed):
            if progress is not None and (i % 256 == 0 or i == len(listed) - 1):
                progress(i + 1, len(listed))
            if out_of_time():
                res.unchecked = len(listed) - i
                break
            if f.size > max_bytes:  # never read: no chunk of the namespace is this big
                res.skipped.append(f"{_shown(res, f.rel, f.name)}: {f.size:,} bytes, more "
                                   f"than the {max_bytes:,} a chunk file of {res.namespace} "
                                   "can be: not read (kvp-admin verify --apply quarantines it)")
                continue
            if f.salt not in keys:
                keys[f.salt] = derive_key(key, f.salt, aes_bits)
            try:
                dfd = dirs.get(f.rel)
                if dfd is None:
                    dfd = dirs[f.rel] = _open_dir(root, f.rel)
                _scrub_file(dfd, f, keys[f.salt], known, searches, res, max_bytes,
                            out_of_time, ivs)
            except Deadline:
                res.unchecked = len(listed) - i
                break
            except UnreadableFile as exc:  # no longer a regular file, or grown past the bound
                res.skipped.append(str(exc))
            except OSError as exc:
                if not isinstance(exc, FileNotFoundError):
                    res.skipped.append(f"{_shown(res, f.rel, f.name)}: {exc.strerror or exc}")
    finally:
        for fd in dirs.values():
            os.close(fd)
    if record is not None and ivs:
        seen = {n: v[0] for n, v in ivs.items()}
        judged = judge(record, seen, None)  # the listing may be a window: nothing is gone
        record.learn(judged, seen, {n: (v[1], v[2]) for n, v in ivs.items()})
        res.moved = sorted(judged.findings())
    res.seconds = time.monotonic() - t0
    return res


def _shown(res: ScrubResult, rel: str, name: str) -> str:
    return display_name(os.path.join(res.root, rel, name))


def _open_dir(root: RootDir, rel: str) -> int:
    return open_rel(root.fd, rel)


def _list(root: RootDir, res: ScrubResult) -> list[_Listed]:
    """The regular files named as ``res.namespace``'s chunks (in the window, if any)."""
    out: list[_Listed] = []

    def note(rel: str, exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            res.skipped.append(f"{display_name(os.path.join(res.root, rel))}: {exc.strerror}")

    with chunk_dirs(root.fd, on_error=note) as walk:
        for d in walk:
            try:
                for e in d.entries():
                    kind, parsed = layout.classify(e.name, d.shard)
                    if (kind != layout.Kind.CHUNK or parsed is None
                            or parsed.prefix != res.namespace
                            or not e.is_file(follow_symlinks=False)):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError as exc:
                        note(d.path_of(e.name), exc)
                        continue
                    if res.since_ns is not None and st.st_mtime_ns < res.since_ns:
                        continue
                    out.append(_Listed(d.rel, e.name, st.st_dev, st.st_ino, st.st_size,
                                       parsed.salt or "",
                                       (parsed.prefix, parsed.rank.world_size),
                                       st.st_ctime_ns))
            except OSError as exc:
                note(d.rel or ".", exc)
    return out


def _scrub_file(dfd: int, f: _Listed, key: bytes,
                known: dict[tuple[tuple[str, int], int], int],
                searches: Counter[tuple[str, int]], res: ScrubResult, max_bytes: int,
                stop: Callable[[], bool], ivs: dict[str, tuple[bytes, int, int]]) -> None:
    """Look at one file; zero its padding if it is dirty, authenticates and ``res.apply``;
    the identity of a frame that authenticates goes to ``ivs`` (with the file's inode and
    ctime after the scrub's own write). Raises OSError, UnreadableFile or Deadline (the
    caller notes them)."""
    def counted(n: int) -> None:
        res.bytes_read += n

    shown = _shown(res, f.rel, f.name)
    with ChunkFile(dfd, f.name, max_bytes=max_bytes, write=res.apply, where=shown,
                   on_read=counted) as cf:
        st = cf.st
        if (st.st_dev, st.st_ino, st.st_size) != (f.dev, f.ino, f.size):
            res.skipped.append(f"{shown}: changed since it was listed")
            return
        if st.st_nlink != 1:  # LMCache never links its files: the other name is not ours
            res.skipped.append(f"{shown}: has {st.st_nlink} hard links; LMCache never links "
                               "its files, so another name shares it: not written")
            return
        res.files += 1
        n = known.get((f.group, f.size))
        if n is not None and frame_end(n) <= f.size and _zeros(cf, frame_end(n), f.size):
            res.clean += 1
            return
        aligned = searches[f.group] < ALIGNED_SEARCHES
        found = authenticate_source(cf, key, n, aligned=aligned, stop=stop)
        if found is None:
            if aligned and n is None:
                searches[f.group] += 1
            res.unauthenticated += 1
            return
        n = found[0]
        ivs[f.name] = (found[1], st.st_ino, st.st_ctime_ns)
        known[(f.group, f.size)] = n
        end = frame_end(n)
        if _zeros(cf, end, f.size):
            res.clean += 1
            return
        res.dirty += 1
        res.bytes_zeroed += f.size - end
        if not res.apply:
            return
        now = os.fstat(cf.fd)
        if (now.st_size, now.st_mtime_ns, now.st_nlink) != (st.st_size, st.st_mtime_ns, 1):
            res.skipped.append(f"{shown}: changed while it was read")
            res.dirty -= 1
            res.bytes_zeroed -= f.size - end
            return
        _pwrite_all(cf.fd, bytes(f.size - end), end)
        os.fsync(cf.fd)
        os.utime(cf.fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        ivs[f.name] = (found[1], st.st_ino, os.fstat(cf.fd).st_ctime_ns)
        res.scrubbed += 1


def _zeros(cf: ChunkFile, start: int, end: int) -> bool:
    """Whether the bytes ``[start, end)`` of ``cf`` are all zeros (read in blocks)."""
    return not any(any(b) for b in cf.blocks(start, end))


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
